// Times the reference SDK's evaluateValue for python -m bench (bench/reference.py).
// Copied next to sdk.mjs in the reference folder (bench/reference_setup.py) so that the SDK's
// import("@huggingface/transformers") and this file's resolve to the same module.
//
//   node runner.mjs --cold TRACE.json   one call in a fresh process, then exit
//   node runner.mjs                     JSON lines on stdin, one answer line each:
//     {"op": "score", "traces": [...]}        one call at a time: {"ms": [...], "scores": [...]}
//     {"op": "clients", "traces": [...], "clients": 16}   closed loop: {"elapsed_ms", "count"}
//     {"op": "clear"}                         empties the SDK's vector cache
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const importStarted = performance.now();
const transformers = await import("@huggingface/transformers");
// Only the local files: the service's model, linked by reference_setup.py.
transformers.env.localModelPath = join(here, "models") + "/";
transformers.env.allowRemoteModels = false;
const sdk = await import(join(here, "sdk.mjs"));
const importMs = performance.now() - importStarted;

function write(value) {
  process.stdout.write(`${JSON.stringify(value)}\n`);
}

if (process.argv[2] === "--cold") {
  const trace = JSON.parse(readFileSync(process.argv[3], "utf8"));
  const started = performance.now();
  const score = await sdk.evaluateValue(trace);
  const end = performance.now();
  // performance.now() counts from the process's start (its time origin).
  write({ score, import_ms: importMs, first_call_ms: end - started, since_start_ms: end });
  process.exit(0);
}

async function score(traces) {
  const ms = [];
  const scores = [];
  for (const trace of traces) {
    const started = performance.now();
    scores.push(await sdk.evaluateValue(trace));
    ms.push(performance.now() - started);
  }
  return { ms, scores };
}

async function clients(traces, count) {
  let next = 0;
  const started = performance.now();
  async function client() {
    while (next < traces.length) {
      const trace = traces[next++];
      await sdk.evaluateValue(trace);
    }
  }
  await Promise.all(Array.from({ length: count }, client));
  return { elapsed_ms: performance.now() - started, count: traces.length };
}

write({ ready: true, import_ms: importMs });
for await (const line of createInterface({ input: process.stdin })) {
  const request = JSON.parse(line);
  if (request.op === "score") write(await score(request.traces));
  else if (request.op === "clients") write(await clients(request.traces, request.clients));
  else if (request.op === "clear") {
    sdk._getLocalCache().clear();
    write({ cleared: true });
  } else write({ error: `unknown op ${request.op}` });
}
