"""One job for tests/torch/test_torch_jobs.py: the collective checks, then the training checks.

Sharing one job saves a launcher start-up and a torch import per rank.  Prints
``WORKER OK rank=R`` when every check passed.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_collectives_worker as collectives_worker  # noqa: E402
import torch_training_worker as training_worker  # noqa: E402

import ringcomm_torch as hvd  # noqa: E402

if __name__ == "__main__":
    collectives_worker.run()
    training_worker.run()
    print(f"WORKER OK rank={hvd.rank()}", flush=True)
    hvd.shutdown()
