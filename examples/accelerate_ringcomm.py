"""Train with Hugging Face Accelerate on the "ringcomm" torch.distributed backend.

Accelerate creates the process group itself and, on CPU, accepts only gloo or MPI for it;
but it uses a group that already exists.  So the change from a gloo job is one line before
the ``Accelerator``::

    dist.init_process_group("ringcomm")      # Accelerate adopts this group
    accelerator = Accelerator(cpu=True)      # cpu=True on a machine without GPUs, as with gloo

Start it any way an Accelerate job starts::

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_ringcomm.py
    torchrun --standalone --nproc-per-node 2 examples/accelerate_ringcomm.py
    ringcomm-run -np 2 python examples/accelerate_ringcomm.py
    torchrun --standalone --nproc-per-node 2 examples/accelerate_ringcomm.py --backend gloo   # the same on gloo

(``--multi_gpu`` is Accelerate's switch for several processes; the script picks the CPU.)
An MLP classifies synthetic data (a fixed random "teacher" labels it; nothing is
downloaded).  The first epoch warms up; the main process prints the samples per second of
the others, the final loss (``accelerator.reduce``d over ranks) and a digest of the
parameters, the same on every backend for the same world size and seed.
``pip install 'ringcomm[frameworks]'``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 256, 10


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Accelerate on the ringcomm backend")
    p.add_argument("--backend", default="ringcomm", help="torch.distributed backend (default: ringcomm)")
    p.add_argument("--epochs", type=int, default=4, help="epochs, the first untimed (default: 4)")
    p.add_argument("--steps", type=int, default=20, help="steps per epoch (default: 20)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per rank (default: 64)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden width: 1024 is about 5 MiB of gradients")
    p.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    p.add_argument("--json", help="the main process writes its figures to this file")
    return p.parse_args()


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode() + p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)  # the launcher's env:// variables; Accelerator() adopts the group
    accelerator = Accelerator(cpu=True)
    set_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.steps * args.batch_size * accelerator.num_processes, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    started = 0.0
    for epoch in range(args.epochs):
        if epoch == 1:  # the first epoch pays for connecting and warming up
            accelerator.wait_for_everyone()
            started = time.perf_counter()
        total = torch.zeros(1)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            total += loss.detach()
    accelerator.wait_for_everyone()
    seconds = time.perf_counter() - started
    mean_loss = float(accelerator.reduce(total / len(loader), reduction="mean"))
    if accelerator.is_main_process:
        samples = (args.epochs - 1) * args.steps * args.batch_size * accelerator.num_processes
        figures = {"backend": dist.get_backend(), "world": accelerator.num_processes, "timed_s": round(seconds, 3),
                   "samples_s": round(samples / seconds, 1), "loss": mean_loss,
                   "digest": digest(accelerator.unwrap_model(model))}
        print(f"{figures['backend']}, {figures['world']} ranks: {figures['samples_s']:.0f} samples/s over epochs "
              f"2-{args.epochs}, loss {mean_loss:.4f}, parameters {figures['digest']}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(figures, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
