"""One of two jobs run side by side on one host: results would show any cross-talk.

Usage: python pair_job_worker.py VALUE ROUNDS
Every rank contributes VALUE + rank in large allreduces (shared memory), small
ones (rank 0) and broadcasts; a message from the other job (another VALUE)
would make a result wrong.  Prints ``pair VALUE ok``.
"""

import sys

import numpy as np

import ringcomm as rc

value, rounds = float(sys.argv[1]), int(sys.argv[2])
rc.init()
r, n = rc.rank(), rc.size()
expect = n * value + n * (n - 1) / 2
for i in range(rounds):
    big = rc.allreduce(np.full(400_000, value + r, np.float64), op=rc.Sum, name="big")
    small = rc.allreduce(np.full(7, value + r, np.float64), op=rc.Sum, name="small")
    root = rc.broadcast(np.full(300_000, value + r, np.float32), i % n, name="bcast")
    assert (big == expect).all() and (small == expect).all(), (i, big[:2], small[:2], expect)
    assert (root == value + i % n).all(), (i, root[:2])
rc.shutdown()
print(f"pair {sys.argv[1]} ok", flush=True)
