/** What the tests are run against: tests/test_typescript_client.py starts a live server. */

import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";

import type { ReasoningTrace } from "../src/index.js";

export function required(name: string): string {
  const value = process.env[name];
  if (!value) {
    throw new Error(`${name} is not set: run these tests through tests/test_typescript_client.py`);
  }
  return value;
}

export const BASE_URL = required("KP_URL");
export const ADMIN_TOKEN = required("KP_TEST_ADMIN_TOKEN");

const ROOT = fileURLToPath(new URL("../../../../", import.meta.url));

export interface ReferenceCase {
  name: string;
  trace: ReasoningTrace;
  expected_score: number | null;
}

/** The reference SDK's own scores with no embedder (the server runs with KP_EMBEDDER=none). */
export function noEmbedderCases(): ReferenceCase[] {
  const path = `${ROOT}tests/fixtures/reference/no_embedder.json`;
  const cases = (JSON.parse(readFileSync(path, "utf8")) as { cases: ReferenceCase[] }).cases;
  return cases.filter((c) => c.expected_score !== null);
}

export function exampleTrace(): ReasoningTrace {
  return JSON.parse(readFileSync(`${ROOT}examples/trace.json`, "utf8")) as ReasoningTrace;
}

export const SCORE_TOLERANCE = 1e-6;
