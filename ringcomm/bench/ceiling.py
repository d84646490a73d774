"""Hardware-ish ceilings on this machine: one ZeroMQ stream, and a NumPy memory copy.

As in ANCHORS.md: one PUSH->PULL stream between two processes moving 16 MiB
messages (zero-copy send), over ipc and over tcp loopback, alternated
``repeats`` times; and a NumPy 64 MiB array copy in this process.  GB/s are
10^9 bytes per second of payload.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from . import _procs, _timing, _util


@dataclasses.dataclass
class CeilingConfig:
    """Message size and counts of the ZeroMQ stream, and of the copy."""

    message_bytes: int = 16 << 20
    count: int = 100
    warmup: int = 10
    repeats: int = 3
    copy_bytes: int = 64 << 20
    copy_iters: int = 20
    job_timeout: float = 120.0


def _stream(transport: str, cfg: CeilingConfig, tmp: str, tag: str) -> dict[str, Any]:
    addr = f"ipc://{tmp}/{tag}.ipc" if transport == "ipc" else f"tcp://127.0.0.1:{_util.free_port()}"
    out = os.path.join(tmp, f"{tag}.json")
    common = ["--addr", addr, "--bytes", str(cfg.message_bytes), "--warmup", str(cfg.warmup),
              "--count", str(cfg.count), "--deadline", str(_timing.worker_deadline(cfg.job_timeout))]
    module = [sys.executable, "-m", "ringcomm.bench._zmq_peer"]
    job = _procs.run_job([[*module, "pull", *common, "--out", out], [*module, "push", *common]],
                         _util.worker_env(False), cfg.job_timeout)
    if not job.ok:
        return {"transport": transport, "ok": False, "error": job.describe()}
    with open(out, encoding="utf-8") as f:
        return {"transport": transport, "ok": True, **json.load(f)}


def numpy_copy(nbytes: int, iters: int) -> dict[str, Any]:
    """Median time of ``np.copyto`` between two ``nbytes`` arrays; GB/s counts the bytes copied once."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    med = _util.median(times)
    return {"bytes": nbytes, "median_s": med, "gbps": nbytes / med / 1e9, "times_s": times}


def run(cfg: CeilingConfig) -> dict[str, Any]:
    """Measure the ceilings; returns the JSON-ready section."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-") as tmp:
        for repeat in range(cfg.repeats):
            for transport in ("ipc", "tcp"):
                _util.log(f"ceiling: zmq {transport} stream (round {repeat + 1}/{cfg.repeats}) ...")
                record = _stream(transport, cfg, tmp, f"{transport}-{repeat}")
                record["repeat"] = repeat
                if not record["ok"]:
                    _util.log(f"  FAILED: {record['error']}")
                runs.append(record)
    _util.log("ceiling: numpy copy ...")
    summary = {}
    for transport in ("ipc", "tcp"):
        rates = [r["gbps"] for r in runs if r["transport"] == transport and r["ok"]]
        summary[transport] = {"median_gbps": _util.median(rates) if rates else None, "runs_gbps": rates}
    return {
        "message_bytes": cfg.message_bytes,
        "count": cfg.count,
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "zmq_runs": runs,
        "zmq": summary,
        "numpy_copy": numpy_copy(cfg.copy_bytes, cfg.copy_iters),
    }
