"""The package's layers, checked from the source: the core does no I/O, and no module imports in a circle."""

from __future__ import annotations

import ast
import importlib
import pathlib

import ringcomm

PKG = pathlib.Path(ringcomm.__file__).parent
#: What the core may not import: sockets, polling, threads, the clock, the process, torch.
FORBIDDEN = {"zmq", "socket", "select", "selectors", "threading", "_thread", "time", "os", "torch", "subprocess",
             "multiprocessing", "asyncio"}


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``path``, relative ones resolved."""
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import a, b: each name is a module
                    out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
                    continue
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
    return out


def test_the_core_imports_no_io_threads_clock_or_torch() -> None:
    files = sorted((PKG / "core").glob("*.py"))
    assert {f.stem for f in files} >= {"ring", "fusion", "wire", "coordinator", "controller", "cache", "ops",
                                       "session", "service"}
    for f in files:
        importlib.import_module(f"ringcomm.core.{f.stem}" if f.stem != "__init__" else "ringcomm.core")
        bad = [(m, line) for m, line in _imports(f) if m.split(".")[0] in FORBIDDEN]
        assert not bad, f"{f.relative_to(PKG.parent)} imports {bad}: the core does no I/O"


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports at load time (imports under TYPE_CHECKING excluded)."""
    names = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
             for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(p.read_text())
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for mod, _ in _imports_of(node, name, p.name == "__init__.py"):
                while mod and mod not in names:
                    mod = mod.rpartition(".")[0]
                if mod and mod != name and mod.startswith("ringcomm"):
                    deps.add(mod)
        graph[name] = deps
    return graph


def _imports_of(node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool) -> list[tuple[str, int]]:
    if isinstance(node, ast.Import):
        return [(a.name, node.lineno) for a in node.names]
    if not node.level:
        return [(node.module or "", node.lineno)] + [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    base = ".".join(package[:len(package) - node.level + 1])
    mod = f"{base}.{node.module}" if node.module else base
    return [(mod, node.lineno)] + [(f"{mod}.{a.name}", node.lineno) for a in node.names]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among modules (package __init__s excluded: importing a submodule runs its
    package first, which is not a circle of the code)."""
    found, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if d in graph and d != "ringcomm" and not d.endswith("__init__"):
                if state.get(d) == 1:
                    found.append(stack[stack.index(d):] + [d])
                elif d not in state:
                    visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


def test_the_runtime_modules_import_no_circles() -> None:
    graph = _module_graph()
    # the engine and its pieces, the core: the path of every collective
    runtime = {"ringcomm.engine", "ringcomm.executor", "ringcomm.transport", "ringcomm.handles",
               "ringcomm.algorithms", "ringcomm.hierarchical", "ringcomm.shm_allreduce", "ringcomm.api",
               "ringcomm.runtime", "ringcomm.process_sets", "ringcomm.config", "ringcomm.timeline"}
    runtime |= {n for n in graph if n.startswith("ringcomm.core")}
    sub = {n: {d for d in deps if d in runtime} for n, deps in graph.items() if n in runtime}
    assert not _cycles(sub), _cycles(sub)
