"""Writes the OpenAPI document and the ReasoningTrace JSON Schema into openapi/.

Run `python -m app.openapi_export` after changing the API; tests/test_openapi.py fails
while the files in openapi/ differ from what the code generates.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from app.core.config import Settings
from app.schemas.trace import ReasoningTrace

OPENAPI_DIR = Path(__file__).resolve().parents[1] / "openapi"


def documents() -> dict[str, dict[str, Any]]:
    from app.main import create_app

    schema = ReasoningTrace.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://openknowledgepulse.org/schema/v1/ReasoningTrace"
    return {
        "openapi.json": create_app(Settings(embedder="none")).openapi(),
        "reasoning-trace.schema.json": schema,
    }


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False, sort_keys=False) + "\n"


def main() -> int:
    OPENAPI_DIR.mkdir(exist_ok=True)
    for name, document in documents().items():
        (OPENAPI_DIR / name).write_text(render(document), encoding="utf-8")
        print(f"wrote openapi/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
