"""A model file's bytes for hashing and checksums, mapped rather than read a chunk at a time:
hashlib and zlib then leave the GIL for the whole call. Read a chunk at a time, every retake of
the GIL waited for the loading thread, and the checks that run beside the session's load took
several times their CPU in wall clock.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap | bytes]:
    """The file's bytes, mapped read-only (an empty file, which cannot be mapped: b"").
    OSError as `open` raises it."""
    with path.open("rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            yield view
