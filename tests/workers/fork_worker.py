"""A rank forks after init(); the child's collective fails at once with a clear error, the job goes on.

Usage: ringcomm-run -np N python fork_worker.py

The child checks that layout queries still answer, that a collective raises
ForkedProcessError naming the fix within a second, and then exits normally
(so the exit-time shutdown runs in the child and must leave the parent's
sockets alone).  The parent then runs more collectives with the other ranks.
Prints ``FORK OK`` on every rank.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import ringcomm as rc


def child() -> None:
    assert rc.rank() == int(os.environ["RINGCOMM_RANK"]) and rc.size() == int(os.environ["RINGCOMM_SIZE"])
    start = time.monotonic()
    try:
        rc.allreduce(np.ones(4), name="from.child")
    except rc.ForkedProcessError as exc:
        took = time.monotonic() - start
        text = str(exc)
        assert took < 1.0, took
        assert "forked" in text and "spawn" in text and f"rank {rc.rank()}" in text, text
    else:
        raise AssertionError("a collective in a forked child did not fail")
    print(f"CHILD OK {rc.rank()}", flush=True)


def main() -> None:
    rc.init()
    before = rc.allreduce(np.full(3, 1.0), op=rc.Sum, name="before")
    assert before.tolist() == [rc.size()] * 3
    pid = os.fork()
    if pid == 0:
        try:
            child()
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
        sys.exit(0)  # a normal exit: atexit handlers run in the child too
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    for i in range(5):
        got = rc.allreduce(np.full(3, rc.rank() + 1.0), op=rc.Sum, name=f"after.{i}")
        assert got.tolist() == [rc.size() * (rc.size() + 1) / 2] * 3, got
    rc.shutdown()
    print("FORK OK", flush=True)


if __name__ == "__main__":
    main()
