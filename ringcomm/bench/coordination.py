"""Rank 0's coordination work per op as the job grows, simulated with the pure core.

No processes and no sockets: for each job size the simulation plays rank 0's
part for ``ops`` steps of ``tensors`` allreduces.  The first step every rank
sends full requests (the response cache is empty); the following steps every
rank sends response-cache ids, which rank 0 expands with its own copy of the
cache, as in a training loop.  Rank 0's work per request is timed for both
(requests in, ordered fused responses out, cache recording); the bytes rank 0
takes in for one op on the small-op path come from the settings' rule.

    python -m ringcomm.bench coordination --ranks 64 256 1024 4096
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..core import routing, wire
from ..core.cache import ResponseCache
from ..job.config import Settings
from ..core.controller import Controller
from ..core.wire import Request


def _step(ctrl: Controller, cache: ResponseCache, size: int, reqs: list[Request], ids: list[int] | None) -> int:
    """Rank 0's part of one step: every rank's requests in, responses out and cached; responses sent."""
    sent = 0
    for rank in range(size):
        for i, req in enumerate(reqs):
            ctrl.submit(rank, cache.get(ids[i]) if ids is not None else req)
    for resp, _members in ctrl.take_responses():
        for name in resp.names:
            cache.record(reqs[int(name[1:])])
        sent += 1
    return sent


def simulate(size: int, tensors: int = 20, ops: int = 5, rounds: int = 3) -> dict[str, Any]:
    """Best-of-``rounds`` microseconds per request for a job of ``size`` ranks, cold and cached."""
    reqs = [Request(f"g{i}", wire.ALLREDUCE, "float32", ((256, 1024),), 1) for i in range(tensors)]
    cold, warm = float("inf"), float("inf")
    for _ in range(rounds):
        ctrl = Controller(size, 64 << 20)
        cache = ResponseCache(1024)
        t0 = time.perf_counter()
        responses = _step(ctrl, cache, size, reqs, None)
        cold = min(cold, (time.perf_counter() - t0) / (size * tensors))
        ids = [cache.lookup(r) for r in reqs]
        if responses < 1 or any(i is None for i in ids):
            raise RuntimeError(f"the simulation of {size} ranks produced no cached responses")
        t0 = time.perf_counter()
        for _ in range(ops):
            _step(ctrl, cache, size, reqs, [int(i) for i in ids if i is not None])
        warm = min(warm, (time.perf_counter() - t0) / (size * tensors * ops))
    small = routing.limits_for(Settings(), size).small_bytes  # the bound the engine uses
    return {"ranks": size, "cold_us_per_request": cold * 1e6, "cached_us_per_request": warm * 1e6,
            "small_op_bound_bytes": small, "rank0_small_op_bytes_in": small * size}


def run(ranks: Sequence[int], tensors: int = 20, ops: int = 5) -> list[dict[str, Any]]:
    return [simulate(n, tensors, ops) for n in ranks]


def format_table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = ["| ranks | us/request (full) | us/request (cached) | vs smallest job | small-op bound | rank 0 takes in per small op |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["cached_us_per_request"] / base["cached_us_per_request"]
        lines.append(f"| {r['ranks']} | {r['cold_us_per_request']:.2f} | {r['cached_us_per_request']:.2f} | "
                     f"{ratio:.2f}x | {r['small_op_bound_bytes']} B | {r['rank0_small_op_bytes_in'] / 1024:.0f} KiB |")
    return "\n".join(lines)
