"""No module reads another module's private names, checked from the source.

Flagged, in every module of ``ringcomm`` (but ``ringcomm/bench``) and ``ringcomm_torch``:

- ``module._name``: a private attribute of an imported module (or of something reached through it,
  ``module.Class._name``);
- ``from module import _name``: a private name imported from a module (private *modules* of the
  package, such as ``ringcomm.launch._run_task``, are the package's own and may be imported);
- ``obj._name`` on anything but ``self``/``cls``, when no ``_name`` is defined in the same module:
  an object's private state read by code outside the module that owns it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import ringcomm

pytestmark = pytest.mark.pure

ROOTS = [pathlib.Path(ringcomm.__file__).parent, pathlib.Path(ringcomm.__file__).parent.parent / "ringcomm_torch"]

#: Private names of other libraries that are used on purpose, each with its reason.
ALLOWED = {
    # the documented way to leave a forked child or a guard process without running Python's exit handlers
    ("os", "_exit"),
    # torch.distributed keeps its backend registry and the default group private; a third-party backend
    # must read the one to register only once and the other to find the world it joined
    ("dist.Backend", "_plugins"),
    ("dist.distributed_c10d", "_get_default_group"),
    # the base class torch's Work objects share; the DDP backend's work objects derive from it
    ("dist", "_Work"),
    # a sparse COO tensor's raw indices and values: the public indices()/values() refuse an uncoalesced
    # tensor, and coalescing each gradient before the allgather would cost a sort per step
    ("tensor", "_indices"),
    ("tensor", "_values"),
    # SyncBatchNorm is a batch norm layer: it derives from the base class torch's own batch norms share
    ("torch.nn.modules.batchnorm", "_BatchNorm"),
    # one batched copy of a gradient bucket's parts back into the gradients (one kernel launch for
    # the bucket rather than one per tensor); torch's optimizers use it the same way
    ("torch", "_foreach_copy_"),
}
#: The public methods of named tuples (underscored so that they cannot clash with field names).
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_here(tree: ast.AST) -> set[str]:
    """The private names this module defines: functions, classes, assigned attributes and variables."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
    return {name for name in out if _private(name)}


def _imported_names(tree: ast.AST) -> set[str]:
    """The local names bound by imports (modules and names imported from them)."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            out |= {a.asname or a.name for a in n.names}
    return out


def _is_module(node: ast.ImportFrom, name: str, path: pathlib.Path) -> bool:
    """Whether ``from ... import name`` names a module of this package (not an attribute)."""
    base = path.parent
    for _ in range(max(node.level - 1, 0)):
        base = base.parent
    for part in (node.module or "").split(".") if node.level else []:
        if part:
            base = base / part
    return (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()


def violations(source: str, path: pathlib.Path) -> list[str]:
    """``line: expression`` for each read of another module's private name in ``source``."""
    tree = ast.parse(source)
    own, imported = _defined_here(tree), _imported_names(tree)
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            found += [f"{n.lineno}: from {'.' * n.level}{n.module or ''} import {a.name}" for a in n.names
                      if _private(a.name) and not _is_module(n, a.name, path)
                      and (n.module, a.name) not in ALLOWED]
        if not (isinstance(n, ast.Attribute) and _private(n.attr)):
            continue
        base = n.value
        while isinstance(base, ast.Attribute):
            base = base.value
        if (ast.unparse(n.value), n.attr) in ALLOWED:
            continue
        if isinstance(base, ast.Name) and base.id in imported:
            found.append(f"{n.lineno}: {ast.unparse(n)} (a private name of an imported module)")
        elif isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
            continue
        elif n.attr not in own and n.attr not in NAMEDTUPLE_API:
            found.append(f"{n.lineno}: {ast.unparse(n)} (no {n.attr} is defined in this module)")
    return found


def test_no_module_reads_another_modules_private_names() -> None:
    files = [p for root in ROOTS for p in root.rglob("*.py") if "bench" not in p.relative_to(root).parts]
    assert len(files) > 50
    bad = {str(p): v for p in files if (v := violations(p.read_text(), p))}
    assert not bad, (f"private names read across modules: {bad}; give the owner a public method or "
                     "property, or (for another library's private) add it to ALLOWED with the reason")


def test_the_check_finds_each_kind_of_read() -> None:
    here = ROOTS[0] / "engine.py"
    source = """
from . import transport
from .transport import _SLICE
from .launch import _run_task

class Loop:
    def __init__(self, plane):
        self._plane = plane
        self._mine = 1

    def run(self, other):
        a = transport._SLICE
        b = self._plane._socks
        c = other._mine
        d = self._mine
        e = other._replace(x=1)
        return a, b, c, d, e
"""
    got = violations(source, here)
    assert [line.split(":")[0] for line in got] == ["3", "12", "13"], got
    assert "transport._SLICE" in got[1] and "self._plane._socks" in got[2]
