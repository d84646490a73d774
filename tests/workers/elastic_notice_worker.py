"""An elastic job that waits, on rank 0, until the driver has noticed a host it added (Horovod's scenario scripts do).

Epoch 0 on rank 0 appends ``--add`` to the discovery file, then polls ``state._host_messages.empty()``
(Horovod's name for the driver's pending notices) until the driver has seen the new host, printing
``NOTICED after=S``; the commit that ends the epoch re-forms the job.  Every worker ends with
``END host=H start_rank=R start_size=N rank=R size=N epochs=E``: where horovodrun's variables
say it started, and where it finished.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import ringcomm as rc
from ringcomm.elastic.state import ObjectState, run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hosts-file", required=True)
    p.add_argument("--add", required=True)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    rc.init()
    state = ObjectState(epoch=0)

    @run
    def train(state: ObjectState) -> None:
        while state.epoch < args.epochs:
            rc.allreduce(np.ones(4), op=rc.Sum)
            if rc.rank() == 0 and state.epoch == 0:
                assert state._host_messages.empty(), "no host change yet, but a notice is pending"
                with open(args.hosts_file, "a") as f:
                    f.write(args.add + "\n")
                start = time.monotonic()
                while state._host_messages.empty():
                    if time.monotonic() - start > 30:
                        raise TimeoutError("the driver did not notice the added host within 30 s")
                    time.sleep(0.05)
                print(f"NOTICED after={time.monotonic() - start:.2f}", flush=True)
            state.epoch += 1
            state.commit()

    train(state)
    env = os.environ
    print(f"END host={env['HOROVOD_HOSTNAME']} start_rank={env['HOROVOD_RANK']} start_size={env['HOROVOD_SIZE']} "
          f"rank={rc.rank()} size={rc.size()} epochs={state.epoch}", flush=True)


if __name__ == "__main__":
    main()
