"""Rank STOP_RANK stops itself (SIGSTOP) after one allreduce; the others catch the PeerLostError that names
it and exit 0, so only ringcomm-run can end the stopped process."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import ringcomm as rc

rc.init()
rank = rc.rank()
rc.allreduce(np.ones(4), name="first")
if rank == int(os.environ.get("STOP_RANK", "1")):
    print(f"STOPPING at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
try:
    rc.allreduce(np.ones(4), name="second")
    print(f"rank {rank}: the allreduce passed", flush=True)
except rc.PeerLostError as exc:
    print(f"CAUGHT rank={rank} lost={exc.lost_rank} at {time.time():.3f}", flush=True)
sys.exit(int(os.environ.get("SURVIVOR_EXIT", "0")))
