"""init() / shutdown() CYCLES (50) times in one process; prints fds and OS threads after cycle 5 and the last."""

import os
import time

import numpy as np

import ringcomm as rc


def counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


CYCLES = int(os.environ.get("CYCLES", "50"))
seen = {}
for cycle in range(1, CYCLES + 1):
    rc.init()
    assert rc.allreduce(np.ones(3), op=rc.Sum, name="x").tolist() == [rc.size()] * 3
    assert rc.allreduce(np.ones(300_000, np.float32), op=rc.Sum, name="big")[0] == rc.size()
    rc.shutdown()
    if cycle in (5, CYCLES):
        # Thread.join() returns before the OS thread has quite finished exiting: give a loaded
        # machine a moment before counting (a leaked thread or fd stays and still fails the check)
        deadline = time.monotonic() + 3.0
        while cycle == CYCLES and counts() != seen[5] and time.monotonic() < deadline:
            time.sleep(0.05)
        seen[cycle] = counts()
print(f"fds/threads after 5: {seen[5]} after {CYCLES}: {seen[CYCLES]}", flush=True)
assert seen[CYCLES] == seen[5], seen
