"""A small Hugging Face Accelerate job for the framework tests: one RESULT line per rank.

    python accelerate_job.py --backend ringcomm --out DIR        # under accelerate launch, torchrun, ringcomm-run

``--route adopt`` (the default) creates the process group on ``--backend`` before ``Accelerator()``,
which then uses it; ``--route kwargs`` asks Accelerate for the backend through
``InitProcessGroupKwargs(backend=...)`` instead (Accelerate refuses any CPU backend but gloo and
mpi: the job then prints ``REFUSED <message>`` and exits 3).  The job checks
``accelerator.gather``, ``reduce`` and ``wait_for_everyone``, trains a small net from one seed
through ``accelerator.prepare`` and prints a digest of its parameters.  With ``--die-rank R``
rank R kills itself (SIGKILL) at a step of the second epoch.
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

from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed

BATCHES, BATCH = 12, 16


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="ringcomm")
    ap.add_argument("--route", choices=["adopt", "kwargs"], default="adopt")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--die-rank", type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.route == "adopt":
        dist.init_process_group(args.backend)  # env:// from the launcher; Accelerator() then adopts the group
        accelerator = Accelerator(cpu=True)
    else:
        try:
            accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend=args.backend)])
        except ValueError as exc:
            print(f"REFUSED {exc}", flush=True)
            return 3
    rank, size = accelerator.process_index, accelerator.num_processes

    mine = torch.tensor([float(rank)])
    gathered = accelerator.gather(mine).tolist()
    summed = accelerator.reduce(mine.clone(), reduction="sum").tolist()
    mean = accelerator.reduce(mine.clone(), reduction="mean").tolist()
    if rank == 0:
        time.sleep(0.5)  # the others wait for rank 0 here
    waited_from = time.perf_counter()
    accelerator.wait_for_everyone()
    waited = time.perf_counter() - waited_from

    set_seed(7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * BATCH * 3, 8, generator=g)
    y = (x @ torch.linspace(-1.0, 1.0, 8)).unsqueeze(1) + 0.1 * torch.randn(len(x), 1, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    started = time.perf_counter()
    for epoch in range(args.epochs):
        for step, (xb, yb) in enumerate(loader):
            if rank == args.die_rank and epoch == 1 and step == 3:
                print(f"rank {rank}: pid {os.getpid()} kills itself with SIGKILL", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
    train_s = time.perf_counter() - started
    accelerator.wait_for_everyone()
    net = accelerator.unwrap_model(model)
    if accelerator.is_main_process:  # for a comparison across jobs (other backends, launchers)
        torch.save(net.state_dict(), args.out / "params.pt")
    print("RESULT " + json.dumps({
        "rank": rank, "size": size, "backend": dist.get_backend(), "accelerate_backend": accelerator.state.backend,
        "distributed_type": str(accelerator.distributed_type), "gathered": gathered, "sum": summed, "mean": mean,
        "waited_s": round(waited, 3), "digest": digest(net), "train_s": round(train_s, 3),
    }), flush=True)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
