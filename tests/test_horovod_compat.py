"""The ``horovod`` compat distribution (compat/horovod): Horovod's names are ringcomm's objects, and it never
sits beside another ``horovod``.

Most tests import it from its source folder in a child process (this process never imports ``horovod``);
the job tests need it installed (``pip install ./compat/horovod``) and skip, saying so, where it is not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest

from conftest import job_env, needs_torch

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "compat" / "horovod"
PACKAGE = COMPAT / "horovod"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _python(code: str, *path: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose PYTHONPATH is ``path`` then the repository."""
    env = job_env()
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in path), str(ROOT)])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(ROOT))


def _fake_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# --------------------------------------------------------------------------- the guards, in memory


def test_guard_names_every_other_horovod_package_and_no_copy_of_its_own(tmp_path: Path) -> None:
    guard = _load(PACKAGE / "_ringcomm_compat.py", "compat_guard")
    real = _fake_package(tmp_path / "real", {"horovod/__init__.py": "", "horovod/common/basics.py": ""})
    copy = _fake_package(tmp_path / "copy", {"horovod/__init__.py": "", f"horovod/{guard.MARKER}": ""})
    plain = _fake_package(tmp_path / "plain", {"horovod/readme.txt": ""})  # a folder, not a package
    here = str(PACKAGE)
    path = [str(COMPAT), str(copy), str(plain), str(real), str(tmp_path / "missing"), str(real)]
    assert guard.other_horovod_packages(here, path) == [str((real / "horovod").resolve())]
    assert guard.other_horovod_packages(here, [str(COMPAT), str(copy)]) == []
    message = guard.refusal(here, [str(real / "horovod")], "0.28.1+ringcomm.0.1.0")
    assert str(real / "horovod") in message and here in message and "pip uninstall horovod" in message


def test_build_backend_finds_an_installed_horovod_but_not_itself(tmp_path: Path) -> None:
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed (the compat build backend wraps it)")
    site = tmp_path / "site-packages"
    _fake_package(site, {"horovod-0.28.1+ringcomm.0.1.0.dist-info/METADATA":
                         "Metadata-Version: 2.1\nName: horovod\nVersion: 0.28.1+ringcomm.0.1.0\n"})
    code = f"""
        import json, ringcomm_horovod_build as backend
        found = backend.installed_horovods([{str(site)!r}])
        print(json.dumps([found, backend.refusal(found) if found else ""]))
    """
    out = _python(code, COMPAT / "_build")  # in a child: setuptools is imported there only
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[], ""]
    _fake_package(site, {"horovod-0.28.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: horovod\nVersion: 0.28.1\n"})
    out = _python(code, COMPAT / "_build")
    assert out.returncode == 0, out.stderr
    found, message = json.loads(out.stdout)
    assert [v for v, _ in found] == ["0.28.1"] and Path(found[0][1]) == site
    assert f"horovod 0.28.1 (Horovod) is installed in {site}" in message and "ringcomm's horovod compat" in message
    assert "pip uninstall horovod" in message


def test_in_thread_runs_the_target_and_refuses_args_that_are_not_a_tuple() -> None:
    threads = _load(PACKAGE / "runner" / "util" / "threads.py", "compat_threads")
    seen: list[int] = []
    threads.in_thread(seen.append, args=(7,)).join(5)
    assert seen == [7]
    quiet = threads.in_thread(lambda: 1 / 0, silent=True, daemon=False)
    quiet.join(5)
    assert not quiet.is_alive()
    with pytest.raises(ValueError, match="args must be a tuple"):
        threads.in_thread(print, args=[1])


# --------------------------------------------------------------------------- imported from the source folder


def test_import_refuses_beside_another_horovod_naming_both(tmp_path: Path) -> None:
    other = _fake_package(tmp_path / "elsewhere", {"horovod/__init__.py": "raise SystemExit('the other one ran')\n"})
    out = _python("import horovod", COMPAT, other)
    assert out.returncode != 0
    assert "ImportError: import horovod: another `horovod` package is on sys.path" in out.stderr, out.stderr
    assert str((other / "horovod").resolve()) in out.stderr and str(PACKAGE) in out.stderr


@needs_torch
def test_horovods_names_are_ringcomms_objects() -> None:
    code = """
        import json, inspect
        import ringcomm, ringcomm.errors, ringcomm.core.process_sets, ringcomm_torch, torch
        import horovod, horovod.torch as hvd
        from horovod.torch import compression, elastic, functions, mpi_ops, optimizer, sync_batch_norm
        from horovod.common import exceptions, process_sets
        from horovod.common.elastic import ObjectState, State, run_fn
        from horovod.runner import run as runner_run
        from horovod.runner.util.threads import in_thread
        from horovod.common import util
        import os

        os.environ["COMPAT_KEPT"] = "before"
        with util.env(COMPAT_SET="1", COMPAT_KEPT="inside", COMPAT_NONE=None):
            inside = [os.environ.get(k) for k in ("COMPAT_SET", "COMPAT_KEPT", "COMPAT_NONE")]
        after = [os.environ.get(k) for k in ("COMPAT_SET", "COMPAT_KEPT")]

        different = [n for n in ringcomm_torch.__all__ if getattr(hvd, n) is not getattr(ringcomm_torch, n)]
        mpi_ops_different = [n for n in mpi_ops.__all__ if getattr(mpi_ops, n) is not getattr(ringcomm_torch, n)]
        print(json.dumps({
            "version": horovod.__version__, "ringcomm": ringcomm.__version__,
            "run": horovod.run is ringcomm.run and runner_run is ringcomm.run,
            "different": different, "mpi_ops_different": mpi_ops_different, "mpi_ops": sorted(mpi_ops.__all__),
            "submodules": [hvd.elastic is elastic, hvd.mpi_ops is mpi_ops, hvd.compression is compression],
            "errors": [exceptions.HorovodInternalError is ringcomm.errors.HorovodInternalError,
                       exceptions.HostsUpdatedInterrupt is ringcomm.errors.HostsUpdatedInterrupt,
                       issubclass(exceptions.HorovodInternalError, RuntimeError),
                       issubclass(exceptions.HostsUpdatedInterrupt, RuntimeError)],
            "process_sets": [process_sets.ProcessSet is ringcomm.core.process_sets.ProcessSet,
                             process_sets.global_process_set is hvd.global_process_set,
                             process_sets.add_process_set is hvd.add_process_set,
                             process_sets.remove_process_set is hvd.remove_process_set],
            "elastic": [elastic.run is ringcomm_torch.elastic.run, elastic.TorchState is ringcomm_torch.elastic.TorchState,
                        elastic.ElasticSampler is ringcomm_torch.elastic.ElasticSampler,
                        elastic.sampler.ElasticSampler is elastic.ElasticSampler,
                        elastic.state.TorchState is elastic.TorchState,
                        State is ringcomm_torch.elastic.State and ObjectState is ringcomm_torch.elastic.ObjectState,
                        run_fn is ringcomm_torch.elastic.run_fn],
            "compression": [compression.Compression is hvd.Compression,
                            compression.FP16Compressor is ringcomm_torch.compression.FP16Compressor],
            "others": [functions.broadcast_parameters is hvd.broadcast_parameters,
                       optimizer.DistributedOptimizer is hvd.DistributedOptimizer,
                       sync_batch_norm.SyncBatchNorm is hvd.SyncBatchNorm, callable(in_thread)],
            "built": [hvd.mpi_built(), hvd.mpi_enabled(), hvd.gloo_built(), hvd.gloo_enabled(), hvd.nccl_built(),
                      hvd.cuda_built() == torch.backends.cuda.is_built()],
            "util_built": [util.mpi_built(), util.gloo_built(), util.nccl_built(), util.ddl_built(), util.ccl_built()],
            "env": [inside, after],
        }))
    """
    out = _python(code, COMPAT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["version"] == f"0.28.1+ringcomm.{got['ringcomm']}"
    assert got["run"] and got["different"] == [] and got["mpi_ops_different"] == []
    # what scripts import from horovod.torch.mpi_ops
    assert {"allreduce", "allreduce_async", "synchronize", "poll", "Average", "Sum", "Adasum", "rank", "size",
            "global_process_set", "reducescatter", "join", "barrier"} <= set(got["mpi_ops"])
    for key in ("submodules", "errors", "process_sets", "elastic", "compression", "others"):
        assert all(got[key]), (key, got[key])
    assert got["built"] == [False, False, False, False, 0, True]
    assert got["util_built"] == [False, False, 0, False, False]
    assert got["env"] == [["1", "inside", None], [None, "before"]]


def test_distribution_version_and_pin_follow_ringcomm() -> None:
    import ast

    import ringcomm

    project = tomllib.loads((COMPAT / "pyproject.toml").read_text())["project"]
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    literal = [n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
               and any(isinstance(t, ast.Name) and t.id == "__version__" for t in n.targets)]
    expected = f"0.28.1+ringcomm.{ringcomm.__version__}"
    assert literal == [expected] and project["version"] == expected
    assert project["name"] == "horovod" and project["dependencies"] == [f"ringcomm=={ringcomm.__version__}"]
    assert project["scripts"] == {"horovodrun": "ringcomm.launch.launcher:horovodrun_main"}


# --------------------------------------------------------------------------- installed (pip install ./compat/horovod)


def _installed_compat() -> Path:
    """horovodrun of the installed compat distribution, or skip saying why."""
    try:
        version = metadata.version("horovod")
    except metadata.PackageNotFoundError:
        pytest.skip("the horovod compat distribution is not installed (pip install ./compat/horovod)")
    if "+ringcomm" not in version:
        pytest.skip(f"horovod {version} installed here is not ringcomm's compat distribution")
    runner = Path(sys.executable).parent / "horovodrun"
    if not runner.exists():
        pytest.skip(f"horovodrun is not beside {sys.executable}")
    return runner


TRAIN = """
import torch
import horovod.torch as hvd
from horovod.torch.mpi_ops import synchronize
from horovod.common.exceptions import HorovodInternalError

hvd.init()
total = synchronize(hvd.allreduce_async(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="total"))
torch.manual_seed(hvd.rank())
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for _ in range(3):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1)).backward()
    optimizer.step()
weights = hvd.allgather_object(model.weight.detach())
try:
    hvd.broadcast(torch.ones(2), root_rank=hvd.size(), name="bad_root")
    refused = "no"
except (HorovodInternalError, ValueError) as exc:
    refused = type(exc).__name__
print("RESULT", hvd.rank(), hvd.size(), total.item(), all(torch.equal(w, weights[0]) for w in weights), refused)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_horovodrun_runs_a_horovod_script_unedited(tmp_path: Path) -> None:
    runner = _installed_compat()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {k: v for k, v in job_env().items() if k != "PYTHONPATH"}  # the installed packages only
    env["PATH"] = f"{runner.parent}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run([str(runner), "-np", "2", "-H", "localhost:2", "--gloo", "python", str(script)],
                         capture_output=True, text=True, timeout=80, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:RESULT {rank} 2 3.0 True " in out.stdout, out.stdout
    assert "RESULT 0 2 3.0 True no" not in out.stdout  # a root outside the job is refused


def test_installed_horovodrun_is_ringcomm_run() -> None:
    runner = _installed_compat()
    import ringcomm

    out = subprocess.run([str(runner), "--version"], capture_output=True, text=True, timeout=60, env=job_env())
    assert out.returncode == 0 and out.stdout.strip() == f"horovodrun (ringcomm) {ringcomm.__version__}"
    # usage errors name the command the user typed
    out = subprocess.run([str(runner), "-np", "2", "--no-such-flag", "python", "x.py"], capture_output=True, text=True,
                         timeout=60, env=job_env())
    assert out.returncode == 2 and "horovodrun: error: unrecognized arguments: --no-such-flag" in out.stderr, out.stderr
    assert "ringcomm-run" not in out.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_horovodruns_reports_of_a_failed_job_name_horovodrun(tmp_path: Path) -> None:
    """The root-cause block of a static job and the elastic driver's messages start with the command typed."""
    runner = _installed_compat()
    fail = [sys.executable, "-c", "import sys; print('failing', flush=True); sys.exit(3)"]
    out = subprocess.run([str(runner), "-np", "2", *fail], capture_output=True, text=True, timeout=60, env=job_env())
    assert out.returncode == 3 and "horovodrun: job failed\n  root cause: rank " in out.stderr, out.stderr
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:1\n")
    discover.chmod(0o755)
    out = subprocess.run([str(runner), "-np", "1", "--min-np", "1", "--max-np", "1", "--host-discovery-script",
                          str(discover), "--elastic-timeout", "5", *fail], capture_output=True, text=True, timeout=60,
                         env=job_env())
    assert out.returncode != 0 and "horovodrun: elastic job failed" in out.stderr, out.stderr
    assert "ringcomm-run" not in out.stderr, out.stderr


# --------------------------------------------------------------------------- pip's refusal, for real


def _setuptools_77() -> None:
    try:
        version = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        pytest.skip("setuptools is not installed")
    if int(version.split(".")[0]) < 77:
        pytest.skip(f"setuptools {version} < 77 (the compat pyproject's build requirement)")
    try:  # not importlib.util.find_spec("pip"): setuptools' distutils shim reacts to it and breaks later imports
        metadata.version("pip")
    except metadata.PackageNotFoundError:
        pytest.skip("pip is not installed")


def _bare_venv(where: Path) -> tuple[Path, Path]:
    """A venv with nothing installed that borrows this interpreter's packages (pip, setuptools, ringcomm)
    through a .pth file after its own site-packages; returns (its python, its site-packages)."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    borrowed = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), str(ROOT)}
    (site / "borrowed.pth").write_text("".join(f"{p}\n" for p in sorted(borrowed)))
    return python, site


@pytest.mark.timeout(240)
def test_pip_refuses_to_install_over_horovod_and_installs_where_there_is_none(tmp_path: Path) -> None:
    _setuptools_77()
    python, site = _bare_venv(tmp_path / "venv")
    source = tmp_path / "compat-horovod"
    shutil.copytree(COMPAT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    _fake_package(site, {"horovod/__init__.py": "__version__ = '0.28.1'\n",
                         "horovod-0.28.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: horovod\nVersion: 0.28.1\n",
                         "horovod-0.28.1.dist-info/RECORD": "horovod/__init__.py,,\n"})
    env = {k: v for k, v in job_env().items() if k != "PYTHONPATH"}
    pip = [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", str(source)]
    out = subprocess.run(pip, capture_output=True, text=True, timeout=200, env=env)
    assert out.returncode != 0
    assert "horovod 0.28.1 (Horovod) is installed in" in out.stdout + out.stderr, out.stdout + out.stderr
    assert (site / "horovod" / "__init__.py").read_text() == "__version__ = '0.28.1'\n"  # left as it was

    shutil.rmtree(site / "horovod")
    shutil.rmtree(site / "horovod-0.28.1.dist-info")
    out = subprocess.run(pip, capture_output=True, text=True, timeout=200, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    probe = "import horovod, horovod.torch.mpi_ops; print(horovod.__version__, horovod.__file__)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    version, where = out.stdout.split()
    assert "+ringcomm." in version and Path(where).is_relative_to(site)
    assert (python.parent / "horovodrun").exists()
