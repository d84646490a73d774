"""Functions that tests run on several ranks through ``ringcomm.run``."""

from __future__ import annotations

import os

import numpy as np


def rank_sum(scale, offset=0):
    """Every rank's (rank, size, sum of all ranks' values) after a real allreduce."""
    import ringcomm as rc

    rc.init()
    try:
        total = rc.allreduce(np.array([float(rc.rank() * scale)]), op=rc.Sum, name="rank_sum")
        return rc.rank(), rc.size(), float(total[0]) + offset
    finally:
        rc.shutdown()


def fails_on(bad_rank):
    """Raises on ``bad_rank`` only."""
    rank = int(os.environ["RINGCOMM_RANK"])
    if rank == bad_rank:
        raise KeyError(f"no such key on rank {rank}")
    return rank


def returns_unpicklable():
    return lambda: None


def settings_seen():
    """The settings a rank's init() would read (flags of ringcomm.run reach them through the environment)."""
    from ringcomm.job.config import Settings

    return Settings.from_env().start_timeout
