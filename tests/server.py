"""A real kp-scoring server in a subprocess on a free loopback port (client, CLI, restart,
crash and schemathesis tests), and a real redis-server for the shared-cache tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-admin-token"
#: How every server starts (app/serve.py), run by this interpreter.
SERVE = (sys.executable, "-m", "app.serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def entry_point() -> str:
    """The installed `kp-scoring` script of this interpreter's environment."""
    script = Path(sys.executable).parent / "kp-scoring"
    found = str(script) if script.is_file() else shutil.which("kp-scoring")
    if found is None:
        raise RuntimeError(
            "the kp-scoring script is not installed: pip install -e ./clients/python"
        )
    return found


class LiveServer:
    """`command --host 127.0.0.1 --port <free>` with exactly the given KP_* settings."""

    def __init__(self, env: dict[str, str], log_path: Path, command: Sequence[str] = SERVE) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=ROOT,
            env={**clean, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, timeout=30)
        self._wait_healthy()

    def _wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}: {self.log()}")
            try:
                if self.client.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop(signal.SIGKILL)
        raise TimeoutError(f"server did not start: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def post(self, path: str, json: Any) -> httpx.Response:
        return self.client.post(path, json=json)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> int:
        self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.client.close()
        self._log.close()
        return code


@dataclass(frozen=True)
class Server:
    url: str
    token: str | None


@contextmanager
def running_server(
    *,
    embedder: str = "none",
    token: str | None = TOKEN,
    command: Sequence[str] = SERVE,
    **settings: str,
) -> Iterator[Server]:
    """A LiveServer with the embedder off by default, quiet logs and an admin token."""
    env = {"KP_EMBEDDER": embedder, "KP_LOG_LEVEL": "warning"}
    env |= {f"KP_{k.upper()}": v for k, v in settings.items()}
    if token is not None:
        env["KP_ADMIN_TOKEN"] = token
    with tempfile.TemporaryDirectory() as tmp:
        live = LiveServer(env, Path(tmp) / "server.log", command)
        try:
            yield Server(live.url, token)
        finally:
            live.stop()


class RedisServer:
    """Debian's redis-server on a free loopback port, in its own directory, persisting as
    docker-compose.scale.yml configures it: AOF, fsync before each reply (`appendfsync`)."""

    def __init__(
        self, directory: Path, password: str | None = None, appendfsync: str = "always"
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: make test installs it (apt-get)")
        self.binary = binary
        self.directory = directory
        self.password = password
        self.appendfsync = appendfsync
        self.port = free_port()
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        log = (self.directory / "redis.log").open("ab")
        options = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.directory),
            "appendonly": "yes",
            "appendfsync": self.appendfsync,
            "save": "",
        }
        if self.password:
            options["requirepass"] = self.password
        self.process = subprocess.Popen(
            [self.binary, *(part for k, v in options.items() for part in (f"--{k}", v))],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log()}")
            if self.ping():
                return
            time.sleep(0.02)
        raise TimeoutError(f"redis-server did not answer: {self.log()}")

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10)

    def ping(self) -> bool:
        """True once it answers PING (not while it loads its AOF)."""
        try:
            with self.client() as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def log(self) -> str:
        return (self.directory / "redis.log").read_text(errors="replace")[-2000:]

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)
        self.process = None
