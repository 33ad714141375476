/**
 * A client for the kp-scoring service: score KnowledgePulse reasoning traces over its REST API.
 *
 * Runs on `fetch` alone (Node 20+, Deno, Bun, browsers); its types come from the service's
 * OpenAPI document (`openapi/openapi.json`, turned into `src/openapi.ts` at build).
 */

import type { components } from "./openapi.js";

type Schemas = components["schemas"];

/** A reasoning trace as an agent submits it (the SDK's `ReasoningTrace`). */
export type ReasoningTrace = Schemas["ReasoningTrace"];
/** The answer for one trace: the score in [0, 1] and its breakdown. */
export type Evaluation = Schemas["EvaluationOut"];
/** Which weight profile applied, and whether the trace's `task_domain` named one (when not,
 * the default profile applied). */
export type Profile = Schemas["ProfileOut"];
/** How `novelty.max_cosine` was found: "exact", or "index" (Redis's HNSW index of a large shared memory). */
export type SearchMethod = NonNullable<Schemas["NoveltyOut"]["search"]>;
/** POST /contribution's answer: the evaluation, and the trace as the SDK's capture would
 * contribute it (cleaned), with what was redacted, what would go uncleaned, every suspected
 * leak the SDK's patterns leave (`findings`), whether any remains (`leaks_remain`) and the
 * SDK's injection check of each text field. */
export type Contribution = Schemas["ContributionOut"];
/** A secret or identifier found: where (a JSON Pointer), its type, how many, and its
 * detector (`cleanPii` for the SDK's own patterns). */
export type Finding = Schemas["FindingOut"];
export type CacheStats = Schemas["CacheOut"];
export type Readiness = Schemas["ReadyOut"];
/** One field a 4xx names (FastAPI's shape): its path (`["body", "steps", 0, "type"]`, or
 * `["header", "authorization"]`), what is wrong, the rule's name. */
export interface FieldError {
  loc: (string | number)[];
  msg: string;
  type: string;
}

export const DEFAULT_BASE_URL = "http://127.0.0.1:8000";
/** The header that names a request's namespace (its memory). */
export const NAMESPACE_HEADER = "kp-namespace";

export interface ClientOptions {
  /** Where the service listens (default http://127.0.0.1:8000). */
  baseUrl?: string;
  /** Sent as `Authorization: Bearer <apiKey>`: an API key, or KP_ADMIN_TOKEN for cache admin. */
  apiKey?: string;
  /** The namespace (the memory) every request acts on, sent as `KP-Namespace`; default none:
   * the API key's namespace, else `default`. A call's own `namespace` overrides it. */
  namespace?: string;
  /** Further tries after an overload (503, 429) or a network error (default 2). */
  retries?: number;
  /** Longest wait before a retry when the service gives no Retry-After, in ms (default 1000). */
  retryDelayMs?: number;
  /** Per-attempt time limit in ms (default 30000). */
  timeoutMs?: number;
  /** Another fetch (a proxy's, a test's); default the global one. */
  fetch?: typeof fetch;
}

export interface NamespaceOptions {
  /** This call's namespace, instead of the client's. */
  namespace?: string;
}

export interface ScoreOptions extends NamespaceOptions {
  /** Score without adding the trace's embedding to the novelty cache. */
  dryRun?: boolean;
}

export interface ContributionOptions extends ScoreOptions {
  /** Also redact every suspected leak: the contribution then differs from the SDK's
   * (`differs_from_sdk`). Default: the service's KP_CONTRIBUTION_REDACT_SUSPECTED. */
  redactSuspected?: boolean;
  /** The injection classifier's suspiciousThreshold (the SDK's option); default the service's. */
  suspiciousThreshold?: number;
  /** The injection classifier's rejectThreshold (the SDK's option); default the service's. */
  rejectThreshold?: number;
}

/**
 * The service said no (4xx, 5xx) or could not be reached (`status` 0). `fields` lists the
 * body paths a 422 names, e.g. `steps.0.type`; `retryAfterS` comes from Retry-After.
 */
export class KpScoringError extends Error {
  override readonly name = "KpScoringError";

  constructor(
    message: string,
    readonly status: number,
    readonly detail: unknown,
    readonly fields: string[] = [],
    readonly retryAfterS: number | null = null,
  ) {
    super(message);
  }

  /** Whether trying again later may succeed (overload, network); a 4xx will not. */
  get retryable(): boolean {
    return this.status === 0 || this.status === 429 || this.status === 503;
  }
}

const RETRYABLE = new Set([429, 503]);

export class KpScoringClient {
  readonly baseUrl: string;
  private readonly apiKey: string | undefined;
  readonly namespace: string | undefined;
  private readonly retries: number;
  private readonly retryDelayMs: number;
  private readonly timeoutMs: number;
  private readonly fetchImpl: typeof fetch;

  constructor(options: ClientOptions = {}) {
    this.baseUrl = (options.baseUrl ?? DEFAULT_BASE_URL).replace(/\/+$/, "");
    this.apiKey = options.apiKey;
    this.namespace = options.namespace;
    this.retries = options.retries ?? 2;
    this.retryDelayMs = options.retryDelayMs ?? 1000;
    this.timeoutMs = options.timeoutMs ?? 30000;
    this.fetchImpl = options.fetch ?? globalThis.fetch;
  }

  /** Score one trace: the full answer (score, dimensions, weights, overrides, novelty). */
  async score(trace: ReasoningTrace, options: ScoreOptions = {}): Promise<Evaluation> {
    return this.request<Evaluation>(
      "POST",
      withDryRun("/evaluate", options),
      trace,
      options.namespace,
    );
  }

  /** Score traces in order, as one step (later traces are compared with earlier ones). */
  async scoreBatch(traces: ReasoningTrace[], options: ScoreOptions = {}): Promise<Evaluation[]> {
    const body = await this.request<Schemas["BatchOut"]>(
      "POST",
      withDryRun("/evaluate/batch", options),
      { traces },
      options.namespace,
    );
    return body.results;
  }

  /** Before contributing a trace: its evaluation (as `score`), and the trace as the SDK's
   * capture would send it, cleaned of secrets and identifiers as `cleanPii` cleans it, with
   * what it leaves uncleaned, what is still suspected (`findings`, `leaks_remain`) and the
   * injection check (POST /contribution). */
  async contribution(
    trace: ReasoningTrace,
    options: ContributionOptions = {},
  ): Promise<Contribution> {
    const query = new URLSearchParams();
    if (options.dryRun) query.set("dry_run", "true");
    if (options.redactSuspected !== undefined) {
      query.set("redact_suspected", String(options.redactSuspected));
    }
    if (options.suspiciousThreshold !== undefined) {
      query.set("suspicious_threshold", String(options.suspiciousThreshold));
    }
    if (options.rejectThreshold !== undefined) {
      query.set("reject_threshold", String(options.rejectThreshold));
    }
    const search = query.toString();
    return this.request<Contribution>(
      "POST",
      search ? `/contribution?${search}` : "/contribution",
      trace,
      options.namespace,
    );
  }

  /** The score alone, as the SDK's `evaluateValue(trace)` returns it. */
  async evaluateValue(trace: ReasoningTrace): Promise<number> {
    return (await this.score(trace)).score;
  }

  /** A namespace's novelty cache: size, limits, counters and backend (admin). */
  async cacheStats(options: NamespaceOptions = {}): Promise<CacheStats> {
    return this.request<CacheStats>("GET", "/cache", undefined, options.namespace);
  }

  /** Empty a namespace's novelty cache (for every replica when shared); how many vectors were
   * dropped (admin). */
  async clearCache(options: NamespaceOptions = {}): Promise<number> {
    const body = await this.request<Schemas["ClearedOut"]>(
      "DELETE",
      "/cache",
      undefined,
      options.namespace,
    );
    return body.cleared;
  }

  /** The namespaces that hold entries, sorted (admin, with a key bound to no namespace). */
  async namespaces(): Promise<string[]> {
    return (await this.request<Schemas["NamespacesOut"]>("GET", "/cache/namespaces")).namespaces;
  }

  /** /readyz: the embedder's and the cache's state (answered with 200 even when degraded). */
  async readiness(): Promise<Readiness> {
    return this.request<Readiness>("GET", "/readyz");
  }

  private async request<T>(
    method: string,
    path: string,
    body?: unknown,
    namespace?: string,
  ): Promise<T> {
    const headers: Record<string, string> = { accept: "application/json" };
    if (body !== undefined) headers["content-type"] = "application/json";
    if (this.apiKey !== undefined) headers.authorization = `Bearer ${this.apiKey}`;
    const chosen = namespace ?? this.namespace;
    if (chosen !== undefined) headers[NAMESPACE_HEADER] = chosen;
    // One key for every try of this call: a service that knows the key answers a retry with
    // the first try's result instead of scoring (and caching) the trace twice.
    if (method === "POST") headers["idempotency-key"] = crypto.randomUUID();
    const init = { method, headers, body: body === undefined ? undefined : JSON.stringify(body) };
    for (let attempt = 0; ; attempt++) {
      let error: KpScoringError;
      try {
        const response = await this.fetchImpl(`${this.baseUrl}${path}`, {
          ...init,
          signal: AbortSignal.timeout(this.timeoutMs),
        });
        if (response.ok) return (await response.json()) as T;
        error = await errorOf(method, path, response);
      } catch (cause) {
        error = new KpScoringError(
          `${method} ${path}: no answer from ${this.baseUrl}: ${String(cause)}`,
          0,
          null,
        );
      }
      if (!error.retryable || attempt >= this.retries) throw error;
      const waitMs = error.retryAfterS !== null ? error.retryAfterS * 1000 : this.retryDelayMs;
      await new Promise((resolve) => setTimeout(resolve, Math.min(waitMs, 30000)));
    }
  }
}

/** `evaluateValue(trace)` of the SDK, answered by the service: a drop-in for SDK users. */
export async function evaluateValue(
  trace: ReasoningTrace,
  options: ClientOptions = {},
): Promise<number> {
  return new KpScoringClient(options).evaluateValue(trace);
}

function withDryRun(path: string, options: ScoreOptions): string {
  return options.dryRun ? `${path}?dry_run=true` : path;
}

async function errorOf(method: string, path: string, response: Response): Promise<KpScoringError> {
  const text = await response.text();
  let detail: unknown = text;
  try {
    detail = (JSON.parse(text) as { detail?: unknown }).detail ?? text;
  } catch {
    // not JSON (a proxy's page): the text is the detail
  }
  const fields: string[] = [];
  let what: string;
  if (Array.isArray(detail)) {
    const errors = detail as FieldError[];
    for (const e of errors) fields.push(e.loc.filter((part) => part !== "body").join("."));
    what = errors.map((e, i) => `${fields[i] || "(body)"}: ${e.msg}`).join("; ");
  } else {
    what = typeof detail === "string" ? detail : JSON.stringify(detail);
  }
  const retryAfter = Number.parseFloat(response.headers.get("retry-after") ?? "");
  return new KpScoringError(
    `${method} ${path}: ${response.status} ${what}`,
    response.status,
    detail,
    fields,
    Number.isFinite(retryAfter) ? retryAfter : null,
  );
}
