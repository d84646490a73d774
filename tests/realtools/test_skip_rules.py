"""Each real-tool tier skips, naming what to install, where its tool is missing: the skip rules themselves.

The rules are tested on fake paths and fake look-ups; the last test runs the tiers in a child
pytest where their tools are hidden and checks that every test there skips and none fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _frameworks import need_module
from _slurm import TOOLS, cluster_unavailable, missing_tools, mpi_plugin_missing
from _tools import HERE, env, module_missing, need, tool_missing


def test_a_missing_command_names_its_debian_package() -> None:
    assert tool_missing("mpirun.openmpi", "openmpi-bin", which=lambda _: None) == (
        "mpirun.openmpi is not installed (apt-get install openmpi-bin); .ci/run installs it")
    assert tool_missing("mpirun.openmpi", "openmpi-bin", which=lambda t: f"/usr/bin/{t}") is None


def test_need_skips_where_the_command_is_not_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match=r"apt-get install mpich"):
        need("mpiexec.mpich", "mpich")
    tool = tmp_path / "mpiexec.mpich"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert need("mpiexec.mpich", "mpich") == str(tool)


def test_a_missing_module_names_the_extra_that_brings_it() -> None:
    assert module_missing("json", "frameworks") is None
    assert module_missing("ringcomm_no_such_module", "frameworks") == (
        "ringcomm_no_such_module is not installed (pip install 'ringcomm[frameworks]'); .ci/run installs it")
    # a submodule of a package that is not there: the look-up itself raises, which is also "missing"
    assert module_missing("ringcomm_no_such_package.run", "torch") is not None
    assert module_missing("lightning", "frameworks", find_spec=lambda _: None) is not None
    with pytest.raises(pytest.skip.Exception, match=r"ringcomm\[frameworks\]"):
        need_module("ringcomm_no_such_module")


def test_slurm_tools_are_found_on_path_or_in_sbin(tmp_path: Path) -> None:
    assert missing_tools(which=lambda _: None, sbin=str(tmp_path)) == list(TOOLS)
    for daemon in ("munged", "slurmctld", "slurmd"):
        (tmp_path / daemon).write_text("")
    assert missing_tools(which=lambda _: None, sbin=str(tmp_path)) == ["srun", "sbatch", "sinfo"]
    assert missing_tools(which=lambda t: f"/usr/bin/{t}", sbin=str(tmp_path / "none")) == []


def test_a_slurm_cluster_needs_the_tools_root_and_a_resolvable_name() -> None:
    def unresolvable(host: str) -> str:
        raise OSError(f"no address for {host}")

    assert "apt-get install slurm-wlm munge" in (cluster_unavailable(["srun"], True, "node") or "")
    assert "needs root" in (cluster_unavailable([], False, "node") or "")
    assert "'node' does not resolve" in (cluster_unavailable([], True, "node", resolve=unresolvable) or "")
    assert cluster_unavailable([], True, "node", resolve=lambda _: "127.0.0.1") is None


def _tree(root: Path, *files: str) -> None:
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")


def test_srun_mpi_plugin_rules(tmp_path: Path) -> None:
    plugins, libs = tmp_path / "slurm", tmp_path / "lib"
    libs.mkdir()
    assert mpi_plugin_missing("pmi2", [str(plugins)], [str(libs)]) == "Slurm's mpi/pmi2 plugin is not installed"
    _tree(plugins, "mpi_pmi2.so", "mpi_pmix.so")
    assert mpi_plugin_missing("pmi2", [str(plugins)], [str(libs)]) is None  # pmi2 needs no libpmix
    # the plugin is there and the library folders exist, but hold no unversioned libpmix.so (no libpmix-dev)
    _tree(libs, "pmix2/lib/libpmix.so.2", "libc.so")
    assert "apt-get install libpmix-dev" in (mpi_plugin_missing("pmix", [str(plugins)], [str(libs)]) or "")
    assert "libpmix-dev" in (mpi_plugin_missing("pmix", [str(plugins)], [str(tmp_path / "absent")]) or "")
    _tree(libs, "pmix2/lib/libpmix.so")
    assert mpi_plugin_missing("pmix", [str(plugins)], [str(tmp_path / "absent"), str(libs)]) is None


# Loaded by the child pytest before it collects anything: the Python packages of the tiers cannot be imported.
HIDER = '''
import sys
HIDDEN = ("torch", "ray", "lightning", "accelerate")
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Hide())
'''


@pytest.mark.timeout(120)
def test_every_tier_skips_cleanly_where_its_tools_are_missing(tmp_path: Path) -> None:
    """No MPI launcher on PATH, and torch, ray, lightning and accelerate hidden: every test skips, none fails.

    (The Slurm tier also looks in /usr/sbin, so it is left to the rule tests above.)
    """
    (tmp_path / "hide_tier_tools.py").write_text(HIDER)
    tiers = ["test_real_mpi.py", "test_real_ray.py", "test_real_torchrun.py", "test_real_lightning.py",
             "test_real_accelerate.py"]
    child_env = env(PATH=str(tmp_path / "empty-bin"))
    child_env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), child_env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "hide_tier_tools", "-p",
                           "no:cacheprovider", *(str(HERE / t) for t in tiers)],
                          cwd=HERE.parent.parent, env=child_env, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    last = out.strip().splitlines()[-1]
    assert " skipped" in last and "passed" not in last and "failed" not in last and "error" not in last, out
    for reason in ("apt-get install openmpi-bin", "apt-get install mpich", "ray is not installed (pip install "
                   "'ringcomm[ray]')", "torch.distributed.run is not installed (pip install 'ringcomm[torch]')",
                   "lightning is not installed (pip install 'ringcomm[frameworks]')",
                   "accelerate is not installed (pip install 'ringcomm[frameworks]')"):
        assert reason in out, f"no skip names {reason!r}:\n{out}"
