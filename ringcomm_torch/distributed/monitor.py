"""``monitored_barrier`` for the ``"ringcomm"`` backend: a barrier through torch's store that names absent ranks.

Every rank announces its arrival under a key of barrier number ``n``; rank 0 waits for all
of them up to ``timeout`` seconds, then publishes the verdict: ``ok``, or the ranks that did
not arrive.  Rank 0 raises naming them (with ``wait_all_ranks``, all of them; else the first),
and so does every rank that arrived, once it reads the verdict.  torch's own
``monitored_barrier`` (gloo only) is routed here for ringcomm groups.

The pure part, :func:`verdict`, decides the message from the ranks that arrived.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["monitored_barrier", "verdict"]

_POLL = 0.01


def verdict(arrived: Sequence[int], size: int, timeout: float, wait_all_ranks: bool) -> str:
    """``"ok"``, or the error naming the ranks missing from ``arrived`` (pure).

    >>> verdict([0, 2], 4, 5.0, False)
    'monitored_barrier: rank 1 did not arrive within 5 s (ringcomm backend)'
    >>> verdict([0], 3, 1.0, True)
    'monitored_barrier: ranks [1, 2] did not arrive within 1 s (ringcomm backend)'
    """
    missing = [r for r in range(size) if r not in set(arrived)]
    if not missing:
        return "ok"
    if wait_all_ranks:
        who = f"ranks {missing}" if len(missing) > 1 else f"rank {missing[0]}"
    else:
        who = f"rank {missing[0]}"
    return f"monitored_barrier: {who} did not arrive within {timeout:g} s (ringcomm backend)"


def monitored_barrier(store: Any, tag: str, n: int, rank: int, size: int, timeout: float,
                      wait_all_ranks: bool) -> None:
    """Run barrier number ``n`` of group ``tag``; raises ``DistBackendError`` naming absent ranks."""
    if store is None:
        raise dist.DistBackendError("monitored_barrier: this ringcomm group has no store to run it on")
    prefix = f"ringcomm/mb/{tag}/{n}/"
    store.set(f"{prefix}{rank}", "1")
    deadline = time.monotonic() + timeout
    if rank == 0:
        keys = [f"{prefix}{r}" for r in range(size)]
        arrived: list[int] = []
        while True:
            arrived = [r for r, k in enumerate(keys) if store.check([k])]
            if len(arrived) == size or time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
        result = verdict(arrived, size, timeout, wait_all_ranks)
        store.set(f"{prefix}verdict", result)
    else:
        key = f"{prefix}verdict"
        try:  # a little longer than rank 0 waits, so its verdict is read rather than missed
            store.wait([key], datetime.timedelta(seconds=timeout + 10.0))
        except Exception as exc:
            raise dist.DistBackendError(
                f"monitored_barrier on rank {rank}: rank 0 gave no verdict within {timeout + 10.0:g} s ({exc}); "
                "rank 0 may have failed") from exc
        result = store.get(key).decode()
    if result != "ok":
        raise dist.DistBackendError(f"{result}; seen from rank {rank}")
