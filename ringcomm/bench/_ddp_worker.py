"""One rank of the DDP benchmark: ``DistributedDataParallel`` on a given torch.distributed backend.

    python -m ringcomm.bench._ddp_worker --backend ringcomm --model mlp --rank R --world N --port P --out F

Models: ``cnn`` (compute-heavy: 32x32x3 images through three convolutions, about 1 MiB of
float32 gradients per step) and ``mlp`` (communication-heavy: about 30 MiB of gradients per
step for little compute).  Rank 0 writes ``{"img_s": ...}`` (images per second over every rank)
to ``--out``.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _torch_group
from ._timing import exit_now


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),     # 32 -> 16
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),    # 16 -> 8
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),    # 8 -> 4
        nn.Flatten(), nn.Linear(64 * 4 * 4, 224), nn.ReLU(), nn.Linear(224, 10))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 768), nn.ReLU(), nn.Linear(768, 10))


def main() -> None:
    p = _torch_group.parser()
    p.add_argument("--model", choices=("cnn", "mlp"), required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    _torch_group.join(a)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(cnn() if a.model == "cnn" else mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(a.rank)
    shape = (a.batch, 3, 32, 32) if a.model == "cnn" else (a.batch, 1024)
    x, y = torch.randn(*shape, generator=g), torch.randint(0, 10, (a.batch,), generator=g)
    start = 0.0
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            dist.barrier()
            start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    if a.rank == 0:
        grad_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"img_s": a.batch * a.world * a.steps / elapsed, "grad_bytes": grad_bytes,
                       "pid": os.getpid()}, f)
    dist.destroy_process_group()
    exit_now(0)  # here, while the model (and DDP's reducer) is still alive: see exit_now


if __name__ == "__main__":
    main()
