// Score a trace with the TypeScript client (its package file, made by npm pack after its build).
import { readFile } from "node:fs/promises";
import { KpScoringClient, KpScoringError } from "@kp-scoring/client";

const trace = JSON.parse(await readFile("examples/trace.json", "utf8"));
const kp = new KpScoringClient({ baseUrl: process.env.KP_URL ?? "http://127.0.0.1:8000" });
const answer = await kp.score(trace, { dryRun: true });
console.log(answer.score, answer.weights.profile, answer.profile.domain_recognised);
try {
  await kp.score({ ...trace, id: "not-a-kp-id" });
} catch (error) {
  if (error instanceof KpScoringError) console.log(error.status, error.fields);
}
// 0.57625 default false
// 422 [ 'id' ]
