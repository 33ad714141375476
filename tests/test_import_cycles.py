"""No import circle anywhere in the repository's Python (the service, the bench, the clients):
read from the source with `ast`, lazy imports inside functions included. (The domain's purity
is tests/test_layers.py's.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The folders whose packages import each other; a client distribution's sources sit under
#: clients/<language>/ (its package is the folder holding __init__.py).
PACKAGES = ("app", "bench")


def _package_roots() -> list[Path]:
    """Folders that sys.path would hold for each package: the repository for app/ and
    bench/, and the source folder of each Python client under clients/."""
    roots = [ROOT]
    for init in sorted((ROOT / "clients").glob("*/**/__init__.py")):
        if "node_modules" in init.parts:
            continue
        package = init.parent
        while (package.parent / "__init__.py").exists():
            package = package.parent
        if package.parent not in roots:
            roots.append(package.parent)
    return roots


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in _package_roots():
        tops = PACKAGES if root == ROOT else [p.name for p in root.iterdir() if p.is_dir()]
        for top in tops:
            if not (root / top / "__init__.py").exists():
                continue
            for path in (root / top).rglob("*.py"):
                if "node_modules" in path.parts:
                    continue
                parts = path.relative_to(root).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[name] = path
    return found


MODULES = _modules()


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The absolute name a `from` import refers to (relative ones resolved against `module`)."""
    if node.level == 0:
        return node.module
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if node.level > 1:
        package = package[: -(node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def _imports(module: str, path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path, node)
            if base:
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in names if name in MODULES} - {module}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_graph_is_read() -> None:
    assert "bench.corpus" in GRAPH["bench.__main__"]
    assert "app.service.scoring_service" in GRAPH["app.api.deps"]
    assert any(name.startswith("bench.") for name in MODULES)


def test_a_circle_is_found() -> None:
    """The check can fail: a circle of three, through a lazy import, is reported."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_circle_in_the_repository() -> None:
    assert _cycles(GRAPH) == []
