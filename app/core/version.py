"""The service's version: the installed kp-scoring distribution's, whose pyproject reads the
project's one VERSION file (clients/python/VERSION, as the client's does). Read once, where the
app is built: importlib.metadata looks through sys.path (about 2 ms)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("kp-scoring")
except PackageNotFoundError:  # a source tree that was never installed
    VERSION = "0+unknown"
