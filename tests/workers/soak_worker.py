"""Soak: a long seeded stream of mixed collectives; checks results and resource use.

Usage: ringcomm-run -np N python soak_worker.py OPS SEED

Every rank draws the same sequence of ops from ``SEED`` (kind, reduce op,
dtype, size, name), so they all run the same collectives; batches of async
allreduces are submitted in a rank-specific order, as gradient hooks do.
Every result is checked.  After the first 1000 ops and at the end the worker
prints ``RESOURCES <ops> rss_kib=<n> fds=<n> threads=<n>``; the test compares
them.  The first ops visit every kind at its largest size, so buffers that
grow to the largest op seen have grown before the first sample.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

import ringcomm as rc

OPS = [rc.Sum, rc.Min, rc.Max, rc.Average]
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8]
KINDS = ["allreduce", "allreduce", "allreduce", "batch", "allgather", "broadcast", "alltoall", "reducescatter",
         "grouped", "barrier"]
LARGE = 70_000  # elements: a few of these go over the ring and shared memory, not through rank 0


def resources() -> str:
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    fds = len(os.listdir("/proc/self/fd"))
    threads = len(os.listdir("/proc/self/task"))
    return f"rss_kib={rss} fds={fds} threads={threads} py_threads={threading.active_count()}"


def check(got: np.ndarray, value: float, shape: tuple[int, ...], what: str) -> None:
    assert got.shape == shape, f"{what}: shape {got.shape} != {shape}"
    if got.size:
        assert got.flat[0] == value and got.flat[-1] == value and (got.size < 64 or got.flat[got.size // 2] == value), \
            f"{what}: {got.flat[:4]} != {value}"


def one(i: int, rng: np.random.Generator, r: int, n: int) -> None:
    kind = KINDS[i % len(KINDS)] if i < 50 else KINDS[rng.integers(len(KINDS))]
    big = i < 50 or rng.random() < 0.003
    count = LARGE if big else int(rng.integers(0, 600))
    dtype = DTYPES[rng.integers(len(DTYPES))]
    name = None if rng.random() < 0.3 else f"{kind}.{rng.integers(50)}"
    what = f"op {i} {kind} {dtype.__name__} x{count} name={name}"
    if kind == "allreduce":
        op = OPS[rng.integers(len(OPS))]
        got = rc.allreduce(np.full(count, r + 1, dtype), op=op, name=name)
        expect = {rc.Sum: n * (n + 1) // 2, rc.Min: 1, rc.Max: n, rc.Average: (n + 1) / 2}[op]
        if np.issubdtype(dtype, np.integer):
            expect = int(expect)  # integer Average truncates
        if dtype == np.uint8 and op == rc.Sum:
            expect %= 256
        check(got, expect, (count,), what)
    elif kind == "batch":  # named async allreduces, each rank in its own order
        k = int(rng.integers(2, 12))
        sizes = rng.integers(0, 400, k)
        order = np.random.default_rng([i, r]).permutation(k)
        handles = {j: rc.allreduce_async(np.full(sizes[j], float(j + r), np.float32), op=rc.Sum,
                                         name=f"b{i}.{j}") for j in order}
        for j in range(k):
            check(rc.synchronize(handles[j]), float(n * j + n * (n - 1) // 2), (sizes[j],), f"{what} #{j}")
    elif kind == "grouped":
        outs = rc.grouped_allreduce([np.full(count, 1, dtype), np.full(3, 2, dtype)], op=rc.Sum, name=name)
        check(outs[0], n, (count,), what)
        check(outs[1], 2 * n, (3,), what)
    elif kind == "allgather":
        rows = count // 8
        got = rc.allgather(np.full((rows + r, 2), r, dtype), name=name)
        assert got.shape == (n * rows + n * (n - 1) // 2, 2), what
        for k in range(n):
            start = k * rows + k * (k - 1) // 2
            check(got[start:start + rows + k], k, (rows + k, 2), what)
    elif kind == "broadcast":
        root = int(rng.integers(n))
        check(rc.broadcast(np.full(count, r, dtype), root, name=name), root, (count,), what)
    elif kind == "alltoall":
        per = count // (4 * n)
        got, splits = rc.alltoall(np.full((per * n, 2), r, dtype), name=name)
        assert splits.tolist() == [per] * n and got.shape == (per * n, 2), what
        for k in range(n):
            check(got[k * per:(k + 1) * per], k, (per, 2), what)
    elif kind == "reducescatter":
        rows = count // 4
        got = rc.reducescatter(np.full((rows, 2), 1, dtype), op=rc.Sum, name=name)
        mine = rows // n + (1 if r < rows % n else 0)
        check(got, n, (mine, 2), what)
    else:
        rc.barrier()


def main() -> None:
    total, seed = int(sys.argv[1]), int(sys.argv[2])
    rc.init()
    r, n = rc.rank(), rc.size()
    rng = np.random.default_rng(seed)  # the same stream on every rank
    start = time.monotonic()
    for i in range(total):
        one(i, rng, r, n)
        if i + 1 == 1000 or i + 1 == total:
            print(f"RESOURCES {i + 1} {resources()}", flush=True)
    rc.barrier()
    print(f"SOAK OK {total} ops in {time.monotonic() - start:.1f} s", flush=True)
    rc.shutdown()


if __name__ == "__main__":
    main()
