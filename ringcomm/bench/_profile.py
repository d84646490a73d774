"""A few training steps under ``torch.profiler``, summed up: where the host waits for the device.

Used by ``_train_worker --profile PATH`` (rank 0 only): after the timed steps it runs
:data:`STEPS` more under the profiler and writes ``PATH`` (a JSON summary) and
``PATH.trace.json`` (the Chrome trace).  The summary counts, per thread, the calls that make
the host wait for the device (stream, event and device synchronizes) and the copies, and gives
how busy the device was over the profiled span: the figures that tell whether a hook or
``step()`` waited for the GPU.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable
from typing import Any

import torch

#: Profiled steps (after the timed ones: warm caches, steady buckets).
STEPS = 3
#: Host calls that block until the device (or a stream, or an event) has caught up.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent")
#: Host calls and device activities that move data.
COPIES = ("cudaMemcpyAsync", "cudaMemcpy", "Memcpy DtoH", "Memcpy HtoD", "Memcpy DtoD")


def profile_steps(step: Callable[[], None], settle: Callable[[], None], cuda: bool, path: str) -> dict[str, Any]:
    """Run ``step()`` :data:`STEPS` times under the profiler; write the summary to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    settle()
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            step()
        settle()
    prof.export_chrome_trace(path + ".trace.json")
    summary = summarize(prof.events(), STEPS)
    summary["top_host"] = top_ops(prof.key_averages(), "self_cpu_time_total")
    if cuda:
        summary["top_device"] = top_ops(prof.key_averages(), "self_device_time_total")
    summary["main_thread"] = threading.get_native_id()  # step() runs here; the hooks on autograd's threads
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return summary


def top_ops(averages: Any, key: str, limit: int = 15) -> list[dict[str, Any]]:
    """The ``limit`` ops of a ``key_averages()`` with the most ``key`` time: name, calls, self and total us."""
    def value(row: Any, attr: str) -> float:
        alt = attr.replace("device", "cuda")  # older releases name the device time after CUDA
        return float(getattr(row, attr, getattr(row, alt, 0.0)) or 0.0)

    rows = sorted(averages, key=lambda row: value(row, key), reverse=True)[:limit]
    return [{"name": row.key, "calls": int(row.count), "self_us": round(value(row, key), 1),
             "total_us": round(value(row, key.replace("self_", "")), 1)} for row in rows]


def summarize(events: Any, steps: int) -> dict[str, Any]:
    """Counts per thread of the waiting and copying calls, and the device's busy share of the span."""
    per_thread: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    device_us = 0.0
    start, end = float("inf"), 0.0
    for ev in events:
        name = ev.name
        t0 = float(ev.time_range.start)
        t1 = float(ev.time_range.end)
        start, end = min(start, t0), max(end, t1)
        on_device = str(getattr(ev, "device_type", "")).endswith("CUDA")
        if on_device:
            device_us += t1 - t0
        if any(name.startswith(w) for w in WAITS + COPIES):
            per_thread[int(getattr(ev, "thread", 0))][name] += 1
    span = max(0.0, end - start) if end > 0 else 0.0
    return {
        "steps": steps,
        "span_us": span,
        "device_busy_us": device_us,
        "device_busy_share": device_us / span if span else 0.0,
        "threads": {str(t): dict(c) for t, c in sorted(per_thread.items())},
        "waits_per_step": sum(c[w] for c in per_thread.values() for w in c if w.startswith(WAITS)) / steps,
        "copies_per_step": sum(c[w] for c in per_thread.values() for w in c if w.startswith(COPIES)) / steps,
        "torch": torch.__version__,
    }
