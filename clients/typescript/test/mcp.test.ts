/** The /mcp endpoint through the official TypeScript MCP client (@modelcontextprotocol/sdk). */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

import { KpScoringClient, type Evaluation } from "../src/index.js";
import { BASE_URL, SCORE_TOLERANCE, exampleTrace, noEmbedderCases } from "./env.js";

const mcp = new Client({ name: "kp-scoring-tests", version: "0.0.0" });
const rest = new KpScoringClient({ baseUrl: BASE_URL });

before(async () => {
  await mcp.connect(new StreamableHTTPClientTransport(new URL(`${BASE_URL}/mcp`)));
});

after(async () => {
  await mcp.close();
});

test("the server lists kp_score_trace, kp_score_traces and kp_check_contribution", async () => {
  const { tools } = await mcp.listTools();
  assert.deepEqual(
    tools.map((t) => t.name),
    ["kp_score_trace", "kp_score_traces", "kp_check_contribution"],
  );
  const [one, batch] = tools;
  const properties = one!.inputSchema.properties as Record<string, unknown>;
  assert.deepEqual(one!.inputSchema.required, ["@context", "@type", "id", "metadata", "task", "steps", "outcome"]);
  assert.ok("dry_run" in properties && "steps" in properties && "@context" in properties);
  assert.deepEqual(batch!.inputSchema.required, ["traces"]);
  assert.ok(one!.outputSchema && batch!.outputSchema);
});

test("kp_score_trace gives the REST scores for the reference traces", async () => {
  const cases = noEmbedderCases();
  const mismatches = [];
  for (const c of cases) {
    // The client validates structuredContent against the tool's outputSchema.
    const result = await mcp.callTool({ name: "kp_score_trace", arguments: { ...c.trace, dry_run: true } });
    assert.notEqual(result.isError, true);
    const answer = result.structuredContent as Evaluation;
    const viaRest = await rest.score(c.trace, { dryRun: true });
    if (
      Math.abs(answer.score - viaRest.score) > 0 ||
      Math.abs(answer.score - c.expected_score!) > SCORE_TOLERANCE ||
      JSON.stringify({ ...answer, elapsed_ms: 0 }) !== JSON.stringify({ ...viaRest, elapsed_ms: 0 })
    ) {
      mismatches.push(c.name);
    }
  }
  assert.deepEqual(mismatches, []);
});

test("kp_score_trace's text is a one-line summary with the verdict", async () => {
  const result = await mcp.callTool({ name: "kp_score_trace", arguments: { ...exampleTrace(), dry_run: true } });
  const [content] = result.content as { type: string; text: string }[];
  assert.equal(content!.type, "text");
  assert.equal(
    content!.text,
    "score 0.57625 is below the 0.75 sharing threshold; task_domain not recognised, scored with " +
      "the default weights; novelty not measured (embedder_unavailable)",
  );
});

test("kp_score_traces scores in order, as POST /evaluate/batch", async () => {
  const cases = noEmbedderCases().slice(0, 10);
  const traces = cases.map((c) => c.trace);
  const result = await mcp.callTool({ name: "kp_score_traces", arguments: { traces, dry_run: true } });
  const { results } = result.structuredContent as { results: Evaluation[] };
  const viaRest = await rest.scoreBatch(traces, { dryRun: true });
  assert.deepEqual(
    results.map((r) => [r.trace_id, r.score]),
    viaRest.map((r) => [r.trace_id, r.score]),
  );
});

test("a bad trace is a tool error naming the field; nothing is scored", async () => {
  const trace = exampleTrace();
  (trace.steps[0] as { type: string }).type = "daydream";
  const result = await mcp.callTool({ name: "kp_score_trace", arguments: trace });
  assert.equal(result.isError, true);
  const [content] = result.content as { text: string }[];
  assert.match(content!.text, /^invalid arguments, nothing was scored: steps\.0\.type: Input should be/);
  const missing = await mcp.callTool({ name: "kp_score_traces", arguments: { traces: [{ id: "kp:trace:x" }] } });
  assert.equal(missing.isError, true);
  assert.match((missing.content as { text: string }[])[0]!.text, /traces\.0\.metadata: Field required/);
});
