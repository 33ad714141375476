import assert from "node:assert/strict";
import { createServer, type IncomingHttpHeaders } from "node:http";
import type { AddressInfo } from "node:net";
import { test } from "node:test";

import {
  KpScoringClient,
  KpScoringError,
  evaluateValue,
  type Profile,
  type ReasoningTrace,
} from "../src/index.js";
import { ADMIN_TOKEN, BASE_URL, SCORE_TOLERANCE, exampleTrace, noEmbedderCases } from "./env.js";

const kp = new KpScoringClient({ baseUrl: BASE_URL });
const admin = new KpScoringClient({ baseUrl: BASE_URL, apiKey: ADMIN_TOKEN });

test("score answers the full evaluation (the README's example trace)", async () => {
  const answer = await kp.score(exampleTrace(), { dryRun: true });
  assert.equal(answer.trace_id, "kp:trace:550e8400-e29b-41d4-a716-446655440000");
  assert.ok(Math.abs(answer.score - 0.57625) < SCORE_TOLERANCE);
  assert.deepEqual(answer.overrides, ["low_tool_diversity"]);
  assert.equal(answer.weights.profile, "default");
  // The example's task_domain, "code-review", names no profile: the answer says so.
  const profile: Profile = answer.profile;
  assert.deepEqual(profile, { name: "default", domain_recognised: false });
  assert.equal(answer.novelty.reason, "embedder_unavailable");
});

test("evaluateValue returns the reference SDK's number for every reference trace", async () => {
  const cases = noEmbedderCases();
  assert.ok(cases.length > 300);
  const standalone = await evaluateValue(cases[0]!.trace, { baseUrl: BASE_URL });
  assert.ok(Math.abs(standalone - cases[0]!.expected_score!) < SCORE_TOLERANCE);
  const mismatches = [];
  for (const c of cases) {
    const got = await kp.evaluateValue(c.trace);
    if (Math.abs(got - c.expected_score!) > SCORE_TOLERANCE) mismatches.push([c.name, got]);
  }
  assert.deepEqual(mismatches, []);
});

test("contribution answers the evaluation and the cleaned trace", async () => {
  const trace = exampleTrace();
  trace.task.objective = "Mail ops@example.com";
  trace.steps[0]!.content = "key sk-abcdefghijklmnopqrstuvwxyz12";
  const answer = await kp.contribution(trace, { dryRun: true });
  assert.ok(Math.abs(answer.evaluation.score - 0.57625) < SCORE_TOLERANCE);
  assert.equal(answer.shareable, false);
  const sent = answer.contribution as unknown as ReasoningTrace;
  assert.equal(sent.metadata.quality_score, answer.evaluation.score);
  assert.equal(sent.steps[0]!.content, "key [REDACTED:api_key]");
  assert.deepEqual(answer.redactions, [
    { path: "/steps/0/content", type: "api_key", count: 1, detector: "cleanPii" },
  ]);
  assert.deepEqual(answer.uncleaned, [
    { path: "/task/objective", type: "email", count: 1, detector: "cleanPii" },
  ]);
  assert.deepEqual(answer.findings, []);
  assert.equal(answer.leaks_remain, true);
  assert.equal(answer.injection.highest?.max_score, 5.550000000000003);
});

test("contribution names suspected leaks and redacts them on request", async () => {
  const trace = exampleTrace();
  trace.steps[0]!.content = "call +44 20 7946 0958";
  const answer = await kp.contribution(trace, { dryRun: true, suspiciousThreshold: 0.01 });
  assert.deepEqual(answer.findings, [
    { path: "/steps/0/content", type: "phone", count: 1, detector: "phonenumbers" },
  ]);
  assert.equal(answer.injection.suspicious_threshold, 0.01);
  const redacted = await kp.contribution(trace, { dryRun: true, redactSuspected: true });
  const sent = redacted.contribution as unknown as ReasoningTrace;
  assert.equal(sent.steps[0]!.content, "call [REDACTED:phone]");
  assert.equal(redacted.differs_from_sdk, true);
  assert.equal(redacted.leaks_remain, false);
});

test("scoreBatch answers in order, as POST /evaluate/batch", async () => {
  const cases = noEmbedderCases().slice(0, 20);
  const results = await kp.scoreBatch(
    cases.map((c) => c.trace),
    { dryRun: true },
  );
  assert.deepEqual(
    results.map((r) => r.trace_id),
    cases.map((c) => c.trace.id),
  );
  for (const [i, r] of results.entries()) {
    assert.ok(Math.abs(r.score - cases[i]!.expected_score!) < SCORE_TOLERANCE);
  }
});

test("a bad trace is a 422 KpScoringError naming the field", async () => {
  const trace = exampleTrace();
  (trace.steps[0] as { type: string }).type = "daydream";
  await assert.rejects(kp.score(trace), (error: unknown) => {
    assert.ok(error instanceof KpScoringError);
    assert.equal(error.status, 422);
    assert.deepEqual(error.fields, ["steps.0.type"]);
    assert.match(error.message, /POST \/evaluate: 422 steps\.0\.type: Input should be/);
    assert.equal(error.retryable, false);
    return true;
  });
});

test("cache admin needs the token; with it, stats and clear", async () => {
  await assert.rejects(kp.cacheStats(), (error: unknown) => {
    assert.ok(error instanceof KpScoringError);
    assert.equal(error.status, 401);
    return true;
  });
  const stats = await admin.cacheStats();
  assert.equal(stats.size, 0);
  assert.equal(stats.backend.kind, "in_process");
  assert.equal(await admin.clearCache(), 0);
  assert.equal((await kp.readiness()).status, "degraded");
});

test("namespace goes as KP-Namespace, a call's own over the client's", async () => {
  const sent: (string | null)[] = [];
  const recording: typeof fetch = async (input, init) => {
    sent.push(new Headers(init?.headers).get("kp-namespace"));
    return fetch(input, init);
  };
  const client = new KpScoringClient({
    baseUrl: BASE_URL,
    apiKey: ADMIN_TOKEN,
    namespace: "ts-a",
    fetch: recording,
  });
  assert.equal((await client.cacheStats()).namespace, "ts-a");
  assert.equal((await client.cacheStats({ namespace: "ts-b" })).namespace, "ts-b");
  assert.equal(await client.clearCache({ namespace: "ts-b" }), 0);
  await kp.score(exampleTrace(), { dryRun: true, namespace: "ts-c" });
  await client.scoreBatch([exampleTrace()], { dryRun: true });
  assert.ok(Array.isArray(await client.namespaces()));
  assert.deepEqual(sent, ["ts-a", "ts-b", "ts-b", "ts-a", "ts-a"]);
  await assert.rejects(kp.score(exampleTrace(), { namespace: "ts/a" }), (error: unknown) => {
    assert.ok(error instanceof KpScoringError);
    assert.equal(error.status, 422);
    assert.deepEqual(error.fields, ["header.kp-namespace"]);
    return true;
  });
});

test("an unreachable service is a KpScoringError with status 0, after the retries", async () => {
  const nowhere = new KpScoringClient({ baseUrl: "http://127.0.0.1:9", retries: 1, retryDelayMs: 1 });
  await assert.rejects(nowhere.evaluateValue(exampleTrace()), (error: unknown) => {
    assert.ok(error instanceof KpScoringError);
    assert.equal(error.status, 0);
    assert.match(error.message, /no answer from http:\/\/127\.0\.0\.1:9/);
    return true;
  });
});

test("a 503 is retried after Retry-After with the same Idempotency-Key; a 4xx is not", async () => {
  // A stand-in that answers 503 twice, then forwards to the live server: the client's retry
  // logic is what is under test here.
  const seen: IncomingHttpHeaders[] = [];
  let overloadsLeft = 2;
  const proxy = createServer(async (request, response) => {
    seen.push(request.headers);
    if (overloadsLeft > 0) {
      overloadsLeft--;
      response.writeHead(503, { "retry-after": "0", "content-type": "application/json" });
      response.end(JSON.stringify({ detail: "overloaded, try again shortly" }));
      return;
    }
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    const upstream = await fetch(`${BASE_URL}${request.url}`, {
      method: request.method,
      headers: { "content-type": "application/json" },
      body: Buffer.concat(chunks),
    });
    response.writeHead(upstream.status, { "content-type": "application/json" });
    response.end(await upstream.text());
  });
  await new Promise<void>((resolve) => proxy.listen(0, "127.0.0.1", resolve));
  try {
    const { port } = proxy.address() as AddressInfo;
    const client = new KpScoringClient({ baseUrl: `http://127.0.0.1:${port}`, retries: 2 });
    const answer = await client.score(exampleTrace(), { dryRun: true });
    assert.ok(Math.abs(answer.score - 0.57625) < SCORE_TOLERANCE);
    assert.equal(seen.length, 3);
    const keys = seen.map((h) => h["idempotency-key"]);
    assert.match(String(keys[0]), /^[0-9a-f-]{36}$/);
    assert.deepEqual(keys, [keys[0], keys[0], keys[0]]);

    seen.length = 0;
    overloadsLeft = 3;
    await assert.rejects(client.score(exampleTrace()), (error: unknown) => {
      assert.ok(error instanceof KpScoringError);
      assert.equal(error.status, 503); // three tries, three 503s: the last one is thrown
      assert.equal(error.retryAfterS, 0);
      return true;
    });
    assert.equal(seen.length, 3);

    seen.length = 0;
    const bad = { ...exampleTrace(), id: "not-a-kp-id" };
    await assert.rejects(client.score(bad), (error: unknown) => {
      assert.ok(error instanceof KpScoringError);
      assert.equal(error.status, 422);
      assert.deepEqual(error.fields, ["id"]);
      return true;
    });
    assert.equal(seen.length, 1); // not retried
  } finally {
    proxy.close();
  }
});

test("an answer lost on the way is retried under its Idempotency-Key and replayed", async () => {
  // The stand-in forwards every request to the live server, but cuts the connection instead
  // of passing on the first answer: the trace was scored, the client never heard.
  const replayed: (string | null)[] = [];
  const proxy = createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    const upstream = await fetch(`${BASE_URL}${request.url}`, {
      method: request.method,
      headers: {
        "content-type": "application/json",
        "idempotency-key": String(request.headers["idempotency-key"]),
      },
      body: Buffer.concat(chunks),
    });
    replayed.push(upstream.headers.get("idempotent-replayed"));
    if (replayed.length === 1) {
      request.socket.destroy();
      return;
    }
    response.writeHead(upstream.status, { "content-type": "application/json" });
    response.end(await upstream.text());
  });
  await new Promise<void>((resolve) => proxy.listen(0, "127.0.0.1", resolve));
  try {
    const { port } = proxy.address() as AddressInfo;
    const client = new KpScoringClient({ baseUrl: `http://127.0.0.1:${port}`, retryDelayMs: 1 });
    const trace = { ...exampleTrace(), id: "kp:trace:lost-answer" };
    const answer = await client.score(trace);
    assert.equal(answer.trace_id, "kp:trace:lost-answer");
    assert.deepEqual(replayed, [null, "true"]); // scored once; the retry got the first answer
  } finally {
    proxy.close();
  }
});
