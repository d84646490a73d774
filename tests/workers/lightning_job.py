"""A small Lightning job for the framework tests: fit, checkpoint, restore, test; one RESULT line per rank.

    python lightning_job.py --backend ringcomm --devices 2 --out DIR      # under any launcher, or none

It trains a small regression net from one seed with ``DDPStrategy(process_group_backend=...)``
(or ``--strategy ddp_ringcomm``), and checks on every rank: ``self.log(..., sync_dist=True)`` of
the rank number gives the mean over ranks; ``all_gather`` gives every rank's number; a checkpoint
saved after ``fit`` restores the same parameters in ``trainer.test(ckpt_path=...)`` and resumes
``fit`` at the next epoch.  It prints ``RESULT {json}`` with a digest of the trained parameters.
With ``--die-rank R`` rank R kills itself (SIGKILL) at a step of the second epoch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

BATCHES, BATCH = 12, 16


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCHES * BATCH * 3, 8, generator=g)  # enough for 3 ranks' shards
    return TensorDataset(x, (x @ torch.linspace(-1.0, 1.0, 8)).unsqueeze(1) + 0.1 * torch.randn(len(x), 1, generator=g))


class Net(pl.LightningModule):
    def __init__(self, die_rank: int = -1) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.die_rank = die_rank
        self.gathered: list[int] = []
        self.rank_mean = float("nan")

    def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
        if self.global_rank == self.die_rank and self.current_epoch == 1 and idx == 3:
            print(f"rank {self.global_rank}: pid {os.getpid()} kills itself with SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.gathered = self.all_gather(torch.tensor([self.global_rank])).flatten().tolist()

    def test_step(self, batch: list[torch.Tensor], idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)
        self.log("rank_mean", float(self.global_rank), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def trainer(args: argparse.Namespace, epochs: int) -> pl.Trainer:
    strategy: object = args.strategy
    if args.strategy == "ddp":
        strategy = DDPStrategy(process_group_backend=args.backend)
    return pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy, max_epochs=epochs,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, deterministic=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="ringcomm")
    ap.add_argument("--strategy", default="ddp", help="ddp (DDPStrategy with --backend) or a registered name")
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--die-rank", type=int, default=-1)
    args = ap.parse_args()
    if args.strategy != "ddp":
        import ringcomm_torch.lightning  # noqa: F401  (registers "ddp_ringcomm")
    torch.set_num_threads(1)
    pl.seed_everything(7, workers=True, verbose=False)
    loader = DataLoader(data(0), batch_size=BATCH, shuffle=False)

    model = Net(args.die_rank)
    fit = trainer(args, args.epochs)
    started = time.perf_counter()
    fit.fit(model, loader)
    fit_s = time.perf_counter() - started
    ckpt = str(args.out / "last.ckpt")
    fit.save_checkpoint(ckpt)  # every rank calls it; rank 0 writes
    if fit.global_rank == 0:  # for a comparison across jobs (other backends, launchers)
        torch.save(model.state_dict(), args.out / "params.pt")

    restored = Net()
    tested = trainer(args, args.epochs).test(restored, DataLoader(data(1), batch_size=BATCH), ckpt_path=ckpt,
                                             verbose=False)[0]
    resumed = trainer(args, args.epochs + 1)
    resumed.fit(Net(), loader, ckpt_path=ckpt)

    print("RESULT " + json.dumps({
        "rank": dist.get_rank(), "size": dist.get_world_size(), "backend": dist.get_backend(),
        "digest": digest(model), "restored": digest(restored), "gathered": model.gathered,
        "rank_mean": tested["rank_mean"], "test_loss": tested["test_loss"],
        "resumed_epoch": resumed.current_epoch, "fit_s": round(fit_s, 3),
    }), flush=True)
    # Lightning leaves the group open; gloo's threads can abort the exit ("terminate called without
    # an active exception") when the interpreter tears down a live group, so close it as scripts should
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
