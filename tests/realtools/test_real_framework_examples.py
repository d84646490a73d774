"""The framework examples and ``python -m ringcomm.bench ddp --framework``, run for real (short)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from _frameworks import accelerate_launch, job_env, need_module
from _tools import ROOT, run

need_module("lightning")
need_module("accelerate")

pytestmark = [pytest.mark.multiprocess, pytest.mark.realtools]


@pytest.mark.timeout(240)
def test_bench_ddp_framework_lightning_runs_both_backends_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "ddp", "--framework", "lightning", "--np", "2", "--epochs", "2",
           "--steps", "3", "--repeats", "1", "--json", str(out), "--out-dir", str(tmp_path), "--no-plot"]
    proc = run(cmd, timeout=200, env=job_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    section = json.loads(out.read_text())["frameworks"]
    assert {r["backend"] for r in section["runs"] if r["ok"] and r["samples_s"] > 0} == {"ringcomm", "gloo"}
    assert section["summary"]["same_parameters"] == 1 and section["summary"]["ratio_median"] > 0, section
    assert '## Lightning: backend "ringcomm" vs gloo (np=2, torchrun' in proc.stdout, proc.stdout


@pytest.mark.timeout(180)
def test_the_accelerate_example_under_accelerate_launch(tmp_path: Path) -> None:
    script = str(ROOT / "examples" / "accelerate_ringcomm.py")
    proc = run(accelerate_launch(2, script, "--epochs", "2", "--steps", "3", "--json", str(tmp_path / "a.json")),
               timeout=150, env=job_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^ringcomm, 2 ranks: \d+ samples/s over epochs 2-2, loss [\d.]+, parameters [0-9a-f]{16}$",
                     proc.stdout, re.M), proc.stdout + proc.stderr
    assert json.loads((tmp_path / "a.json").read_text())["backend"] == "ringcomm"
