"""A DDP training script as the torch.distributed tutorials write it, on CPU, backend "ringcomm".

The shape users copy: ``--local_rank`` from ``python -m torch.distributed.launch`` (or
``LOCAL_RANK`` from torchrun), ``init_process_group(backend=...)`` with ``env://``, a
``DistributedSampler``, ``DistributedDataParallel`` and a plain loop.  Only the backend name
differs from the tutorial's (and ``.cuda()`` calls are left out: no GPU).  Prints one JSON line
per rank: its rank, the loss curve and a digest of the final parameters.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", "--local-rank", default=int(os.environ.get("LOCAL_RANK", -1)), type=int,
                    help="node rank for distributed training")
parser.add_argument("--backend", default="ringcomm")
parser.add_argument("--epochs", default=3, type=int)
args = parser.parse_args()

dist.init_process_group(backend=args.backend, init_method="env://")

torch.manual_seed(0)
x = torch.randn(512, 20)
y = (x[:, :5].sum(dim=1) > 0).long()
train_dataset = TensorDataset(x, y)
train_sampler = DistributedSampler(train_dataset)
train_loader = DataLoader(train_dataset, batch_size=32, sampler=train_sampler)

model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
model = nn.parallel.DistributedDataParallel(model)
criterion = nn.CrossEntropyLoss()
optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

losses = []
for epoch in range(args.epochs):
    train_sampler.set_epoch(epoch)
    total = 0.0
    for data, target in train_loader:
        output = model(data)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += float(loss)
    losses.append(total / len(train_loader))

digest = float(sum(p.detach().double().sum() for p in model.parameters()))
print(json.dumps({"rank": dist.get_rank(), "size": dist.get_world_size(), "local_rank": args.local_rank,
                  "losses": losses, "digest": digest}), flush=True)
dist.destroy_process_group()
