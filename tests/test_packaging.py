"""The package as a user meets it: one version, the command lines, typing markers, the README and docs."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import job_env

ROOT = Path(__file__).resolve().parent.parent


def test_one_version_everywhere() -> None:
    import ringcomm
    ringcomm_torch = pytest.importorskip("ringcomm_torch")  # it needs torch

    assert ringcomm_torch.__version__ == ringcomm.__version__
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()


def test_version_flag_and_python_dash_m() -> None:
    import ringcomm

    for argv in (["-m", "ringcomm.launch.launcher", "--version"], ["-m", "ringcomm", "--version"]):
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, env=job_env())
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"ringcomm-run (ringcomm) {ringcomm.__version__}"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_python_dash_m_ringcomm_runs_a_job() -> None:
    code = "import ringcomm as rc; rc.init(); print('R', rc.rank(), rc.size())"
    out = subprocess.run([sys.executable, "-m", "ringcomm", "-np", "2", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=50, env=job_env(), cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[0]<stdout>:R 0 2" in out.stdout and "[1]<stdout>:R 1 2" in out.stdout


def test_typing_markers_and_license_ship() -> None:
    assert (ROOT / "ringcomm" / "py.typed").exists() and (ROOT / "ringcomm_torch" / "py.typed").exists()
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


def test_readme_opens_with_the_two_commands_and_stays_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    head = "\n".join(lines[:8])
    assert "ringcomm-run -np 4 python examples/torch_digits.py" in head
    assert "python -m pytest -q" in head


def test_docs_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or shutil.which("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    out = subprocess.run(["mkdocs", "build", "--strict", "-d", str(tmp_path / "site")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**job_env(), "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").exists()


@pytest.mark.parametrize("module_name", ["ringcomm", "ringcomm_torch"])
def test_all_is_static_and_complete(module_name: str) -> None:
    """``__all__`` is a literal list (IDEs, mypy and ruff read it) naming every public name the package imports."""
    if module_name == "ringcomm_torch":
        pytest.importorskip("torch")
    import ast
    import importlib
    import types

    path = ROOT / module_name / "__init__.py"
    assigned = [node for node in ast.parse(path.read_text()).body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
    assert len(assigned) == 1 and isinstance(assigned[0].value, ast.List), "__all__ must be one literal list"
    listed = [ast.literal_eval(e) for e in assigned[0].value.elts]
    assert len(listed) == len(set(listed)), "a name is listed twice"
    module = importlib.import_module(module_name)
    assert [n for n in listed if not hasattr(module, n)] == []
    public = {n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    public -= {"annotations", "Any"}  # typing helpers of the module itself
    assert sorted(public - set(listed)) == [], "imported in __init__ but missing from __all__"


def _build_wheel(out: Path) -> Path:
    try:
        import setuptools
    except ImportError:
        pytest.skip("setuptools is not installed")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject's build requirement)")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("ringcomm-*.whl")
    return wheel


def test_wheel_holds_the_runtime_and_the_benchmarks(tmp_path: Path) -> None:
    """The wheel: both packages, the benchmarks, py.typed and LICENSE; no tests, examples or docs."""
    import zipfile

    names = zipfile.ZipFile(_build_wheel(tmp_path)).namelist()
    assert "ringcomm/py.typed" in names and "ringcomm_torch/py.typed" in names
    assert "ringcomm/__main__.py" in names and "ringcomm_torch/elastic/__init__.py" in names
    assert "ringcomm/bench/__main__.py" in names and "ringcomm/bench/_gloo_worker.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert [n for n in names if n.startswith(("tests/", "examples/", "docs/"))] == []
    assert "ringcomm/torch_plugin.py" not in names


def test_benchmark_runs_from_the_installed_wheel(tmp_path: Path) -> None:
    """``python -m ringcomm.bench`` from a wheel in a fresh venv, away from the checkout: help, then a latency run.

    The fresh venv gets the wheel alone; numpy, pyzmq, msgpack and torch come from this
    environment's site-packages through a path file (whose own .pth files, the editable
    install's among them, are not read), so the test needs no package index.
    """
    import site
    import venv

    wheel = _build_wheel(tmp_path / "dist")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    fresh_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    Path(fresh_site, "outer-site.pth").write_text(site.getsitepackages()[0] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    env = {k: v for k, v in job_env().items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import ringcomm.bench; print(ringcomm.bench.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert where.stdout.strip().startswith(fresh_site), where.stdout + where.stderr
    helped = subprocess.run([str(python), "-m", "ringcomm.bench", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path, env=env)
    assert helped.returncode == 0 and "latency" in helped.stdout, helped.stdout + helped.stderr
    ran = subprocess.run([str(python), "-m", "ringcomm.bench", "latency", "--np", "2", "--ops", "50", "--warmup", "5",
                          "--repeats", "1", "--idle", "0", "--no-plot", "--out-dir", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "| 2 | ringcomm |" in ran.stdout and "| 2 | gloo |" in ran.stdout, ran.stdout[-3000:]


def test_compat_wheel_holds_horovods_names_and_horovodrun(tmp_path: Path) -> None:
    """compat/horovod's wheel: the horovod packages, the horovodrun script, ringcomm pinned; not its build backend."""
    import zipfile
    from importlib import metadata

    import ringcomm

    try:
        setuptools_version = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        pytest.skip("setuptools is not installed")
    if int(setuptools_version.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools_version} < 77 (the compat pyproject's build requirement)")
    source = tmp_path / "src"  # built from a copy: the in-tree build leaves build/ and *.egg-info behind
    shutil.copytree(ROOT / "compat" / "horovod", source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("horovod-*.whl")
    assert wheel.name.startswith(f"horovod-0.28.1+ringcomm.{ringcomm.__version__}-py3-none-any")
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    for module in ("__init__.py", "_ringcomm_compat.py", "torch/__init__.py", "torch/mpi_ops.py",
                   "torch/compression.py", "torch/elastic/__init__.py", "common/exceptions.py", "common/util.py",
                   "common/process_sets.py", "runner/__init__.py", "runner/util/threads.py"):
        assert f"horovod/{module}" in names, module
    assert [n for n in names if not n.startswith(("horovod/", "horovod-"))] == []
    info = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert f"Requires-Dist: ringcomm=={ringcomm.__version__}" in archive.read(info).decode()
    entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "horovodrun = ringcomm.launch.launcher:horovodrun_main" in entry_points
