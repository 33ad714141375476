"""Which files and functions of app/ one warm POST /evaluate runs, in process.

    python scripts/request_path.py            # the default memory: a SQLite file (a temporary one)
    python scripts/request_path.py --memory   # KP_CACHE_DB_PATH=:memory:

Builds `app.main:app` from the environment, sends five traces through the ASGI app to warm
the model and the memory, waits for the model's full load, then records with
`sys.setprofile` and `threading.setprofile` (the model's worker threads included) every
function of app/ entered from the moment one more new trace is posted until its answer is
back. Background timers (the descriptor watch, the namespace sweep) run only when their tick
falls inside that window. docs/contributing.md's "One door" says why the list matters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory", action="store_true", help="KP_CACHE_DB_PATH=:memory:")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        db = ":memory:" if args.memory else str(Path(scratch) / "memory.db")
        os.environ["KP_CACHE_DB_PATH"] = db
        seen = asyncio.run(_record())
    files = sorted({file for file, _ in seen})
    print(f"files {len(files)} functions {len(seen)}")
    for file in files:
        names = sorted(name for f, name in seen if f == file)
        print(f"  {os.path.relpath(file, ROOT)}: {', '.join(names)}")
    return 0


async def _record() -> set[tuple[str, str]]:
    import httpx

    sys.path.insert(0, str(ROOT))
    from app.main import app

    seen: set[tuple[str, str]] = set()
    recording = False

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if recording and event == "call" and frame.f_code.co_filename.startswith(APP):
            seen.add((frame.f_code.co_filename, frame.f_code.co_qualname))

    trace = json.loads((ROOT / "examples" / "trace.json").read_text())
    threading.setprofile(profile)  # before the lifespan starts the model's threads
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://local") as client,
    ):
        for i in range(5):
            warm = dict(trace, id=f"kp:trace:warm-{i}", task={"objective": f"warm {i}"})
            assert (await client.post("/evaluate", json=warm)).status_code == 200
        for _ in range(600):
            if app.state.service.runtime.embeddings.loaded_fully:
                break
            await asyncio.sleep(0.1)
        measured = dict(trace, id="kp:trace:measured", task={"objective": "never seen"})
        recording = True
        sys.setprofile(profile)
        answer = await client.post("/evaluate", json=measured)
        recording = False
        sys.setprofile(None)
        assert answer.status_code == 200, answer.text
    threading.setprofile(None)
    return seen


if __name__ == "__main__":
    sys.exit(main())
