"""init() / shutdown() CYCLES (50) times in one process; prints fds and OS threads after cycle 5 and the last."""

import os
import time

import numpy as np

import ringcomm as rc


def counts(settle_to: tuple[int, int] | None = None) -> tuple[int, int]:
    """Open fds and OS threads.  A joined thread's OS thread can linger for a moment after join()
    returns (more so on a loaded machine): wait up to 2 s for the counts to settle back to
    ``settle_to``; a real leak stays."""
    deadline = time.monotonic() + 2.0
    while True:
        now = len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
        if settle_to is None or all(a <= b for a, b in zip(now, settle_to)) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


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
