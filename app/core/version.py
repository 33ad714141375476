"""The service's version: the installed kp-scoring distribution's, whose pyproject reads the
project's one VERSION file (clients/python/VERSION, which the client's pyproject reads too).

Read once, where the app is built (about 2 ms: importlib.metadata looks through sys.path);
importlib.metadata itself is already loaded by the web stack by then.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("kp-scoring")
except PackageNotFoundError:  # a source tree that was never installed
    VERSION = "0+unknown"
