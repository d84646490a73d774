"""Collective benchmarks: ringcomm and gloo (and Horovod if present) alternated on the same sizes.

For each world size, ``repeats`` rounds run one job per system in turn
(ringcomm, gloo, ringcomm, gloo, ...), so slow drift of the machine hits every
system alike.  Each job times every size (see :mod:`._timing`); the summary
pools the per-iteration times (slowest rank) of all rounds and takes medians.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from . import _launch, _procs, _timing, _util

DEFAULT_SIZES = ("4K", "64K", "1M", "16M", "64M")
DEFAULT_NPS = (2, 4)
WORKER_MODULES = {
    "ringcomm": "ringcomm.bench._rc_worker",
    _launch.ENCRYPTED: "ringcomm.bench._rc_worker",
    "gloo": "ringcomm.bench._gloo_worker",
    "horovod": "ringcomm.bench._hvd_worker",
}
#: How bus bandwidth is computed, per op (N ranks, B bytes, t seconds), for reports.
BUSBW_FORMULA = {
    "allreduce": "2(N-1)/N * bytes / time",
    "allgather": "(N-1)/N * gathered bytes / time",
    "broadcast": "bytes / time",
}


@dataclasses.dataclass
class CollectiveConfig:
    """What to measure: one op, on these world sizes and byte sizes."""

    op: str
    nps: Sequence[int] = DEFAULT_NPS
    sizes: Sequence[int] = tuple(_util.parse_size(s) for s in DEFAULT_SIZES)
    #: Timed iterations per size; ``None``: :func:`default_iters` picks by size.
    iters: int | None = None
    warmup: int = 3
    repeats: int = 3
    #: Seconds one job may take before it is killed.
    job_timeout: float = 300.0
    #: Systems to run (Horovod is dropped when unavailable).
    systems: Sequence[str] = _launch.SYSTEMS
    #: "cuda": the buffers are CUDA tensors (ringcomm through ringcomm_torch, gloo on CUDA tensors).
    device: str = "cpu"


def default_iters(nbytes: int) -> int:
    """Timed iterations per job when ``--iters`` is not given: more for small, cheap sizes."""
    if nbytes <= 1 << 20:
        return 50
    if nbytes <= 16 << 20:
        return 20
    return 10


def bus_bandwidth(op: str, nbytes: int, np_: int, seconds: float) -> float:
    """Bus bandwidth in bytes/s (NCCL-tests convention), so numbers compare across ``np``."""
    if seconds <= 0:
        return float("nan")
    if op == "allreduce":
        return 2 * (np_ - 1) / np_ * nbytes / seconds
    if op == "allgather":
        return (np_ - 1) / np_ * nbytes / seconds
    return nbytes / seconds


def measured_bytes(op: str, nbytes: int, np_: int) -> int:
    """Bytes actually moved for a requested size (allgather rounds to a multiple of ``np_`` floats)."""
    count = _timing.elements_per_rank(op, nbytes, np_)
    return count * np_ * 4 if op == "allgather" else count * 4


def _run_one(system: str, cfg: CollectiveConfig, np_: int, plan: str, tmp: str, tag: str) -> dict[str, Any]:
    out = os.path.join(tmp, f"{tag}.json")
    args = ["--op", cfg.op, "--plan", plan, "--warmup", str(cfg.warmup), "--out", out,
            "--deadline", str(_timing.worker_deadline(cfg.job_timeout)), "--device", cfg.device]
    result = _launch.run_system(system, np_, WORKER_MODULES[system], args, cfg.job_timeout)
    return _procs.job_record(result, out, ("init_s",), system=system, np=np_, wall_s=round(result.wall_s, 3),
                             init_s=None)


def run(cfg: CollectiveConfig) -> dict[str, Any]:
    """Measure ``cfg.op``; returns the JSON-ready section (config, raw runs, summary, notes)."""
    notes: list[str] = []
    systems = list(cfg.systems)
    _launch.skip_gloo(systems, notes)
    if "horovod" in systems:
        why = _launch.horovod_status()
        if why is not None:
            systems.remove("horovod")
            notes.append(f"Horovod skipped: {why}")
    plan = ",".join(f"{s}:{cfg.iters or default_iters(s)}" for s in cfg.sizes)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-") as tmp:
        for np_ in cfg.nps:
            for repeat in range(cfg.repeats):
                for system in systems:
                    tag = f"{system}-np{np_}-r{repeat}"
                    _util.log(f"{cfg.op} np={np_} {system} (round {repeat + 1}/{cfg.repeats}) ...")
                    record = _run_one(system, cfg, np_, plan, tmp, tag)
                    record["repeat"] = repeat
                    runs.append(record)
                    if record["ok"]:
                        _util.log(f"  done in {record['wall_s']:.1f} s")
                    else:
                        _util.log(f"  FAILED: {record['error']}")
    return {
        "op": cfg.op,
        "dtype": "float32",
        "device": cfg.device,
        "busbw_formula": BUSBW_FORMULA[cfg.op],
        "nps": list(cfg.nps),
        "sizes": list(cfg.sizes),
        "iters": {str(s): cfg.iters or default_iters(s) for s in cfg.sizes},
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "systems": systems,
        "notes": notes,
        "runs": runs,
        "summary": summarize(cfg.op, runs, cfg.nps, cfg.sizes, systems),
    }


def summarize(op: str, runs: Sequence[dict[str, Any]], nps: Sequence[int], sizes: Sequence[int],
              systems: Sequence[str]) -> list[dict[str, Any]]:
    """Per (np, size): each system's median latency and bus bandwidth, and ringcomm/gloo ratios."""
    rows = []
    for np_ in nps:
        for nbytes in sizes:
            moved = measured_bytes(op, nbytes, np_)
            row: dict[str, Any] = {"np": np_, "bytes": nbytes, "measured_bytes": moved, "systems": {}}
            for system in systems:
                samples: list[float] = []
                per_run: list[float] = []
                for run_ in runs:
                    if run_["system"] != system or run_["np"] != np_ or not run_["ok"]:
                        continue
                    for res in run_["results"]:
                        if res["bytes"] == nbytes:
                            samples.extend(res["times_s"])
                            per_run.append(_util.median(res["times_s"]))
                if not samples:
                    continue
                med = _util.median(samples)
                busbw = bus_bandwidth(op, moved, np_, med)
                row["systems"][system] = {
                    "median_ms": med * 1e3,
                    "mean_ms": sum(samples) / len(samples) * 1e3,
                    "min_ms": min(samples) * 1e3,
                    "run_median_ms": [t * 1e3 for t in per_run],
                    "samples": len(samples),
                    "busbw_gbps": busbw / 1e9,
                    "algbw_gbps": moved / med / 1e9,
                }
            rc_, gloo = row["systems"].get("ringcomm"), row["systems"].get("gloo")
            enc = row["systems"].get(_launch.ENCRYPTED)
            row["ratio_encrypted_over_plain"] = None if not (rc_ and enc) else {
                "latency": enc["median_ms"] / rc_["median_ms"],
                "mean_latency": enc["mean_ms"] / rc_["mean_ms"],
            }
            row["ratio_ringcomm_over_gloo"] = None if not (rc_ and gloo) else {
                "latency": rc_["median_ms"] / gloo["median_ms"],
                # small-message gloo times are bimodal here (p10 0.35 ms, p90 3.8 ms at 4 KiB, np 2),
                # so the median swings between runs; the mean is what a loop of ops experiences
                "mean_latency": rc_["mean_ms"] / gloo["mean_ms"],
                "busbw": rc_["busbw_gbps"] / gloo["busbw_gbps"] if gloo["busbw_gbps"] else None,
            }
            rows.append(row)
    return rows
