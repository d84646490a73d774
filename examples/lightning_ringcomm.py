"""Train with PyTorch Lightning on the "ringcomm" torch.distributed backend.

The one change from a gloo job is the strategy's backend::

    Trainer(strategy=DDPStrategy(process_group_backend="ringcomm"), ...)   # was "gloo"

(or ``strategy="ddp_ringcomm"`` after ``import ringcomm_torch.lightning``).  Start it any way
a Lightning DDP job starts::

    ringcomm-run -np 2 python examples/lightning_ringcomm.py
    torchrun --standalone --nproc-per-node 2 examples/lightning_ringcomm.py
    python examples/lightning_ringcomm.py --devices 2          # Lightning starts rank 1 itself
    torchrun --standalone --nproc-per-node 2 examples/lightning_ringcomm.py --backend gloo   # the same on gloo

An MLP classifies synthetic data (a fixed random "teacher" labels it; nothing is downloaded).
The first epoch warms up; rank 0 prints the samples per second of the others, the final
loss (averaged over ranks with ``sync_dist=True``) and a digest of the parameters, which is
the same on every backend for the same world size and seed.  ``pip install 'ringcomm[frameworks]'``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 256, 10


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Lightning DDP on the ringcomm backend")
    p.add_argument("--backend", default="ringcomm", help="torch.distributed backend (default: ringcomm)")
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                   help="ranks on this machine (default: the launcher's LOCAL_WORLD_SIZE, else 1)")
    p.add_argument("--epochs", type=int, default=4, help="epochs, the first untimed (default: 4)")
    p.add_argument("--steps", type=int, default=20, help="steps per epoch (default: 20)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per rank (default: 64)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden width: 1024 is about 5 MiB of gradients")
    p.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    p.add_argument("--json", help="rank 0 writes its figures to this file")
    return p.parse_args()


class Classifier(pl.LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, CLASSES))

    def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)  # the mean over steps and ranks
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class EpochClock(pl.Callback):
    """Wall time of the epochs after the first (which pays for connecting and warming up)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.seconds = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            self.started = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.started


def synthetic(samples: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode() + p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", args.devices))
    data = synthetic(args.steps * args.batch_size * max(world, args.devices), args.seed)
    model = Classifier(args.hidden)
    clock = EpochClock()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=max(1, world // args.devices),
                         strategy=DDPStrategy(process_group_backend=args.backend), max_epochs=args.epochs,
                         callbacks=[clock], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size))
    if trainer.global_rank == 0:
        samples = (args.epochs - 1) * args.steps * args.batch_size * trainer.world_size
        figures = {"backend": args.backend, "world": trainer.world_size, "timed_s": round(clock.seconds, 3),
                   "samples_s": round(samples / clock.seconds, 1), "loss": float(trainer.callback_metrics["loss"]),
                   "digest": digest(model)}
        print(f"{args.backend}, {trainer.world_size} ranks: {figures['samples_s']:.0f} samples/s over epochs "
              f"2-{args.epochs}, loss {figures['loss']:.4f}, parameters {figures['digest']}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(figures, f)
    if torch.distributed.is_initialized():
        # every rank leaves together: gloo aborts a rank whose peer exits while its threads still run
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
