"""A DDP job on "ringcomm" under ``torchrun --max-restarts 1``: on the first attempt rank 2 kills itself
(SIGKILL) at step 20; the restarted attempt must join afresh and train 40 steps on every rank."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    started = time.monotonic()
    dist.init_process_group("ringcomm")
    rank = dist.get_rank()
    print(f"JOINED rank={rank} attempt={attempt} in {time.monotonic() - started:.2f} s", flush=True)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(40):
        if attempt == "0" and rank == 2 and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    print(f"DONE rank={rank} attempt={attempt} sum={total.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
