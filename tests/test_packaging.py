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
    import ringcomm_torch

    assert ringcomm_torch.__version__ == ringcomm.__version__
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()


def test_version_flag_and_python_dash_m() -> None:
    import ringcomm

    for argv in (["-m", "ringcomm.launcher", "--version"], ["-m", "ringcomm", "--version"]):
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
