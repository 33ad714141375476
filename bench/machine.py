"""What every result file records: where it comes from (`run`: commit, command, date, CPU),
the machine and library versions, and the --env pairs."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import tempfile
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


ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    return next(
        (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")),
        platform.processor(),
    )


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_flags": sorted(CpuFeatures.of_this_machine().flags & RELEVANT_FLAGS),
        "python": platform.python_version(),
        "onnxruntime": _version("onnxruntime"),
        "numpy": _version("numpy"),
        "tokenizers": _version("tokenizers"),
        "granian": _version("granian"),
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


def _git(*args: str, env: dict[str, str] | None = None) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )
    except OSError:  # no git
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def app_tree(root: Path = ROOT) -> str | None:
    """The git tree id of app/ as it is on disk, committed or not (untracked files in, ignored
    ones out): what a run measured. The performance page compares it with app/ as it is when
    the site is built (docs/hooks/performance.py computes it the same way)."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        if _git("-C", str(root), "add", "--all", "--", "app", env=env) is None:
            return None
        return _git("-C", str(root), "write-tree", "--prefix=app/", env=env)


def provenance() -> dict[str, Any]:
    """Where a result file comes from, for the performance page (which prints it, and marks the
    file stale once app/ is no longer what was measured): the commit checked out and whether
    app/ or bench/ differed from it, app/'s tree as measured, the command as typed, when, and
    on which CPU."""
    # The results a run writes are not the code it measured.
    changed = _git("status", "--porcelain", "--", "app", "bench", ":!bench/results")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(changed),
        "app_tree": app_tree(),
        "command": shlex.join(["python", *sys.orig_argv[1:]]),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores",
    }
