"""``ElasticSampler``: a ``DistributedSampler`` that re-partitions what is left of the epoch after a reset.

Progress is counted as Horovod's sampler counts it: ``processed_num`` samples of the
epoch's order are done, and ``record_batch(i, batch_size)`` adds one batch on every rank
(``batch_size * num_replicas``), as ranks step together.  What each rank sees
(10 samples, ``shuffle=False``)::

    sampler = ElasticSampler(dataset)             # size 2:  rank 0: [0, 2, 4, 6, 8]   rank 1: [1, 3, 5, 7, 9]
    sampler.record_batch(0, batch_size=2)         # processed_num == 4: samples 0..3 are done
    state.commit()
    # a worker joins; after the reset (size 3), the 6 remaining samples are split anew:
    #                                               rank 0: [4, 7]   rank 1: [5, 8]   rank 2: [6, 9]

Ranks that progress unevenly can name what they did instead: ``record_indices(idx)``
marks dataset indices done; every commit gathers every rank's, and the next reset
leaves them out too.  Put the sampler in a ``TorchState``, record after each batch,
and call ``set_epoch`` at the *end* of each epoch (it clears the progress).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import torch

import ringcomm as _rc

__all__ = ["ElasticSampler", "partition_indices"]


def partition_indices(indices: Sequence[int], rank: int, num_replicas: int) -> list[int]:
    """Rank ``rank``'s share of ``indices``: every ``num_replicas``-th, after padding to a multiple.

    Every rank gets ``ceil(len(indices) / num_replicas)`` indices; the padding
    repeats indices from the start (as ``DistributedSampler`` does).

        >>> partition_indices([5, 6, 7, 8, 9], rank=1, num_replicas=2)
        [6, 8, 5]
    """
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is out of range for {num_replicas} replicas")
    if not indices:
        return []
    per_rank = math.ceil(len(indices) / num_replicas)
    total = per_rank * num_replicas
    padded = list(indices)
    while len(padded) < total:
        padded += list(indices[: total - len(padded)])
    return padded[rank:total:num_replicas]


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions ``dataset`` over the ranks; after a reset, only the unprocessed samples are partitioned.

    ``shuffle`` uses one permutation per epoch (``seed + epoch``), the same on
    every rank and across resets.  ``state_dict()`` holds ``epoch``, ``processed_num``
    and ``processed_indices``.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: no progress, a new permutation.  Call it at an epoch's *end*."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The indices of batch ``batch_idx`` (counted from the start of this rank's current partition)."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """One batch of ``batch_size`` done on every rank: ``processed_num += batch_size * num_replicas``."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark dataset ``indices`` as processed (not handed out again this epoch, after the next reset)."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take ``epoch``, ``processed_num`` (and ``processed_indices``), and re-partition for the current world."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict.get("processed_num", 0))
        self.processed_indices = set(state_dict.get("processed_indices", ()))
        self.reset()

    def reset(self, rank: int | None = None, num_replicas: int | None = None) -> None:
        """Re-partition the unprocessed samples over the current world (or the given ``rank``/``num_replicas``)."""
        if num_replicas is None:
            num_replicas = _rc.size() if _rc.is_initialized() else 1
        if rank is None:
            rank = _rc.rank() if _rc.is_initialized() else 0
        self.num_replicas, self.rank = num_replicas, rank
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        done = self.processed_indices
        self.remaining_indices = [i for i in order[self.processed_num:] if i not in done]
        self.num_samples = math.ceil(len(self.remaining_indices) / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.indices = partition_indices(self.remaining_indices, rank, num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples
