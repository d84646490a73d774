"""A NumPy elastic job for the multi-host elastic tests: a vector grows by the average of every rank's step.

Every step adds ``step + 1`` to each element of ``state.w`` through an
``Average`` allreduce, so after ``--steps`` steps every element is
``steps * (steps + 1) / 2`` whatever the job's size was along the way.

Prints (worker id = ``RINGCOMM_ELASTIC_WORKER``, host = ``RINGCOMM_HOSTNAME``):

- ``PID worker=W host=H pid=P`` once at start;
- ``ENTER worker=W host=H rank=R size=N step=S hash=X`` each time ``train`` is (re-)entered, i.e. with the
  state just synced from rank 0;
- ``COMMIT worker=W host=H rank=R size=N step=S hash=X`` after each commit's save;
- ``DONE worker=W host=H rank=R size=N step=S value=V``.

``--die-on-host H``: a worker on host H exits with code 3 before ``init()`` (it never reaches the rendezvous).

``--grow-line LINE --grow-step S --hosts-file F``: rank 0 appends LINE to F once it reached step S (the
discovery script prints F), so the job grows while it runs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import numpy as np

import ringcomm as rc
from ringcomm.elastic.state import ObjectState, run


def digest(w: np.ndarray, step: int) -> str:
    return hashlib.sha256(w.tobytes() + str(step).encode()).hexdigest()[:12]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sleep", type=float, default=0.1)
    p.add_argument("--grow-line", default="")
    p.add_argument("--grow-step", type=int, default=-1)
    p.add_argument("--hosts-file", default="")
    p.add_argument("--die-on-host", default="")
    args = p.parse_args()
    me = f"worker={os.environ['RINGCOMM_ELASTIC_WORKER']} host={os.environ['RINGCOMM_HOSTNAME']}"
    print(f"PID {me} pid={os.getpid()}", flush=True)
    if os.environ["RINGCOMM_HOSTNAME"] == args.die_on_host:
        sys.exit(3)
    rc.init()
    state = ObjectState(step=0, w=np.zeros(16))

    @run
    def train(state: ObjectState) -> None:
        print(f"ENTER {me} rank={rc.rank()} size={rc.size()} step={state.step} hash={digest(state.w, state.step)}",
              flush=True)
        while state.step < args.steps:
            state.w = state.w + rc.allreduce(np.full(16, state.step + 1.0), op=rc.Average)
            state.step += 1
            if rc.rank() == 0 and state.step == args.grow_step and args.grow_line:
                with open(args.hosts_file, "a", encoding="utf-8") as f:
                    f.write(args.grow_line + "\n")
            state.save()
            print(f"COMMIT {me} rank={rc.rank()} size={rc.size()} step={state.step} "
                  f"hash={digest(state.w, state.step)}", flush=True)
            state.check_host_updates()
            time.sleep(args.sleep)

    train(state)
    print(f"DONE {me} rank={rc.rank()} size={rc.size()} step={state.step} value={state.w[0]:g}", flush=True)


if __name__ == "__main__":
    main()
