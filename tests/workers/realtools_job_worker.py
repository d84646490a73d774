"""A small ringcomm job for the real-tool tests: one allreduce and one allgather, checked on every rank.

Prints ``RESULT {json}`` (rank, size, source, the sums) on success.  With
``--die-rank R`` rank R kills itself with SIGKILL after the first collectives (a
rank that dies mid-job); the others then wait at the second collective until
the job is stopped or the loss is detected.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import ringcomm as rc
from ringcomm.job import topology


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--die-rank", type=int, default=-1)
    args = ap.parse_args()
    rc.init()
    rank, size = rc.rank(), rc.size()
    total = rc.allreduce(np.full(4, rank + 1.0), op=rc.Sum)
    expected = size * (size + 1) / 2
    assert np.allclose(total, expected), (rank, total, expected)
    gathered = rc.allgather(np.array([rank], dtype=np.int64))
    assert gathered.tolist() == list(range(size)), gathered
    if rank == args.die_rank:
        print(f"rank {rank}: pid {os.getpid()} kills itself with SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if args.die_rank >= 0:
        time.sleep(0.5)
        for step in range(200):  # the dead rank never joins: this fails (peer lost) or the launcher stops us
            rc.allreduce(np.ones(4), name=f"after_death_{step}")
    source = topology.source_of(os.environ)
    where = topology.from_env().rendezvous if source != "ringcomm-run" else os.environ["RINGCOMM_RENDEZVOUS_ADDR"]
    print("RESULT " + json.dumps({"rank": rank, "size": size, "sum": float(total[0]), "source": source,
                                  "local_size": rc.local_size(), "rendezvous": where}), flush=True)
    rc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
