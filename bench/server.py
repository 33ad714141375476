"""The service as a user starts it: `python -m app.serve` on a free loopback port."""

from __future__ import annotations

import compileall
import http.client
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
#: The admin token the bench's servers run with (DELETE /cache between phases).
ADMIN_TOKEN = "bench-" + secrets.token_hex(16)
_TICKS = os.sysconf("SC_CLK_TCK")
#: How every server starts (app/serve.py), run by this interpreter.
SERVE = (sys.executable, "-m", "app.serve")


def compile_app(root: Path = ROOT) -> None:
    """The app's bytecode, as an installed service has it (pip compiles at install): where
    PYTHONDONTWRITEBYTECODE is set, an editable checkout would otherwise compile every module
    at every start (about 0.25 s of a cold start here). Only changed files are compiled."""
    compileall.compile_dir(root / "app", quiet=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A /proc/PID/status memory figure (VmRSS: resident now; VmHWM: the peak) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int, *, main_thread_only: bool = False) -> float:
    """User + system CPU time of a process, all its threads, from /proc/PID/stat; with
    `main_thread_only`, of its main thread alone (the event loop: HTTP, validation,
    scoring; the model runs on other threads)."""
    path = f"/proc/{pid}/task/{pid}/stat" if main_thread_only else f"/proc/{pid}/stat"
    stat = Path(path).read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def fresh_data_home() -> str:
    """A new, empty user data directory (XDG_DATA_HOME) for one service process: with no
    KP_CACHE_DB_PATH the service keeps its memory there, as a user's first start does, and no
    two processes (nor the user's own service) share a database."""
    return tempfile.mkdtemp(prefix="kp-bench-data-")


class Server:
    """A service process with exactly the given KP_* settings (others from the environment
    are dropped; the memory's default file in a fresh data directory), logging to `log_path`.
    `started_s` is the time until /healthz answered."""

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        timeout_s: float = 60,
        command: Sequence[str] = SERVE,
        root: Path = ROOT,
    ) -> None:
        """`root`: the checkout whose app runs (another commit's, to compare with this one)."""
        compile_app(root)
        self.port = free_port()
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
        self._data_home = fresh_data_home()
        clean["XDG_DATA_HOME"] = self._data_home
        self.log_path = log_path
        self._log = log_path.open("ab")
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [*command, "--host", HOST, "--port", str(self.port)],
            cwd=root,
            env={**clean, "KP_ADMIN_TOKEN": ADMIN_TOKEN, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise
        self.started_s = time.perf_counter() - started

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}: {self.log()}")
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
                conn.close()
            except OSError:
                pass
            time.sleep(0.01)
        raise TimeoutError(f"server did not answer /healthz in {timeout_s} s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        shutil.rmtree(self._data_home, ignore_errors=True)

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
