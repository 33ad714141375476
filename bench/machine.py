"""What every result file records: the machine and library versions, and the --env pairs."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from app.embedding.int8_support import RELEVANT_FLAGS, CpuFeatures


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")),
        platform.processor(),
    )
    return {
        "cpu": model,
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_flags": sorted(CpuFeatures.of_this_machine().flags & RELEVANT_FLAGS),
        "python": platform.python_version(),
        "onnxruntime": _version("onnxruntime"),
        "numpy": _version("numpy"),
        "tokenizers": _version("tokenizers"),
        "uvicorn": _version("uvicorn"),
        "fastapi": _version("fastapi"),
        "kernel": platform.release(),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "loadavg_start": loadavg(),
    }


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith("KP_"):
            raise SystemExit(f"--env takes KP_NAME=value, got {pair!r}")
        env[key] = value
    return env
