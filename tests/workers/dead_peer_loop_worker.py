"""Ranks loop on one collective until a peer is lost (no launcher needed to stop them).

Usage (torchrun-style environment or ringcomm-run):
    DEAD_PEER_OP=allgather|allreduce|broadcast python dead_peer_loop_worker.py
Prints ``ready`` after a few rounds, then loops; when the runtime reports a
lost peer it prints the error and exits 3 (0 if nothing happened in 60 s).

Faults it can stage itself:
- ``DEAD_PEER_DIE_AFTER_REGISTER=R``: rank R kills itself (SIGKILL) right after the
  rendezvous gave it the peer table, before it connected to anyone;
- SIGUSR1 makes a rank end its program at once with exit code 0 (a rank that finished early).

SIGUSR2 prints every thread's stack (faulthandler), so a test can show where a rank waits.
"""

import faulthandler
import os
import signal
import sys
import time

import numpy as np

import ringcomm as rc
from ringcomm.net import rendezvous

if os.environ.get("DEAD_PEER_DIE_AFTER_REGISTER", "") == os.environ.get("RINGCOMM_RANK", os.environ.get("RANK")):
    _register = rendezvous.register

    def _register_then_die(*args, **kwargs):
        _register(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    rendezvous.register = _register_then_die


def _exit_zero(signum, frame):
    sys.exit(0)


signal.signal(signal.SIGUSR1, _exit_zero)
faulthandler.register(signal.SIGUSR2, all_threads=True)
rc.init()
op = os.environ["DEAD_PEER_OP"]
x = np.full(int(os.environ.get("DEAD_PEER_ELEMS", "250000")), rc.rank() + 1.0, np.float32)


def step() -> None:
    if op == "allgather":
        rc.allgather(x, name="loop")
    elif op == "allreduce":
        rc.allreduce(x, op=rc.Sum, name="loop")
    else:
        rc.broadcast(x, root_rank=0, name="loop")


try:
    for _ in range(3):
        step()
    print("ready", flush=True)
    start = time.monotonic()
    while time.monotonic() - start < 60:
        step()
except rc.HorovodInternalError as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
sys.exit(0)
