"""An elastic NumPy job for fault injection: loops on one collective, commits every step.

Usage: ringcomm-run --host-discovery-script ... python elastic_fault_worker.py --op allreduce
    --kill-rank R --marker PATH   the worker holding rank R (generation 0) kills itself (SIGKILL)
                                  at step 5, after printing ``KILLED at=<time.time()>``
    --mismatch-rank R             rank R passes an array of another shape at step 3 (a program's
                                  own error: the job must end with it, never re-form)
    --refuse-rank R               rank R passes a non-contiguous array at step 3 (refused call)
Prints ``STEP rank= size= step= at=<time.time()>`` after every step, ``DONE ...`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import numpy as np

import ringcomm as rc
from ringcomm.elastic.state import ObjectState, run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="allreduce")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--marker", default="")
    p.add_argument("--mismatch-rank", type=int, default=-1)
    p.add_argument("--refuse-rank", type=int, default=-1)
    p.add_argument("--sleep", type=float, default=0.05)
    args = p.parse_args()
    rc.init()
    state = ObjectState(step=0)

    @run
    def train(state: ObjectState) -> None:
        while state.step < args.steps:
            r = rc.rank()
            if r == args.kill_rank and state.step == 5 and args.marker and not os.path.exists(args.marker):
                open(args.marker, "w").close()
                print(f"KILLED rank={r} at={time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x = np.full(50_000, r + 1.0, np.float32)
            if state.step == 3 and r == args.mismatch_rank:
                x = np.ones(7, np.float32)
            if state.step == 3 and r == args.refuse_rank:
                x = np.ones((40, 30), np.float32).T
            if args.op == "allgather":
                rc.allgather(x, name="loop")
            elif args.op == "broadcast":
                rc.broadcast(x, root_rank=0, name="loop")
            else:
                rc.allreduce(x, op=rc.Sum, name="loop")
            state.step += 1
            print(f"STEP rank={r} size={rc.size()} step={state.step} at={time.time():.3f}", flush=True)
            state.commit()
            time.sleep(args.sleep)

    train(state)
    print(f"DONE rank={rc.rank()} size={rc.size()} step={state.step}", flush=True)


if __name__ == "__main__":
    main()
