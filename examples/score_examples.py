"""Score each sample trace as a dry run (nothing is added to the memory) and print the result."""

import json
import os
from pathlib import Path

import httpx

URL = os.environ.get("KP_URL", "http://127.0.0.1:8000")  # the kp-scoring command's variable

for path in sorted(Path("examples").glob("*.json")):
    trace = json.loads(path.read_text())
    answer = httpx.post(f"{URL}/evaluate", params={"dry_run": "true"}, json=trace).json()
    verdict = "shared" if answer["score"] >= 0.75 else "kept back"
    print(f"{path.name:22} {answer['weights']['profile']:17} {answer['score']:.4f}  {verdict}")
