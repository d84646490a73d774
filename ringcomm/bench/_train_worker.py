"""Training-step benchmark worker: a small CNN on synthetic 32x32x3 images, one thread per rank.

Modes: ``single`` (one process, no communication), ``ddp`` (torch DDP over
gloo; needs ``--rank/--world-size/--port``), ``ringcomm``
(``ringcomm_torch.DistributedOptimizer``; start it with the ringcomm
launcher), ``lockstep`` (ringcomm launcher, a plain optimizer and one
1-element allreduce per step: the ranks keep in step but exchange no
gradients -- what synchronization alone costs) and ``horovod``
(``horovod.torch.DistributedOptimizer``, under horovodrun).  Several
``single`` processes started together (no communication at all) are the
bound no data-parallel setup can beat on a shared machine.  Rank 0 writes ``{"images", "seconds", "img_per_s", ...}`` to
``--out``; the time of the timed steps is the slowest rank's.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._timing import start_watchdog

#: Exit status when ringcomm_torch (or Horovod) or its DistributedOptimizer is not there.
EXIT_NO_RINGCOMM_TORCH = 3


class SmallCNN(nn.Module):
    """conv(3->32) - pool - conv(32->64) - pool - fc(4096->128) - fc(128->10): ~545k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


class _Lockstep:
    """A local optimizer whose ``step`` first meets the other ranks (a 1-element allreduce)."""

    def __init__(self, optimizer: torch.optim.Optimizer, hvd: Any) -> None:
        self._opt, self._hvd, self._token = optimizer, hvd, torch.zeros(1)

    def zero_grad(self) -> None:
        self._opt.zero_grad()

    def step(self) -> None:
        self._hvd.allreduce_(self._token, name="bench.lockstep")
        self._opt.step()


def _setup(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer
           ) -> tuple[nn.Module, Any, int, int, Callable[[], None], Callable[[Any], list[Any]]]:
    """Wrap model/optimizer for ``args.mode``; returns them with rank, size, barrier and gather-to-all.

    The optimizer returned has ``zero_grad()`` and ``step()``.
    """
    if args.mode == "single":
        return model, optimizer, 0, 1, lambda: None, lambda obj: [obj]
    if args.mode == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world_size, timeout=datetime.timedelta(seconds=args.deadline))

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out

        return (DistributedDataParallel(model), optimizer, dist.get_rank(), dist.get_world_size(), dist.barrier,
                gather)
    module = "horovod.torch" if args.mode == "horovod" else "ringcomm_torch"
    try:
        hvd = importlib.import_module(module)
        dist_opt_cls = hvd.DistributedOptimizer
    except (ImportError, AttributeError) as exc:
        print(f"{module}.DistributedOptimizer unavailable: {exc}", file=sys.stderr)
        sys.exit(EXIT_NO_RINGCOMM_TORCH)
    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    token = torch.zeros(1)
    if args.mode == "lockstep":
        return model, _Lockstep(optimizer, hvd), hvd.rank(), hvd.size(), lambda: hvd.barrier(), hvd.allgather_object
    dist_opt = dist_opt_cls(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(dist_opt, root_rank=0)

    def barrier() -> None:
        if hasattr(hvd, "barrier"):
            hvd.barrier()
        else:  # old Horovod releases
            hvd.allreduce(token, name="bench.barrier")

    return model, dist_opt, hvd.rank(), hvd.size(), barrier, lambda obj: hvd.allgather_object(obj)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench._train_worker", description=__doc__)
    parser.add_argument("--mode", choices=("single", "ddp", "ringcomm", "lockstep", "horovod"), required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=600.0)
    args = parser.parse_args(argv)
    start_watchdog(args.deadline)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model: nn.Module = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer, rank, size, barrier, gather = _setup(args, model, optimizer)
    gen = torch.Generator().manual_seed(1000 + rank)
    images = torch.randn(args.batch, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (args.batch,), generator=gen)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - t0
    all_seconds = gather(seconds)
    if rank == 0:
        slowest = max(all_seconds)
        images_done = size * args.batch * args.steps
        result = {"mode": args.mode, "np": size, "batch_per_rank": args.batch, "steps": args.steps,
                  "warmup": args.warmup, "seconds": slowest, "rank_seconds": all_seconds,
                  "images": images_done, "img_per_s": images_done / slowest}
        with open(args.out + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f)
        os.replace(args.out + ".tmp", args.out)
    barrier()
    if args.mode == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()
    elif args.mode in ("ringcomm", "lockstep", "horovod"):
        importlib.import_module("horovod.torch" if args.mode == "horovod" else "ringcomm_torch").shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
