/** Against a server with KP_API_KEYS_FILE: the REST client's apiKey and the official MCP
 * client's Bearer header are what let a call through. */

import assert from "node:assert/strict";
import { test } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

import { KpScoringClient, KpScoringError, type Evaluation } from "../src/index.js";
import { SCORE_TOLERANCE, exampleTrace, required } from "./env.js";

const KEYED_URL = required("KP_KEYED_URL");
const EVALUATE_KEY = required("KP_TEST_EVALUATE_KEY");
const ADMIN_KEY = required("KP_TEST_ADMIN_KEY");

function mcpTo(key: string | undefined): StreamableHTTPClientTransport {
  const headers: Record<string, string> = key ? { authorization: `Bearer ${key}` } : {};
  return new StreamableHTTPClientTransport(new URL(`${KEYED_URL}/mcp`), { requestInit: { headers } });
}

test("REST: no key is a 401, an admin-only key a 403, the evaluate key scores", async () => {
  for (const [apiKey, status] of [
    [undefined, 401],
    [ADMIN_KEY, 403],
  ] as const) {
    const client = new KpScoringClient({ baseUrl: KEYED_URL, apiKey });
    await assert.rejects(client.score(exampleTrace(), { dryRun: true }), (error: unknown) => {
      assert.ok(error instanceof KpScoringError);
      assert.equal(error.status, status);
      assert.deepEqual(error.fields, ["header.authorization"]);
      return true;
    });
  }
  const agent = new KpScoringClient({ baseUrl: KEYED_URL, apiKey: EVALUATE_KEY });
  assert.ok(Math.abs((await agent.score(exampleTrace(), { dryRun: true })).score - 0.57625) < SCORE_TOLERANCE);
  const admin = new KpScoringClient({ baseUrl: KEYED_URL, apiKey: ADMIN_KEY });
  assert.equal((await admin.cacheStats()).size, 0);
});

test("MCP: the official client without a key is refused; with the key it lists and scores", async () => {
  const refused = new Client({ name: "kp-scoring-tests", version: "0.0.0" });
  await assert.rejects(refused.connect(mcpTo(undefined)), /401|nauthorized/);

  const mcp = new Client({ name: "kp-scoring-tests", version: "0.0.0" });
  await mcp.connect(mcpTo(EVALUATE_KEY));
  try {
    const { tools } = await mcp.listTools();
    assert.deepEqual(
      tools.map((t) => t.name),
      ["kp_score_trace", "kp_score_traces", "kp_check_contribution"],
    );
    const result = await mcp.callTool({ name: "kp_score_trace", arguments: { ...exampleTrace(), dry_run: true } });
    assert.ok(Math.abs((result.structuredContent as Evaluation).score - 0.57625) < SCORE_TOLERANCE);
  } finally {
    await mcp.close();
  }
});
