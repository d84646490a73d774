"""Initialise, report whether this rank runs the small-op lane, run a few small allreduces, shut down.

Prints ``lane=<on|off> ok``.  Run it without a launcher, torchrun-style (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); rank 0 hosts the rendezvous.
"""

from __future__ import annotations

import numpy as np

import ringcomm as rc
from ringcomm import runtime


def main() -> None:
    rc.init()
    lane = runtime.current("lane").dispatcher.lane is not None
    for i in range(20):
        got = rc.allreduce(np.full(4, rc.rank() + 1.0), op=rc.Sum, name=f"p{i}")
        assert (got == rc.size() * (rc.size() + 1) / 2).all(), got
    print(f"lane={'on' if lane else 'off'} ok", flush=True)
    rc.shutdown()


if __name__ == "__main__":
    main()
