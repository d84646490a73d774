"""Framework benchmark: a PyTorch Lightning or Hugging Face Accelerate job on "ringcomm" vs on gloo.

    python -m ringcomm.bench ddp --framework lightning --np 2 --repeats 5

Runs ``examples/lightning_ringcomm.py`` or ``examples/accelerate_ringcomm.py`` (an MLP with
about 5 MiB of gradients, synthetic data) under torchrun, once per backend in each round,
alternating which goes first so the machine's drift hits both alike.  The summary gives the
median samples/s per backend, the median and spread of the per-round ratios ringcomm/gloo,
and whether both backends ended every round with the same parameters (the examples print a
digest of them).  Needs ``pip install 'ringcomm[frameworks]'`` and a checkout (the examples).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from . import _procs, _util

FRAMEWORKS = ("lightning", "accelerate")
BACKENDS = ("ringcomm", "gloo")
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


@dataclasses.dataclass
class FrameworkConfig:
    framework: str = "lightning"
    np_: int = 2
    epochs: int = 4
    steps: int = 20
    batch: int = 64
    repeats: int = 5
    job_timeout: float = 300.0


def example(framework: str) -> str:
    """The example script the benchmark runs for ``framework``."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"bench ddp --framework: {framework!r} is not one of {', '.join(FRAMEWORKS)}")
    return os.path.join(EXAMPLES, f"{framework}_ringcomm.py")


def _job(backend: str, cfg: FrameworkConfig, out: str) -> dict[str, Any]:
    script = example(cfg.framework)
    if not os.path.exists(script):
        raise FileNotFoundError(f"bench ddp --framework {cfg.framework}: {script} is missing; run the benchmark "
                                f"from a checkout of ringcomm (the examples are not installed with the package)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cfg.np_), script,
           "--backend", backend, "--epochs", str(cfg.epochs), "--steps", str(cfg.steps), "--batch-size",
           str(cfg.batch), "--json", out]
    res = _procs.run_job([cmd], _util.worker_env(backend == "ringcomm"), cfg.job_timeout)
    run: dict[str, Any] = {"backend": backend, "framework": cfg.framework, "ok": res.ok, "wall_s": round(res.wall_s, 2)}
    if res.ok:
        with open(out, encoding="utf-8") as f:
            run.update(json.load(f))
    else:
        run["error"] = res.describe()[-2000:]
    return run


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians per backend, per-round ratios ringcomm/gloo and whether each round's parameters agree (pure)."""
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        if r["ok"]:
            rounds.setdefault(int(r["round"]), {})[r["backend"]] = r
    both = [v for v in rounds.values() if all(b in v for b in BACKENDS)]
    ratios = sorted(v["ringcomm"]["samples_s"] / v["gloo"]["samples_s"] for v in both)
    per = {b: sorted(float(v[b]["samples_s"]) for v in rounds.values() if b in v) for b in BACKENDS}
    return {
        "samples_s_median": {b: statistics.median(v) if v else None for b, v in per.items()},
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_min": ratios[0] if ratios else None,
        "ratio_max": ratios[-1] if ratios else None,
        "rounds": len(ratios),
        "same_parameters": sum(v["ringcomm"]["digest"] == v["gloo"]["digest"] for v in both),
    }


def run(cfg: FrameworkConfig) -> dict[str, Any]:
    example(cfg.framework)  # an unknown framework fails before any job starts
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-frameworks-") as tmp:
        for rnd in range(cfg.repeats):
            for backend in BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]:
                r = _job(backend, cfg, os.path.join(tmp, f"{backend}-{rnd}.json"))
                r["round"] = rnd
                runs.append(r)
                _util.log(f"{cfg.framework} round {rnd + 1}/{cfg.repeats} on {backend}: "
                          + (f"{r['samples_s']:.0f} samples/s" if r["ok"] else "FAILED"))
    return {"config": dataclasses.asdict(cfg), "runs": runs, "summary": summarize(runs)}


def markdown(section: dict[str, Any]) -> str:
    cfg, s = section["config"], section["summary"]

    def fmt(v: Any, spec: str = ".0f") -> str:
        return "-" if v is None else format(v, spec)

    med = s["samples_s_median"]
    return "\n".join([
        f"## {cfg['framework'].capitalize()}: backend \"ringcomm\" vs gloo (np={cfg['np_']}, torchrun, "
        f"batch {cfg['batch']} per rank, {cfg['epochs'] - 1} timed epochs of {cfg['steps']} steps, "
        f"{cfg['repeats']} alternating rounds)", "",
        "| gloo samples/s (median) | ringcomm samples/s (median) | ratio median | ratio min..max "
        "| rounds with the same parameters |",
        "|---|---|---|---|---|",
        f"| {fmt(med['gloo'])} | {fmt(med['ringcomm'])} | {fmt(s['ratio_median'], '.2f')}x | "
        f"{fmt(s['ratio_min'], '.2f')}..{fmt(s['ratio_max'], '.2f')} | {s['same_parameters']} of {s['rounds']} |",
    ]) + "\n"
