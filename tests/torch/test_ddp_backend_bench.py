"""``python -m ringcomm.bench ddp``: DDP on "ringcomm" vs gloo, alternating rounds; its pure summary."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from _preload import rank_python
from conftest import needs_torch
from ringcomm.bench import ddp

ROOT = Path(__file__).resolve().parents[2]


def test_summary_takes_medians_and_per_round_ratios():
    runs = [{"model": "mlp", "backend": b, "round": r, "ok": True, "img_s": v}
            for r, (rc_v, gloo_v) in enumerate([(300.0, 200.0), (240.0, 200.0), (100.0, 50.0)])
            for b, v in (("ringcomm", rc_v), ("gloo", gloo_v))]
    runs.append({"model": "mlp", "backend": "gloo", "round": 3, "ok": False})
    s = ddp.summarize(runs, "mlp")
    assert s["rounds"] == 3 and s["ratio_median"] == 1.5 and s["ratio_min"] == 1.2 and s["ratio_max"] == 2.0
    assert s["img_s_median"] == {"ringcomm": 240.0, "gloo": 200.0}
    assert ddp.summarize(runs, "cnn")["ratio_median"] is None
    section = {"config": {"np_": 2, "batch": 32, "steps": 5, "repeats": 3}, "runs": runs, "summary": [s]}
    assert "| mlp | - MiB | 200 | 240 | 1.50x | 1.20..2.00 |" in ddp.markdown(section)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_ddp_bench_runs_both_backends(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "ddp", "--rank-python", shlex.join(rank_python(2)), "--models", "mlp", "--steps", "2", "--warmup", "1",
           "--repeats", "1", "--json", str(out), "--out-dir", str(tmp_path), "--no-plot"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    section = json.loads(out.read_text())["ddp"]
    assert {r["backend"] for r in section["runs"] if r["ok"] and r["img_s"] > 0} == {"ringcomm", "gloo"}
    assert 29 < section["runs"][0]["grad_bytes"] / 2**20 < 31  # the MLP's ~30 MiB of gradients
    assert section["summary"][0]["ratio_median"] > 0
    assert '## DDP: backend "ringcomm" vs gloo' in proc.stdout


def test_framework_summary_pairs_rounds_and_compares_parameters():
    from ringcomm.bench import frameworks

    rows = [(0, "ringcomm", 300.0, "aa"), (0, "gloo", 200.0, "aa"), (1, "gloo", 100.0, "bb"),
            (1, "ringcomm", 150.0, "cc"), (2, "ringcomm", 90.0, "dd")]
    runs = [{"round": r, "backend": b, "ok": True, "samples_s": v, "digest": d} for r, b, v, d in rows]
    runs.append({"round": 2, "backend": "gloo", "ok": False})
    s = frameworks.summarize(runs)
    assert s["rounds"] == 2 and s["ratio_min"] == 1.5 and s["ratio_median"] == 1.5 and s["same_parameters"] == 1
    assert s["samples_s_median"] == {"ringcomm": 150.0, "gloo": 150.0}
    cfg = {"framework": "lightning", "np_": 2, "batch": 64, "epochs": 4, "steps": 20, "repeats": 3}
    text = frameworks.markdown({"config": cfg, "runs": runs, "summary": s})
    assert '## Lightning: backend "ringcomm" vs gloo (np=2, torchrun' in text
    assert "| 150 | 150 | 1.50x | 1.50..1.50 | 1 of 2 |" in text
    assert frameworks.example("accelerate").endswith("examples/accelerate_ringcomm.py")
    with pytest.raises(ValueError, match="'keras' is not one of lightning, accelerate"):
        frameworks.example("keras")


@needs_torch
@pytest.mark.timeout(120)
def test_backend_bench_times_each_op_on_both_backends(tmp_path: Path) -> None:
    out = tmp_path / "backend.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "backend", "--rank-python", shlex.join(rank_python(2)), "--ops", "scatter", "uneven_all_to_all_single",
           "--sizes", "4K", "--iters", "5", "--warmup", "1", "--repeats", "1", "--json", str(out), "--out-dir",
           str(tmp_path), "--no-plot"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    section = json.loads(out.read_text())["backend"]
    assert {r["backend"] for r in section["runs"] if r["ok"]} == {"ringcomm", "gloo"}
    rows = {(row["np"], row["op"], row["bytes"]): row for row in section["summary"]}
    assert set(rows) == {(2, "scatter", 4096), (2, "uneven_all_to_all_single", 4096)}
    for row in rows.values():
        assert row["ringcomm"]["n"] == row["gloo"]["n"] == 5 and len(row["ratios"]) == 1
        assert 0 < row["ringcomm"]["p50"] <= row["ringcomm"]["p99"] and row["gloo"]["mean"] > 0
    assert '## torch.distributed collectives: backend "ringcomm" vs gloo' in proc.stdout


def test_backend_bench_summary_pools_rounds_and_pairs_their_medians() -> None:
    from ringcomm.bench import backend_ops

    def run(backend: str, rnd: int, ms: list[float]) -> dict:
        return {"backend": backend, "np": 2, "bytes": 4096, "ok": True, "round": rnd, "ms": {"scatter": ms}}

    runs = [run("ringcomm", 0, [1.0, 2.0, 3.0]), run("gloo", 0, [2.0, 4.0, 6.0]), run("gloo", 1, [1.0, 1.0, 1.0]),
            run("ringcomm", 1, [3.0, 3.0, 3.0]), {"backend": "gloo", "np": 2, "bytes": 4096, "ok": False, "round": 2}]
    (row,) = backend_ops.summarize(runs)
    assert row["ratios"] == [0.5, 3.0]  # each round's medians, ringcomm / gloo
    assert row["ringcomm"]["n"] == 6 and row["ringcomm"]["p50"] == 3.0 and row["gloo"]["mean"] == pytest.approx(15 / 6)
