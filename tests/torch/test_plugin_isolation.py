"""The ``torch.backends`` entry point survives a broken ringcomm install: ``import torch`` keeps working.

torch imports the entry point's module at ``import torch`` and refuses to import at all if
that fails.  These tests hide one of ringcomm's dependencies (msgpack) in a fresh interpreter
and check that torch still imports, and that the backend, once used, says what is missing.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'ringcomm[torch]')")

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "ringcomm_torch_plugin" / "__init__.py"

# Put in front of every other import in the child: msgpack then cannot be imported, as in an install without it.
HIDE_MSGPACK = """
import sys
class HideMsgpack:
    def find_spec(self, name, path=None, target=None):
        if name == "msgpack" or name.startswith("msgpack."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, HideMsgpack())
"""

# A one-rank group on the backend: prints OK, or the error it raised.
USE_BACKEND = """
import torch.distributed as dist
print("registered", "RINGCOMM" in dist.Backend._plugins)
try:
    dist.init_process_group("ringcomm", store=dist.HashStore(), rank=0, world_size=1)
    print("OK")
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
"""


def _child(code: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_") and k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=90)


def _entry_point_installed(cwd: Path) -> bool:
    probe = ("from importlib import metadata; print(any(ep.value == 'ringcomm_torch_plugin:load' "
             "for ep in metadata.entry_points(group='torch.backends')))")
    return _child(probe, cwd).stdout.strip() == "True"


def test_the_plugin_module_imports_only_the_standard_library() -> None:
    tree = ast.parse(PLUGIN.read_text())
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = {alias.name.split(".")[0] for node in top if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module.split(".")[0] for node in top if isinstance(node, ast.ImportFrom) and node.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names


def test_load_with_msgpack_hidden_registers_and_then_names_what_is_missing(tmp_path: Path) -> None:
    """Without relying on the installed metadata: import the module and call load() as torch does."""
    code = HIDE_MSGPACK + "import ringcomm_torch_plugin\nprint('ringcomm' in sys.modules)\n" \
        "import torch\nringcomm_torch_plugin.load()\n" + USE_BACKEND
    out = _child(code, tmp_path, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    lines = out.stdout.splitlines()
    assert lines[:2] == ["False", "registered True"], out.stdout + out.stderr
    assert lines[2].startswith("ERROR ImportError rank 0: the 'ringcomm' torch.distributed backend cannot start"), lines
    assert "msgpack" in lines[2] and "reinstall" in lines[2], lines


@pytest.mark.parametrize("under_ringcomm_run", [False, True], ids=["plain", "ringcomm-run-worker"])
def test_import_torch_works_when_a_dependency_is_missing(tmp_path: Path, under_ringcomm_run: bool) -> None:
    if not _entry_point_installed(tmp_path):
        pytest.skip("the installed ringcomm's torch.backends entry point is not ringcomm_torch_plugin:load "
                    "(reinstall: pip install -e .)")
    extra = {"RINGCOMM_RANK": "0", "RINGCOMM_SIZE": "1"} if under_ringcomm_run else {}
    out = _child(HIDE_MSGPACK + "import torch\nprint('torch', torch.ones(2).sum().item())\n" + USE_BACKEND,
                 tmp_path, **extra)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[:2] == ["torch 2.0", "registered True"], out.stdout + out.stderr
    assert lines[2].startswith("ERROR ImportError rank 0: the 'ringcomm' torch.distributed backend cannot start"), lines
    assert "No module named 'msgpack'" in lines[2], lines
    if under_ringcomm_run:  # the eager import at import torch failed: logged, not raised
        assert "could not import the 'ringcomm' torch.distributed backend" in out.stderr, out.stderr
