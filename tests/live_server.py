"""A real `uvicorn app.main:app` process on a free loopback port, for restart and crash tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LiveServer:
    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "app.main:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
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
        raise TimeoutError(f"server did not start: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, json: Any) -> httpx.Response:
        return self.client.post(path, json=json)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> int:
        self.process.send_signal(sig)
        code = self.process.wait(timeout=timeout)
        self.client.close()
        self._log.close()
        return code
