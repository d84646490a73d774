"""torch.distributed's collectives on the "ringcomm" backend against gloo, op by op.

    python -m ringcomm.bench backend --np 2 4 --ops scatter all_to_all_single --sizes 4K 4M

Each round runs one job per backend at each world size, alternating which goes first, so the
machine's drift hits both alike; every job times every op and size (:mod:`._backend_worker`:
blocking calls back to back, each iteration the slowest rank's time).  The summary pools the
rounds' iterations per backend (p50, p99, mean) and gives the per-round ratios of the medians,
ringcomm / gloo (below 1: ringcomm is faster).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

from . import _launch, _procs, _util

MODULE = "ringcomm.bench._backend_worker"
BACKENDS = ("ringcomm", "gloo")
#: The ops the worker times (``_backend_worker``), each made from the rank, the world size and the
#: float32 elements per rank.
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
       "all_to_all_single", "uneven_all_to_all_single", "all_to_all", "gather", "scatter")
DEFAULT_OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "uneven_all_to_all_single", "gather", "scatter")
DEFAULT_SIZES = ("4K", "256K", "4M")


@dataclasses.dataclass
class BackendConfig:
    nps: Sequence[int] = (2,)
    ops: Sequence[str] = DEFAULT_OPS
    sizes: Sequence[int] = (4096, 256 << 10, 4 << 20)  # bytes of float32 per rank
    iters: int = 200
    warmup: int = 20
    repeats: int = 2
    job_timeout: float = 300.0


def _iters_for(nbytes: int, iters: int) -> int:
    """``iters`` up to 256 KiB, fewer above (about as long per size), at least 20 (or ``iters``)."""
    return max(min(iters, 20), min(iters, iters * (256 << 10) // max(nbytes, 1)))


def _job(backend: str, np_: int, cfg: BackendConfig, nbytes: int, out: str) -> dict[str, Any]:
    port = _util.free_port()
    iters = _iters_for(nbytes, cfg.iters)
    commands = [[*_launch.python(), "-m", MODULE, "--backend", backend, "--rank", str(r), "--world", str(np_),
                 "--port", str(port), "--ops", *cfg.ops, "--sizes", str(nbytes), "--iters", str(iters),
                 "--warmup", str(min(cfg.warmup, iters)), "--out", out] for r in range(np_)]
    res = _procs.run_job(commands, _util.worker_env(backend == "ringcomm"), cfg.job_timeout)
    run: dict[str, Any] = {"backend": backend, "np": np_, "bytes": nbytes, "ok": res.ok, "wall_s": round(res.wall_s, 2)}
    if res.ok:
        with open(out, encoding="utf-8") as f:
            run["ms"] = {op: times[str(nbytes)] for op, times in json.load(f).items()}
    else:
        run["error"] = "\n".join(res.tails)[-2000:]
    return run


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world size, op and size: p50/p99/mean per backend over every round's iterations, and
    the per-round ratios of the medians ringcomm/gloo (pure)."""
    rows: list[dict[str, Any]] = []
    keys = sorted({(r["np"], op, r["bytes"]) for r in runs if r["ok"] for op in r["ms"]},
                  key=lambda k: (k[0], OPS.index(k[1]) if k[1] in OPS else len(OPS), k[2]))
    for np_, op, nbytes in keys:
        mine = [r for r in runs if r["ok"] and r["np"] == np_ and r["bytes"] == nbytes and op in r["ms"]]
        row: dict[str, Any] = {"np": np_, "op": op, "bytes": nbytes}
        for b in BACKENDS:
            pooled = [t for r in mine if r["backend"] == b for t in r["ms"][op]]
            row[b] = {"p50": _util.percentile(pooled, 50), "p99": _util.percentile(pooled, 99),
                      "mean": statistics.fmean(pooled) if pooled else float("nan"), "n": len(pooled)}
        by_round: dict[int, dict[str, float]] = {}
        for r in mine:
            by_round.setdefault(int(r["round"]), {})[r["backend"]] = statistics.median(r["ms"][op])
        row["ratios"] = [v["ringcomm"] / v["gloo"] for _, v in sorted(by_round.items())
                         if "ringcomm" in v and "gloo" in v and v["gloo"] > 0]
        rows.append(row)
    return rows


def run(cfg: BackendConfig) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-backend-") as tmp:
        for rnd in range(cfg.repeats):
            for np_ in cfg.nps:
                for nbytes in cfg.sizes:
                    for backend in (BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]):
                        out = os.path.join(tmp, f"{backend}-{np_}-{nbytes}-{rnd}.json")
                        r = _job(backend, np_, cfg, nbytes, out)
                        r["round"] = rnd
                        runs.append(r)
                        _util.log(f"backend round {rnd + 1}/{cfg.repeats} np={np_} {_util.format_size(nbytes)} on "
                                  f"{backend}: " + ("ok" if r["ok"] else "FAILED"))
    return {"config": dataclasses.asdict(cfg), "runs": runs, "summary": summarize(runs)}


def markdown(section: dict[str, Any]) -> str:
    cfg = section["config"]
    lines = [f"## torch.distributed collectives: backend \"ringcomm\" vs gloo ({cfg['repeats']} alternating "
             "rounds; ms per blocking call, each iteration the slowest rank's)", "",
             "| np | op | size per rank | gloo p50 | gloo p99 | gloo mean | ringcomm p50 | ringcomm p99 | "
             "ringcomm mean | ringcomm / gloo p50, per round |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in section["summary"]:
        g, rc = row["gloo"], row["ringcomm"]
        ratios = ", ".join(f"{v:.2f}" for v in row["ratios"]) or "-"
        lines.append(f"| {row['np']} | {row['op']} | {_util.format_size(row['bytes'])} | {g['p50']:.3f} | "
                     f"{g['p99']:.3f} | {g['mean']:.3f} | {rc['p50']:.3f} | {rc['p99']:.3f} | {rc['mean']:.3f} | "
                     f"{ratios} |")
    return "\n".join(lines) + "\n"
