"""DDP benchmark: ``DistributedDataParallel`` on the "ringcomm" torch.distributed backend vs on gloo.

    python -m ringcomm.bench ddp --np 2 --repeats 5

Two models (:mod:`._ddp_worker`): a compute-heavy small CNN (about 1 MiB of gradients per
step) and a communication-heavy MLP (about 30 MiB).  Each round runs one job per backend,
alternating which goes first, so the machine's drift hits both alike; the summary gives the
median img/s per backend and the median and spread of the per-round ratios ringcomm/gloo.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

from . import _launch, _procs, _util

MODULE = "ringcomm.bench._ddp_worker"
BACKENDS = ("ringcomm", "gloo")
MODELS = ("cnn", "mlp")


@dataclasses.dataclass
class DDPConfig:
    np_: int = 2
    models: Sequence[str] = MODELS
    batch: int = 32
    steps: int = 40
    warmup: int = 15  # the first steps after init pay for connection set-up: measure the steady state
    repeats: int = 5
    job_timeout: float = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(backend: str, model: str, cfg: DDPConfig, out: str) -> dict[str, Any]:
    port = _free_port()
    commands = [[*_launch.python(), "-m", MODULE, "--backend", backend, "--model", model, "--rank", str(r),
                 "--world", str(cfg.np_), "--port", str(port), "--batch", str(cfg.batch), "--steps", str(cfg.steps),
                 "--warmup", str(cfg.warmup), "--out", out] for r in range(cfg.np_)]
    res = _procs.run_job(commands, _util.worker_env(backend == "ringcomm"), cfg.job_timeout)
    run: dict[str, Any] = {"backend": backend, "model": model, "ok": res.ok, "wall_s": round(res.wall_s, 2)}
    if res.ok:
        with open(out, encoding="utf-8") as f:
            run.update(json.load(f))
    else:
        run["error"] = "\n".join(res.tails)[-2000:]
    return run


def summarize(runs: Sequence[dict[str, Any]], model: str) -> dict[str, Any]:
    """Medians per backend and per-round ratios ringcomm/gloo for ``model`` (pure)."""
    rounds: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["model"] == model and r["ok"]:
            rounds.setdefault(int(r["round"]), {})[r["backend"]] = float(r["img_s"])
    ratios = sorted(v["ringcomm"] / v["gloo"] for v in rounds.values() if "ringcomm" in v and "gloo" in v)
    per = {b: sorted(v[b] for v in rounds.values() if b in v) for b in BACKENDS}
    return {
        "model": model,
        "img_s_median": {b: statistics.median(v) if v else None for b, v in per.items()},
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_min": ratios[0] if ratios else None,
        "ratio_max": ratios[-1] if ratios else None,
        "ratio_mean": statistics.fmean(ratios) if ratios else None,
        "rounds": len(ratios),
    }


def run(cfg: DDPConfig) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-ddp-") as tmp:
        for rnd in range(cfg.repeats):
            for model in cfg.models:
                order = BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]
                for backend in order:
                    out = os.path.join(tmp, f"{model}-{backend}-{rnd}.json")
                    r = _job(backend, model, cfg, out)
                    r["round"] = rnd
                    runs.append(r)
                    _util.log(f"ddp round {rnd + 1}/{cfg.repeats} {model} on {backend}: "
                              + (f"{r['img_s']:.0f} img/s" if r["ok"] else "FAILED"))
    return {"config": dataclasses.asdict(cfg), "runs": runs, "summary": [summarize(runs, m) for m in cfg.models]}


def markdown(section: dict[str, Any]) -> str:
    cfg = section["config"]
    lines = [f"## DDP: backend \"ringcomm\" vs gloo (np={cfg['np_']}, batch {cfg['batch']} per rank, "
             f"{cfg['steps']} timed steps, {cfg['repeats']} alternating rounds)", "",
             "| model | gradients | gloo img/s (median) | ringcomm img/s (median) | ratio median | ratio min..max |",
             "|---|---|---|---|---|---|"]
    grads = {r["model"]: r.get("grad_bytes") for r in section["runs"] if r.get("grad_bytes")}
    for s in section["summary"]:
        med = s["img_s_median"]

        def fmt(v: Any, spec: str = ".0f") -> str:
            return "-" if v is None else format(v, spec)
        gb = grads.get(s["model"])
        lines.append(f"| {s['model']} | {fmt(gb / 2**20 if gb else None, '.1f')} MiB | {fmt(med['gloo'])} | "
                     f"{fmt(med['ringcomm'])} | {fmt(s['ratio_median'], '.2f')}x | "
                     f"{fmt(s['ratio_min'], '.2f')}..{fmt(s['ratio_max'], '.2f')} |")
    return "\n".join(lines) + "\n"
