"""Train a small CNN on scikit-learn's 8x8 digits with torch's DistributedDataParallel on ringcomm.

    torchrun --standalone --nproc-per-node 2 examples/ddp_digits.py          # env://
    ringcomm-run -np 2 python examples/ddp_digits.py                          # env:// too
    python examples/ddp_digits.py --spawn 2 --dist-url tcp://127.0.0.1:23456   # mp.spawn
    torchrun --standalone --nproc-per-node 2 examples/ddp_digits.py --backend gloo   # the same on gloo
    torchrun --standalone --nproc-per-node 2 examples/ddp_digits.py --fsdp    # FSDP2 instead of DDP

A plain DDP script, as the tutorials write them: ``init_process_group`` (the only
ringcomm-specific word is the backend name), a ``DistributedSampler``, ``DistributedDataParallel``,
and the mean loss and accuracy over ranks with ``all_reduce``.  Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ringcomm_torch.distributed  # noqa: F401  registers "ringcomm" (an installed ringcomm does it at import torch)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DDP on scikit-learn's digits")
    p.add_argument("--backend", default="ringcomm", help="torch.distributed backend (default: ringcomm)")
    p.add_argument("--dist-url", default="env://", help="init_method (default: env://)")
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="start N ranks with torch.multiprocessing.spawn")
    p.add_argument("--epochs", type=int, default=8, help="number of epochs (default: 8)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per rank (default: 32)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default: 0.05)")
    p.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (fully_shard) instead of DDP")
    return p.parse_args()


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return TensorDataset(x[perm[:cut]], y[perm[:cut]]), TensorDataset(x[perm[cut:]], y[perm[cut:]])


def sharded(model: CNN, world: int) -> nn.Module:
    """FSDP2: each layer's parameters sharded over the ranks, gathered for its forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))  # its group runs on the default group's backend
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def main_worker(rank: int, args: argparse.Namespace) -> None:
    if args.spawn:
        dist.init_process_group(backend=args.backend, init_method=args.dist_url, world_size=args.spawn, rank=rank)
    else:
        dist.init_process_group(backend=args.backend, init_method=args.dist_url)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_set, test_set = digits(args.seed)
    sampler = DistributedSampler(train_set, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=DistributedSampler(test_set, shuffle=False))
    model = sharded(CNN(), world) if args.fsdp else nn.parallel.DistributedDataParallel(CNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9)
    if rank == 0:
        print(f"digits: {len(train_set)} train / {len(test_set)} test images, {world} rank(s), backend "
              f"{dist.get_backend()}{', FSDP2' if args.fsdp else ''}", flush=True)
    for epoch in range(1, args.epochs + 1):
        model.train()
        sampler.set_epoch(epoch)
        t0, total, seen = time.perf_counter(), 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(y), seen + len(y)
        model.eval()
        correct, count = 0, 0
        with torch.no_grad():
            for x, y in test_loader:
                correct += int((model(x).argmax(1) == y).sum())
                count += len(y)
        loss_avg, acc = mean_over_ranks(total / max(seen, 1)), mean_over_ranks(correct / max(count, 1))
        if rank == 0:
            print(f"epoch {epoch}: train loss {loss_avg:.4f}, test accuracy {100 * acc:.1f}% "
                  f"({time.perf_counter() - t0:.2f} s)", flush=True)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.spawn:
        mp.spawn(main_worker, nprocs=args.spawn, args=(args,))
    else:
        main_worker(int(os.environ.get("RANK", "0")), args)


if __name__ == "__main__":
    main()
