"""API keys (KP_API_KEYS_FILE): who may score and who may manage the cache.

The file holds each key's SHA-256, never the key: a leaked file grants nothing. A presented key
is hashed and compared with every entry in constant time (hmac.compare_digest), so neither the
answer's timing nor its content tells how close a guess came.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from app.core import namespaces
from app.core.errors import PartError

Scope = Literal["evaluate", "admin"]
#: Name of the principal KP_ADMIN_TOKEN stands for (in logs and metrics).
ADMIN_TOKEN_NAME = "admin-token"


class ApiKey(BaseModel):
    """Who sent a request: a key of the file, or the admin token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: What logs and metrics show (a label value: short, plain).
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$", to_lower=True)]
    scopes: Annotated[list[Scope], Field(min_length=1)]
    #: Token bucket: this many requests at once, refilled at this rate; unset: no limit.
    rate_per_minute: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    #: The one namespace the key may use (docs/api.md, namespaces); unset: any namespace.
    namespace: Annotated[str, Field(pattern=namespaces.PATTERN)] | None = None


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[ApiKey]


class KeyFileError(PartError):
    """The keys file cannot be used; the message names the entry and the rule."""


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyRing:
    def __init__(self, keys: list[ApiKey], admin_token: str | None = None) -> None:
        if admin_token is not None:
            digest = key_digest(admin_token).hex()
            keys = [*keys, ApiKey(name=ADMIN_TOKEN_NAME, sha256=digest, scopes=["admin"])]
        self._entries = [(bytes.fromhex(key.sha256), key) for key in keys]

    def identify(self, presented: str) -> ApiKey | None:
        """The key `presented` is, or None; every entry is compared, each in constant time."""
        digest = key_digest(presented)
        found = [key for stored, key in self._entries if hmac.compare_digest(digest, stored)]
        return found[0] if found else None


def load_key_file(path: Path) -> list[ApiKey]:
    """The entries of a keys file, or KeyFileError naming the entry at fault."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KeyFileError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path} is not JSON: {exc}") from None
    try:
        parsed = KeysFile.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(_where(raw, err["loc"]) + f": {err['msg']}" for err in exc.errors())
        raise KeyFileError(problems) from None
    names: set[str] = set()
    hashes: set[str] = set()
    for i, entry in enumerate(parsed.keys):
        where = f"keys[{i}] ({entry.name!r})"
        if entry.name in names:
            raise KeyFileError(f"{where}.name: another entry has this name")
        if entry.sha256 in hashes:
            raise KeyFileError(f"{where}.sha256: another entry has this hash")
        names.add(entry.name)
        hashes.add(entry.sha256)
    return parsed.keys


def _where(raw: Any, loc: tuple[int | str, ...]) -> str:
    """`keys[1] ('agent-b').scopes[0]`: the entry by index and, when it has one, its name."""
    text = ""
    node = raw
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
        try:
            node = node[part]
        except (LookupError, TypeError):
            node = None
        if isinstance(part, int) and isinstance(node, dict) and isinstance(node.get("name"), str):
            text += f" ({node['name']!r})"
    return text or "the file"
