"""Train a small CNN on scikit-learn's bundled 8x8 digits, Horovod style, with ringcomm_torch.

    ringcomm-run -np 4 python examples/torch_digits.py --epochs 10

Written exactly as a Horovod script would be (swap the import for ``horovod.torch``
and it runs under horovodrun): ``hvd.init()``, a ``DistributedSampler`` sharding the
training set by rank, the learning rate scaled by ``hvd.size()``,
``DistributedOptimizer``, ``broadcast_parameters`` and ``broadcast_optimizer_state``
from rank 0, and metrics averaged over ranks with ``hvd.allreduce``.  Nothing is
downloaded: the digits ship inside scikit-learn.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ringcomm_torch as hvd


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ringcomm_torch digits example")
    p.add_argument("--epochs", type=int, default=10, help="number of epochs (default: 10)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per rank (default: 32)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank, scaled by size (default: 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn", help="network (default: cnn)")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 on the wire")
    p.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU even if CUDA is available")
    return p.parse_args()


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)   # 8x8 -> 8x8, pooled to 4x4
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)  # 4x4 -> 4x4, pooled to 2x2
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def MLP() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def load_digits_tensors(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """80/20 split of the 1797 digits, identical on every rank (fixed seed)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(y))
    train, test = perm[:n_train], perm[n_train:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def metric_average(value: float, name: str) -> float:
    """The mean of ``value`` over ranks."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if use_cuda else "cpu")

    train_set, test_set = load_digits_tensors(args.seed)
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = (CNN() if args.model == "cnn" else MLP()).to(device)
    # Horovod: scale the learning rate by the number of ranks (the global batch grows with it).
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    # Horovod: start every rank from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if hvd.rank() == 0:
        print(f"digits: {len(train_set)} train / {len(test_set)} test images, {hvd.size()} rank(s), "
              f"model {args.model}, batch {args.batch_size} per rank", flush=True)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        total_loss, seen = 0.0, 0
        for data, target in train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(target)
            seen += len(target)
        elapsed = time.perf_counter() - t0
        train_loss = metric_average(total_loss / max(seen, 1), "avg_loss")
        images = hvd.allreduce(torch.tensor(float(seen)), op=hvd.Sum, name="images").item()

        model.eval()
        correct, count = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                correct += (model(data).argmax(dim=1) == target).sum().item()
                count += len(target)
        # Horovod: average the test accuracy over ranks (weighted by each rank's share of the test set).
        totals = hvd.allreduce(torch.tensor([correct, count], dtype=torch.float64), op=hvd.Sum, name="accuracy")
        accuracy = 100.0 * totals[0].item() / max(totals[1].item(), 1.0)
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}: train loss {train_loss:.4f}  test accuracy {accuracy:.2f}%  "
                  f"{images / elapsed:.0f} img/s", flush=True)
    if hvd.rank() == 0:
        print(f"done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
