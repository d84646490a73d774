"""The package's layers, checked from the source: the core does no I/O, no module imports in a circle, and each folder imports only the layers below it."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import ringcomm

pytestmark = pytest.mark.pure

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


def _module_graph(functions: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (imports under TYPE_CHECKING excluded).

    ``functions=False``: only the imports that run when the module is loaded (module level, class
    bodies, module-level ``if``/``try``); ``True`` adds the imports inside functions, which run at the
    first call.  ``from pkg import name`` counts ``pkg`` (its ``__init__``) only when ``name`` is not
    a submodule, and never when the importer lives inside ``pkg``: importing a submodule runs its
    package first, which is not a circle of the code.  ``ringcomm.bench`` (outside the runtime's
    import path) is left out.
    """
    files = [p for p in PKG.rglob("*.py") if "bench" not in p.relative_to(PKG).parts]
    names = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__") for p in files}
    graph: dict[str, set[str]] = {}
    for p in files:
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(p.read_text())
        skip = set()
        for node in ast.walk(tree):
            lazy = not functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if lazy or (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
                skip |= {id(n) for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for mod in _imports_of(node, name, p.name == "__init__.py", names):
                while mod and mod not in names:
                    mod = mod.rpartition(".")[0]
                inside = name.startswith(mod + ".")
                if mod and mod != name and mod.startswith("ringcomm") and not inside:
                    deps.add(mod)
        graph[name] = deps
    return graph


def _imports_of(node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool, modules: set[str]) -> list[str]:
    """The modules ``node`` loads: for ``from m import a``, ``m.a`` when it is a module, else ``m``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        package = name.split(".") if is_pkg else name.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1])
        mod = f"{base}.{node.module}" if node.module else base
    else:
        mod = node.module or ""
    subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
    return subs + ([mod] if len(subs) < len(node.names) else [])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among modules."""
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if d in graph:
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


def test_the_package_imports_no_circles_when_loaded() -> None:
    """A circle among the imports that run at load time breaks (or half-initialises) a module."""
    graph = _module_graph()
    assert {"ringcomm.engine", "ringcomm.launch.launcher", "ringcomm.launch.elastic_driver", "ringcomm.job.topology",
            "ringcomm.elastic.worker", "ringcomm.core.session"} <= set(graph)
    assert not _cycles(graph), _cycles(graph)


def test_the_package_imports_no_circles_even_inside_functions() -> None:
    """An import moved into a function to dodge a circle is still a circle of the design."""
    graph = _module_graph(functions=True)
    assert "ringcomm.launch.supervise" in graph["ringcomm.launch.elastic_driver"] and "ringcomm.launch.launcher" not in graph[
        "ringcomm.launch.elastic_driver"]
    assert not _cycles(graph), _cycles(graph)


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


#: The longest a module of the runtime or the torch package may be (lines, blank ones included).
MAX_MODULE_LINES = 600


def test_no_module_is_longer_than_600_lines() -> None:
    """Modules named for what they hold stay readable in one sitting: split one that grows past this."""
    roots = [PKG, PKG.parent / "ringcomm_torch"]  # read from the source: no torch needed
    files = [p for root in roots for p in root.rglob("*.py")]
    assert len(files) > 50
    long = {str(p.relative_to(PKG.parent)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}; split each along what it holds"


#: The folders of the package under the API, and what each may not import.
FOLDERS = ("core", "lane", "shm", "net", "collectives", "job", "launch", "elastic")
#: The API: what users call.  ``elastic.state`` is the user's elastic ``State``, which commits through the API.
API = {"ringcomm", "ringcomm.api", "ringcomm.ray", "ringcomm.elastic.state"}


def _in(mod: str, folder: str) -> bool:
    return mod.startswith(f"ringcomm.{folder}.") or mod == f"ringcomm.{folder}"


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_every_folder_says_in_one_sentence_what_lives_there() -> None:
    for folder in FOLDERS + ("bench",):
        doc = ast.get_docstring(ast.parse((PKG / folder / "__init__.py").read_text()))
        assert doc, f"ringcomm/{folder}/__init__.py has no docstring: say in one sentence what lives there"
        first = doc.split("\n\n")[0].replace("\n", " ")
        assert first.endswith("."), f"ringcomm/{folder}: the docstring's first paragraph is not a sentence: {first!r}"


def test_the_core_imports_nothing_outside_itself_but_the_errors() -> None:
    graph = _module_graph(functions=True)
    core = [m for m in graph if _in(m, "core")]
    assert "ringcomm.core.service" in core and "ringcomm.core.process_sets" in core
    bad = {m: sorted(d for d in graph[m] if not _in(d, "core") and d != "ringcomm.errors") for m in core}
    assert not any(bad.values()), f"the core imports outside itself: {bad}"


def test_the_lane_shared_memory_network_and_elastic_workers_do_not_import_the_launcher() -> None:
    graph = _module_graph(functions=True)
    mods = [m for m in graph if any(_in(m, f) for f in ("lane", "shm", "net", "elastic"))]
    assert {"ringcomm.lane.driver", "ringcomm.shm.slots", "ringcomm.net.transport", "ringcomm.elastic.worker"} <= set(mods)
    bad = {m: sorted(d for d in graph[m] if _in(d, "launch")) for m in mods}
    assert not any(bad.values()), f"these import the launcher: {bad}"


def test_the_launcher_never_loads_the_engine() -> None:
    """Starting a job reaches the runtime only through the rendezvous: no engine, no data plane, no lane."""
    graph = _module_graph(functions=True)
    launch = [m for m in graph if _in(m, "launch")]
    assert "ringcomm.launch.launcher" in launch and "ringcomm.launch.supervise" in launch
    engine_side = ("ringcomm.engine", "ringcomm.runtime", "ringcomm.api", "ringcomm.collectives", "ringcomm.lane",
                   "ringcomm.net.transport")
    for m in launch:
        bad = sorted(d for d in _reach(graph, m) if d.startswith(engine_side))
        assert not bad, f"{m} loads {bad}: the launcher must not need the engine"
    assert "ringcomm.net.rendezvous" in _reach(graph, "ringcomm.launch.launcher")


def test_nothing_below_the_api_imports_the_api() -> None:
    graph = _module_graph(functions=True)
    assert "ringcomm.api" in graph["ringcomm.elastic.state"]
    bad = {m: sorted(graph[m] & API) for m in graph if m not in API and graph[m] & API}
    assert not bad, f"modules below the API import it: {bad}"


def test_the_layer_checks_catch_a_wrong_import() -> None:
    graph = {"ringcomm.lane.driver": {"ringcomm.launch.supervise"}, "ringcomm.launch.supervise": {"ringcomm.engine"}}
    assert any(_in(d, "launch") for d in graph["ringcomm.lane.driver"])
    assert "ringcomm.engine" in _reach(graph, "ringcomm.lane.driver")
    assert not _in("ringcomm.launcher", "launch") and _in("ringcomm.launch", "launch")


def test_every_public_name_resolves_to_its_home_module_and_is_listed() -> None:
    """``ringcomm``'s names load on first use: each one of ``__all__`` is the object its module
    defines, ``dir()`` lists it, and an unknown name is an AttributeError naming it."""
    for name in ringcomm.__all__:
        home = importlib.import_module(f"ringcomm.{ringcomm._HOME[name]}")
        assert getattr(ringcomm, name) is getattr(home, name), name
    assert set(ringcomm.__all__) <= set(dir(ringcomm)) and set(ringcomm._HOME) == set(ringcomm.__all__)
    assert ringcomm.api is importlib.import_module("ringcomm.api")  # a submodule, as an attribute
    with pytest.raises(AttributeError, match="no_such_name"):
        ringcomm.no_such_name  # noqa: B018
