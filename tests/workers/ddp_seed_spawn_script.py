"""The tutorials' ``torch.multiprocessing.spawn`` DDP script on CPU, backend "ringcomm".

``main()`` spawns one process per rank; each calls ``init_process_group(backend, init_method=
"tcp://...", world_size=..., rank=...)`` as the ImageNet example does, wraps the model in
``DistributedDataParallel`` without ``device_ids`` and trains.  Each rank prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def main_worker(gpu: int, ngpus_per_node: int, args: argparse.Namespace) -> None:
    rank = args.rank * ngpus_per_node + gpu
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=args.world_size, rank=rank)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(10):
        x = torch.randn(16, 16, generator=gen)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    print(json.dumps({"rank": dist.get_rank(), "size": dist.get_world_size(), "digest": digest}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dist-url", required=True)
    parser.add_argument("--dist-backend", default="ringcomm")
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    args.rank, args.world_size = 0, args.nprocs  # one node
    mp.spawn(main_worker, nprocs=args.nprocs, args=(args.nprocs, args))


if __name__ == "__main__":
    main()
