"""Training-step benchmark worker: a small CNN on synthetic 32x32x3 images, one thread per rank.

Modes: ``single`` (one process, no communication), ``ddp`` (torch DDP over
gloo; needs ``--rank/--world-size/--port``), ``ddp_ringcomm`` (the same DDP on the
``"ringcomm"`` torch.distributed backend), ``fsdp`` and ``fsdp_ringcomm`` (FSDP2 instead of
DDP, each top-level child of the model a unit), ``ringcomm``
(``ringcomm_torch.DistributedOptimizer``; start it with the ringcomm
launcher), ``lockstep`` (ringcomm launcher, a plain optimizer and one
1-element allreduce per step: the ranks keep in step but exchange no
gradients -- what synchronization alone costs) and ``horovod``
(``horovod.torch.DistributedOptimizer``, under horovodrun).  Several
``single`` processes started together (no communication at all) are the
bound no data-parallel setup can beat on a shared machine.  ``--device cuda`` puts the
model and the batches on the GPU (every rank on ``cuda:local_rank % device_count``), and
``--model resnet18`` trains torchvision's resnet18 on 3x64x64 images (a built-in net of the
same parameter shapes when torchvision does not import).  Rank 0 writes ``{"images", "seconds", "img_per_s", ...}`` to
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

from . import _util
from ._timing import exit_now, start_watchdog

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


class _Block(nn.Module):
    """resnet18's basic block: two 3x3 convolutions with batch norm, and a 1x1 shortcut when needed."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18Shape(nn.Module):
    """The parameter shapes of torchvision's resnet18 (62 tensors, 11.7 M floats), for machines
    without torchvision."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = F.adaptive_avg_pool2d(self.blocks(x), 1)
        return self.fc(torch.flatten(x, 1))


class ExchangeOnly(nn.Module):
    """resnet18's parameters (62 tensors, 47 MB of fp32 gradients) and next to no arithmetic: every
    parameter gets a whole gradient, in reverse order as in a real backward, but computing them
    costs little, so a step costs about what exchanging them costs.  A CPU stand-in for training
    on a GPU, where the compute is fast and the exchange is what a step waits for."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.body = ResNet18Shape(classes)
        self.classes = classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        touch = sum(p.reshape(-1)[:1].sum() for p in self.body.parameters())
        return (x.flatten(1)[:, :1] * touch).expand(-1, self.classes)


def build_model(name: str) -> tuple[nn.Module, tuple[int, ...], int]:
    """The model, one image's shape and the number of classes."""
    if name == "small":
        return SmallCNN(), (3, 32, 32), 10
    if name == "exchange":
        return ExchangeOnly(), (3, 8, 8), 1000
    try:
        import torchvision  # type: ignore[import-not-found,unused-ignore]

        return torchvision.models.resnet18(), (3, 64, 64), 1000
    except Exception:  # noqa: BLE001 - torchvision missing or broken: the same shapes, built here
        return ResNet18Shape(), (3, 64, 64), 1000


class _Lockstep:
    """A local optimizer whose ``step`` first meets the other ranks (a 1-element allreduce)."""

    def __init__(self, optimizer: torch.optim.Optimizer, hvd: Any) -> None:
        self._opt, self._hvd, self._token = optimizer, hvd, torch.zeros(1)

    def zero_grad(self) -> None:
        self._opt.zero_grad()

    def step(self) -> None:
        self._hvd.allreduce_(self._token, name="bench.lockstep")
        self._opt.step()


#: The modes that run on torch.distributed (``--rank/--world-size/--port``), on gloo or ``*_ringcomm``.
TORCH_DISTRIBUTED = ("ddp", "ddp_ringcomm", "fsdp", "fsdp_ringcomm")


def _fully_sharded(model: nn.Module, device_type: str, world: int) -> nn.Module:
    """``model`` under FSDP2 over every rank: each top-level child with parameters a unit of its own
    (its parameters gathered before its forward and freed after), then the rest.  ExchangeOnly reads
    its body's parameters in its own forward: it is one unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (world,))
    for child in () if isinstance(model, ExchangeOnly) else model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _setup(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer
           ) -> tuple[nn.Module, Any, int, int, Callable[[], None], Callable[[Any], list[Any]]]:
    """Wrap model/optimizer for ``args.mode``; returns them with rank, size, barrier and gather-to-all.

    The optimizer returned has ``zero_grad()`` and ``step()``.
    """
    if args.mode == "single":
        return model, optimizer, 0, 1, lambda: None, lambda obj: [obj]
    if args.mode in TORCH_DISTRIBUTED:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        backend = "gloo"
        if args.mode.endswith("_ringcomm"):
            import ringcomm_torch.distributed  # noqa: F401  (registers the backend)

            backend = "ringcomm"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world_size, timeout=datetime.timedelta(seconds=args.deadline))

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out

        if args.mode.startswith("fsdp"):
            model = _fully_sharded(model, "cuda" if args.device == "cuda" else "cpu", dist.get_world_size())
            optimizer = type(optimizer)(model.parameters(), **optimizer.defaults)  # over the sharded parameters
        else:
            model = DistributedDataParallel(model)
        return model, optimizer, dist.get_rank(), dist.get_world_size(), dist.barrier, gather
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
    parser.add_argument("--mode", choices=("single", *TORCH_DISTRIBUTED, "ringcomm", "lockstep", "horovod"),
                        required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=("small", "resnet18", "exchange"), default="small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=600.0)
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="after the timed steps, profile a few more on rank 0 and write a summary here")
    args = parser.parse_args(argv)
    start_watchdog(args.deadline)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, shape, classes = build_model(args.model)
    cuda = args.device == "cuda"
    if cuda and (why := _util.cuda_missing()) is not None:
        raise SystemExit(f"ringcomm.bench._train_worker: {why}")
    if cuda:  # every rank of a one-GPU machine shares it
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("RINGCOMM_LOCAL_RANK", args.rank)))
        torch.cuda.set_device(local % torch.cuda.device_count())
        model = model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer, rank, size, barrier, gather = _setup(args, model, optimizer)
    gen = torch.Generator().manual_seed(1000 + rank)
    images = torch.randn(args.batch, *shape, generator=gen)
    labels = torch.randint(0, classes, (args.batch,), generator=gen)
    if cuda:
        images, labels = images.cuda(), labels.cuda()

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    def labeled_step() -> None:  # the same step, its phases named in the profiler's table
        from torch.profiler import record_function

        optimizer.zero_grad()
        with record_function("bench.forward_backward"):
            F.cross_entropy(model(images), labels).backward()
        with record_function("bench.optimizer_step"):
            optimizer.step()

    def settle() -> None:  # the GPU has run everything queued (timing only)
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    settle()
    barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    settle()
    seconds = time.perf_counter() - t0
    if args.profile:  # every rank runs the profiled steps; rank 0 records them
        from . import _profile

        if rank == 0:
            _profile.profile_steps(labeled_step, settle, cuda, args.profile)
        else:
            for _ in range(_profile.STEPS):
                step()
            settle()
    all_seconds = gather(seconds)
    if rank == 0:
        slowest = max(all_seconds)
        images_done = size * args.batch * args.steps
        result = {"mode": args.mode, "np": size, "batch_per_rank": args.batch, "steps": args.steps,
                  "device": args.device, "model": args.model,
                  "warmup": args.warmup, "seconds": slowest, "rank_seconds": all_seconds,
                  "images": images_done, "img_per_s": images_done / slowest}
        with open(args.out + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f)
        os.replace(args.out + ".tmp", args.out)
    barrier()
    if args.mode in TORCH_DISTRIBUTED:
        import torch.distributed as dist

        dist.destroy_process_group()
    elif args.mode in ("ringcomm", "lockstep", "horovod"):
        importlib.import_module("horovod.torch" if args.mode == "horovod" else "ringcomm_torch").shutdown()
    exit_now(0)  # here, while the model (and DDP's reducer) is still alive: see exit_now
    return 0


if __name__ == "__main__":
    sys.exit(main())
