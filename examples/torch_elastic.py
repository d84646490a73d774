"""Elastic training on scikit-learn's digits: survives losing workers and grows when hosts appear.

    printf 'localhost:2\\n127.0.0.2:2\\n' > /tmp/hosts
    ringcomm-run -np 4 --min-np 2 --max-np 6 --host-discovery-script 'cat /tmp/hosts' \\
        python examples/torch_elastic.py --epochs 5

While it runs, kill a worker (``kill -9 <pid>``; ``-v`` prints the pids): the
others roll back to the last commit, re-form and go on.  Append
``127.0.0.3:2`` to /tmp/hosts: two new workers join at the next commit.
The "hosts" are names of this machine; each acts as a separate host.

Horovod's elastic recipe: ``hvd.elastic.TorchState`` holds the model, the
optimizer, the ``ElasticSampler`` and the epoch; the training function is
wrapped in ``@hvd.elastic.run``; ``state.commit()`` every ``--batches-per-commit``
batches; the learning rate follows ``hvd.size()`` through a reset callback.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ringcomm_torch as hvd


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ringcomm_torch elastic digits example")
    p.add_argument("--epochs", type=int, default=5, help="number of epochs (default: 5)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per rank (default: 32)")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate for one rank, scaled by size (default: 0.02)")
    p.add_argument("--batches-per-commit", type=int, default=5, help="commit the state every N batches (default: 5)")
    p.add_argument("--synthetic", action="store_true", help="random data instead of scikit-learn's digits")
    return p.parse_args()


def load_data(synthetic: bool) -> tuple[TensorDataset, TensorDataset]:
    if synthetic:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1500, 64, generator=g)
        y = (x[:, :10].argmax(dim=1)).long()
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
    return TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(42)
    train_set, test_set = load_data(args.synthetic)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=42)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batches=0)

    def on_reset() -> None:  # after every change of membership: scale the learning rate to the new size
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        if hvd.rank() == 0:
            print(f"training on {hvd.size()} workers from epoch {state.epoch}, batch {state.batches}", flush=True)
        while state.epoch < args.epochs:
            model.train()
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(i, args.batch_size)
                state.batches += 1
                if state.batches % args.batches_per_commit == 0:
                    state.commit()  # also raises HostsUpdatedInterrupt when hosts were added
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            accuracy = evaluate(model, test_set)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: {hvd.size()} workers, loss {loss.item():.3f}, "
                      f"test accuracy {accuracy:.3f}", flush=True)
            state.commit()

    train(state)


def evaluate(model: nn.Module, test_set: TensorDataset) -> float:
    """Accuracy on the test set, averaged over ranks (each rank scores its own share)."""
    model.eval()
    x, y = test_set.tensors
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).float().sum()
    totals = hvd.allreduce(torch.stack([correct, torch.tensor(float(len(y)))]), op=hvd.Sum, name="accuracy")
    return float(totals[0] / totals[1])


if __name__ == "__main__":
    main()
