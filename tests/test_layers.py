"""The layers point one way, the client (clients/python) and the service import nothing of each
other, and the client stays light: read from the source with `ast`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app"
CLIENT = APP.parent / "clients" / "python" / "src" / "kp_scoring"

#: What each part of app/ may import from app/ (besides itself). Lower layers first:
#: core (a leaf) <- domain, contribution, embedding, memory, guards <- schemas <- service <- api
#: (the transports) <- entry points.
ALLOWED: dict[str, frozenset[str]] = {
    "app": frozenset(),
    "core": frozenset(),
    "domain": frozenset({"core"}),
    "contribution": frozenset({"core"}),
    "embedding": frozenset({"core"}),
    "memory": frozenset({"core"}),
    "guards": frozenset({"core"}),
    "schemas": frozenset({"core", "domain"}),
    "service": frozenset(
        {"core", "domain", "contribution", "embedding", "memory", "guards", "schemas"}
    ),
    # The transports: adapters of the service; of the guards only what the OpenAPI document
    # and the key check's type need.
    "api": frozenset({"app", "core", "schemas", "service", "guards"}),
    # The HTTP protocol and the descriptor watch, under the app: settings, metrics, errors.
    "server": frozenset({"core"}),
}
#: Entry points: they put the layers together, so they may import any of them.
ENTRY_POINTS = frozenset({"app.main", "app.serve", "app.openapi_export"})
#: What a process that only calls the service must not load.
HEAVY = ("onnxruntime", "numpy", "tokenizers", "redis", "onnx")


def _modules() -> dict[str, Path]:
    found = {}
    for path in APP.rglob("*.py"):
        parts = path.relative_to(APP.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imported_names(path: Path) -> set[str]:
    """The modules (and `module.name`s) a file imports, at any depth of its code (lazy imports
    count)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _imports(path: Path) -> set[str]:
    """The app modules a file imports."""
    return {name for name in _imported_names(path) if name in MODULES}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "app"


def test_the_graph_is_read() -> None:
    assert "app.service.scoring_service" in GRAPH["app.api.deps"]
    assert "app.core.states" in GRAPH["app.schemas.responses"]


def test_no_module_imports_a_layer_above_it() -> None:
    wrong = []
    for module, imported in GRAPH.items():
        if module in ENTRY_POINTS:
            continue
        layer = _layer(module)
        for target in imported:
            if _layer(target) != layer and _layer(target) not in ALLOWED[layer]:
                wrong.append(f"{module} -> {target}")
    assert not wrong


def test_the_state_names_module_is_a_leaf() -> None:
    assert GRAPH["app.core.states"] == set()


def test_no_import_cycles_in_app() -> None:
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append([*path[path.index(module) :], module])
            return
        if module in done:
            return
        for target in sorted(GRAPH[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(GRAPH):
        visit(module, [])
    assert not cycles


def _printed_by(code: str, env: dict[str, str] | None = None) -> list[str]:
    """The lines `code` prints, run in a fresh interpreter from the repository's root."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=APP.parent,
        env=env,
    )
    return done.stdout.splitlines()


def _loaded_by(statement: str) -> set[str]:
    printed = _printed_by(f"import sys; {statement}; print('\\n'.join(sys.modules))")
    return {line.split(".")[0] for line in printed}


def _top_level_imports(root: Path) -> dict[str, set[str]]:
    return {
        str(path.relative_to(root.parent)): {name.split(".")[0] for name in _imported_names(path)}
        for path in root.rglob("*.py")
    }


def test_the_client_and_the_service_import_nothing_of_each_other() -> None:
    """The client is its own distribution (clients/python), installed without the service;
    the service runs without the client."""
    client = _top_level_imports(CLIENT)
    assert "kp_scoring/cli.py" in client  # the check reads the client's files
    assert {f: names & {"app"} for f, names in client.items() if "app" in names} == {}
    service = _top_level_imports(APP)
    assert {
        f: names & {"kp_scoring"} for f, names in service.items() if "kp_scoring" in names
    } == {}


def test_the_client_loads_none_of_the_servers_libraries() -> None:
    loaded = _loaded_by("import kp_scoring")
    assert "httpx" in loaded  # the check sees what the client does load
    assert not loaded & {*HEAVY, "app"}


def test_the_cli_loads_none_of_the_servers_libraries() -> None:
    loaded = _loaded_by("import kp_scoring.cli")
    assert "typer" in loaded
    assert not loaded & {*HEAVY, "app", "fastapi", "uvicorn"}


def test_the_app_loads_no_library_its_default_start_does_not_use() -> None:
    """What a start imports, its first answer waits for (the cold start): the MCP SDK loads
    on the first /mcp request, joserfc and cryptography when something is signed or checked,
    redis with KP_REDIS_URL."""
    loaded = _loaded_by(
        "import app.serve, app.main; from app.core.config import Settings; "
        "app.main.create_app(Settings())"
    )
    assert {"fastapi", "onnxruntime", "numpy"} <= loaded  # the check sees what it does load
    assert not loaded & {"mcp", "redis", "joserfc", "cryptography"}


def test_the_server_loads_no_websocket_library_and_no_uvicorn() -> None:
    """The service has no WebSocket endpoint and granian serves it (app/serve.py): a start
    loads no WebSocket library, and nothing of uvicorn (imports a cold start would pay)."""
    loaded = _loaded_by(
        "import app.serve, app.main; from app.core.config import Settings; "
        "from granian.server.embed import Server; "
        "Server(app.main.create_app(Settings()), websockets=False)"
    )
    assert {"granian", "fastapi"} <= loaded  # the check sees what it does load
    assert not loaded & {"websockets", "wsproto", "uvicorn", "httptools"}


#: Who may read the process environment: the settings module, called once where the app is
#: wired (app.main, whose `app` ASGI servers serve).
ENV_READERS = frozenset({"app.core.config", "app.main"})


def _reads_environment(path: Path) -> list[str]:
    """Where a file reads the environment: os.environ, os.getenv, Settings.from_env() or a
    Settings() built from the environment (no arguments)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "from_env"):
            found.append(f"{path.name}:{node.lineno} {node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("Settings", "cls", "getenv")
            and not node.args
            and not node.keywords
        ):
            found.append(f"{path.name}:{node.lineno} {node.func.id}()")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            names = {alias.name for alias in node.names}
            if names & {"environ", "getenv"}:
                found.append(f"{path.name}:{node.lineno} from os import")
    return found


def test_the_environment_is_read_by_the_settings_and_the_launcher_only() -> None:
    readers = {name for name, path in MODULES.items() if _reads_environment(path)}
    assert {"app.core.config", "app.main"} <= readers  # the check sees the reads there are
    assert readers <= ENV_READERS, sorted(readers - ENV_READERS)


def _calls(path: Path) -> set[str]:
    """The names a file calls (`Name(...)`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


def test_the_app_is_wired_in_one_place() -> None:
    """The app is put together by app.main alone: it builds the running parts (Runtime) and
    the one service over them, and its middleware is one list of Starlette's there."""
    builders = [
        name for name, path in MODULES.items() if _calls(path) & {"Runtime", "ScoringService"}
    ]
    assert builders == ["app.main"]
    middleware = [
        name
        for name, path in MODULES.items()
        if "starlette.middleware" in path.read_text(encoding="utf-8")
    ]
    assert middleware == ["app.main"]


#: What the pure rooms (the scoring formulas, the contribution gate) must not use: no threads,
#: no processes, no files, no sockets; the machinery that needs them lives with the memory.
_NOT_IN_THE_DOMAIN = frozenset(
    {
        "threading",
        "_thread",
        "atexit",
        "concurrent",
        "multiprocessing",
        "asyncio",
        "os",
        "pathlib",
        "io",
        "shutil",
        "socket",
        "subprocess",
    }
)


def test_the_domain_is_pure() -> None:
    used = []
    for module, path in MODULES.items():
        if _layer(module) not in ("domain", "contribution"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "open"
            ):
                names = ["open()"]
            else:
                continue
            used += [
                f"{module}: {name}"
                for name in names
                if name.split(".")[0] in _NOT_IN_THE_DOMAIN or name == "open()"
            ]
    assert {"app.domain.scoring", "app.contribution.pii"} <= MODULES.keys()  # it sees them
    assert not used
