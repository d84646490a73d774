"""Each rank publishes its listening tcp endpoints, then runs checked allreduces while the test sends garbage.

Usage: garbage_target_worker.py DIR COUNT [STOP_FILE]
Runs COUNT allreduces; with STOP_FILE, then keeps going in batches of 100 until that file exists
(rank 0 decides and tells the others, so every rank runs the same ops).
"""

import json
import logging
import os
import sys

import numpy as np

import ringcomm as rc

logging.basicConfig(format="%(name)s %(levelname)s %(message)s")  # RINGCOMM_LOG_LEVEL=DEBUG shows refusals
rc.init()
engine = rc.runtime.active().engine
table = engine.peer_table[rc.rank()]
tcp = [eps[1] for eps in table["data"] if eps] + [table["ctrl"][1]] if rc.rank() == 0 else \
      [eps[1] for eps in table["data"] if eps]
with open(os.path.join(sys.argv[1], f"ports-{rc.rank()}.json"), "w") as f:
    json.dump(tcp, f)
rc.barrier()
stop_file = sys.argv[3] if len(sys.argv) > 3 else None
# a fixed count on every rank (a per-rank deadline would let ranks run different numbers of ops)
n = 0
batch = int(sys.argv[2])
while True:
    for _ in range(batch):
        n += 1
        got = rc.allreduce(np.full(70_000, rc.rank() + 1.0), op=rc.Sum, name="checked")
        assert (got == rc.size() * (rc.size() + 1) / 2).all()
    stop = np.array([stop_file is None or os.path.exists(stop_file)], dtype=np.uint8)
    if rc.broadcast(stop, 0, name="stop?")[0]:
        break
    batch = 100
rc.barrier()
print(f"rank {rc.rank()} ok after {n} allreduces", flush=True)
rc.shutdown()
