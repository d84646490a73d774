"""Async collectives of mixed sizes, posted in each rank's own order, then synchronized: no iteration
may wait for a timer when every rank's data is there.

Usage: ringcomm-run -np N python wakeup_worker.py ITERATIONS
Each iteration posts seven allreduces (a few floats up to 300k floats, the order shuffled per rank) with
a grouped allreduce of two small int64 arrays among them, a large op right before a tiny one, then
synchronizes every handle and checks the sums.  Prints ``wakeups ok max_ms=<slowest iteration>``.
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np

import ringcomm as rc

SIZES = (3, 5, 1000, 9000, 16000, 100_000, 300_000)


def main() -> None:
    iterations = int(sys.argv[1])
    rc.init()
    r, n = rc.rank(), rc.size()
    rng = random.Random(r * 7919 + 1)
    slowest = 0.0
    for it in range(iterations):
        ops = [(f"w{it}.{j}", size) for j, size in enumerate(SIZES)]
        rng.shuffle(ops)
        start = time.perf_counter()
        handles = [(size, rc.allreduce_async(np.full(size, r + 1, np.float32), op=rc.Sum, name=name))
                   for name, size in ops[:4]]
        group = rc.grouped_allreduce_async([np.full(4, r, np.int64), np.full(7, 2 * r, np.int64)], op=rc.Sum,
                                           name=f"w{it}.g")
        handles += [(size, rc.allreduce_async(np.full(size, r + 1, np.float32), op=rc.Sum, name=name))
                    for name, size in ops[4:]]
        got = [(size, rc.synchronize(h)) for size, h in handles]
        small = rc.synchronize(group)
        slowest = max(slowest, time.perf_counter() - start)
        total = n * (n + 1) / 2
        for size, arr in got:
            assert arr.shape == (size,) and (arr == total).all(), (it, size, arr[:3])
        assert (small[0] == n * (n - 1) // 2).all() and (small[1] == n * (n - 1)).all(), (it, small)
    print(f"wakeups ok max_ms={slowest * 1000:.0f}", flush=True)
    rc.shutdown()


if __name__ == "__main__":
    main()
