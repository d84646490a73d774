"""A NumPy elastic job: ObjectState + run; the worker on host --fail-host raises after its first allreduce,
those that started as ranks --fail-start-ranks (horovodrun's HOROVOD_RANK) raise at step 3, and the
worker on host --freeze-host stops its own process (SIGSTOP) at step 3, as a wedged machine would.

Prints ``STEP rank=R size=N step=S`` and ``DONE rank=R size=N step=S``.
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
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fail-host", default="")
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--fail-start-ranks", type=int, nargs="*", default=[])
    p.add_argument("--freeze-host", default="")
    args = p.parse_args()
    rc.init()
    state = ObjectState(step=0, total=0.0)

    @run
    def train(state: ObjectState) -> None:
        while state.step < args.steps:
            state.total += float(rc.allreduce(np.array([1.0]), op=rc.Sum)[0])
            state.step += 1
            print(f"STEP rank={rc.rank()} size={rc.size()} step={state.step}", flush=True)
            if os.environ.get("RINGCOMM_HOSTNAME") == args.fail_host:
                raise RuntimeError(f"worker on {args.fail_host} fails on purpose")
            if state.step == 3 and int(os.environ["HOROVOD_RANK"]) in args.fail_start_ranks:
                raise RuntimeError(f"the worker that started as rank {os.environ['HOROVOD_RANK']} fails on purpose")
            if state.step == 3 and os.environ.get("RINGCOMM_HOSTNAME") == args.freeze_host:
                print(f"FREEZE rank={rc.rank()} pid={os.getpid()}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            state.commit()
            time.sleep(args.sleep)

    train(state)
    print(f"DONE rank={rc.rank()} size={rc.size()} step={state.step}", flush=True)


if __name__ == "__main__":
    main()
