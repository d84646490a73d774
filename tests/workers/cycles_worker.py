"""init() / shutdown() CYCLES (50) times in one process; prints fds and OS threads after cycle 5 and the last."""

import os
import time

import numpy as np

import ringcomm as rc


def counts(settle_to: tuple[int, int] | None = None) -> tuple[int, int]:
    """Open fds and OS threads, the fewest seen over 0.3 s (up to 2 s while above ``settle_to``).

    A thread that ``join()`` has returned for can still be listed in /proc for a moment while the OS
    finishes it (more likely on a loaded machine); a leaked one stays.
    """
    seen = []
    short, deadline = time.monotonic() + 0.3, time.monotonic() + 2.0
    while True:
        seen.append((len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))))
        low = min(fds for fds, _ in seen), min(threads for _, threads in seen)
        now = time.monotonic()
        settled = settle_to is None or all(a <= b for a, b in zip(low, settle_to))
        if now > deadline or (now > short and settled):
            return low
        time.sleep(0.01)


CYCLES = int(os.environ.get("CYCLES", "50"))
seen = {}
for cycle in range(1, CYCLES + 1):
    rc.init()
    assert rc.allreduce(np.ones(3), op=rc.Sum, name="x").tolist() == [rc.size()] * 3
    assert rc.allreduce(np.ones(300_000, np.float32), op=rc.Sum, name="big")[0] == rc.size()
    rc.shutdown()
    if cycle in (5, CYCLES):
        seen[cycle] = counts(seen.get(5))
print(f"fds/threads after 5: {seen[5]} after {CYCLES}: {seen[CYCLES]}", flush=True)
assert seen[CYCLES] == seen[5], seen
