"""What the MCP endpoint costs over the REST API: `python -m bench.mcp [--n N]`.

One client, one keep-alive connection, the same typical traces sent as POST /evaluate and as an
MCP tools/call of kp_score_trace on POST /mcp, interleaved request by request (so both see the
same machine load), with dry_run (the cache stays as it was) and the memo of recent vectors
off (each request runs the model). Twice: with the embedder off
(the transport's cost alone) and with the real model (what an agent sees). Prints p50/p90 of
each and the ratios MCP / REST; compare ratios, not absolute times, on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import corpus
from bench.server import HOST, Server
from bench.stats import latency_summary

_MCP_HEADERS = {
    "accept": "application/json, text/event-stream",
    "mcp-protocol-version": "2025-11-25",
}


def _tool_call(trace: dict[str, Any], request_id: int) -> dict[str, Any]:
    arguments = {**trace, "dry_run": True}
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": "kp_score_trace", "arguments": arguments},
    }


def measure(env: dict[str, str], n: int, log: Path) -> dict[str, dict[str, float]]:
    traces = [item.trace for item in corpus.build("typical", n, seed=22)]
    rest_ms: list[float] = []
    mcp_ms: list[float] = []
    with Server(env, log) as server, httpx.Client(base_url=f"http://{HOST}:{server.port}") as http:
        # Warm-up: the model's load and the first answers are not what is compared.
        for trace in traces[:3]:
            http.post("/evaluate?dry_run=true", json=trace).raise_for_status()
            http.post("/mcp", json=_tool_call(trace, 0), headers=_MCP_HEADERS).raise_for_status()
        for i, trace in enumerate(traces):
            started = time.perf_counter()
            rest = http.post("/evaluate?dry_run=true", json=trace)
            rest_ms.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            mcp = http.post("/mcp", json=_tool_call(trace, i + 1), headers=_MCP_HEADERS)
            mcp_ms.append((time.perf_counter() - started) * 1000)
            answer = mcp.json()["result"]["structuredContent"]
            if answer["score"] != rest.json()["score"]:
                raise AssertionError(f"MCP and REST disagree on {trace['id']}")
    return {"rest": latency_summary(rest_ms), "mcp": latency_summary(mcp_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="traces per configuration")
    args = parser.parse_args()
    print(f"cpus: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}, n={args.n} each")
    print(
        "| embedder | REST p50 ms | MCP p50 ms | p50 ratio | REST p90 ms | MCP p90 ms | p90 ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for embedder in ("none", "onnx"):
            # No memo of recent vectors: the second of the pair would find the first's vector.
            env = {
                "KP_EMBEDDER": embedder,
                "KP_LOG_LEVEL": "warning",
                "KP_EMBED_MEMO_CAPACITY": "0",
            }
            r = measure(env, args.n, Path(tmp) / f"{embedder}.log")
            rest, mcp = r["rest"], r["mcp"]
            print(
                f"| {embedder} | {rest['p50_ms']:.2f} | {mcp['p50_ms']:.2f} | "
                f"{mcp['p50_ms'] / rest['p50_ms']:.2f} | {rest['p90_ms']:.2f} | "
                f"{mcp['p90_ms']:.2f} | {mcp['p90_ms'] / rest['p90_ms']:.2f} |"
            )


if __name__ == "__main__":
    main()
