"""Two ranks train the same 60-tensor model; rank 1 sleeps before each backward().

Rank 0's hooks must not wait for rank 1's progress: each submit returns at once,
and rank 0's backward() takes about as long as rank 1's.  Prints the figures and
checks that the parameters end equal on both ranks.

Arguments: LAG_SECONDS STEPS
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import ringcomm_torch as hvd


def main() -> None:
    lag, steps = float(sys.argv[1]), int(sys.argv[2])
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(30)]  # 60 parameter tensors of 16 KiB and 256 B
    model = torch.nn.Sequential(*layers)  # groups=30: 30 ops in flight, more than the lane's 4 slots
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), groups=30)
    submits: list[float] = []
    original = opt.reducer.submit_group

    def timed(group):  # how long each submit (a hook's work) keeps the autograd thread
        start = time.perf_counter()
        try:
            return original(group)
        finally:
            submits.append(time.perf_counter() - start)

    opt.reducer.submit_group = timed
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    backward: list[float] = []
    slowest: list[float] = []  # per step, the slowest submit
    for step in range(steps):
        if step > 1:  # the first step's submits include the lane's and the engine's start-up
            slowest.append(max(submits))
        submits.clear()
        opt.zero_grad()
        loss = model(x).square().mean()
        if rank == 1:
            time.sleep(lag)
        start = time.perf_counter()
        loss.backward()
        backward.append(time.perf_counter() - start)
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    assert torch.equal(gathered[0], gathered[1]), f"rank {rank}: parameters differ between the ranks"
    times = hvd.allgather_object(statistics.median(backward[1:]))
    slowest.append(max(submits))
    worst = statistics.median(slowest)  # a step's slowest submit, median over the steps
    print(f"rank {rank}: backward p50 {times[rank] * 1e3:.1f} ms (rank 0 {times[0] * 1e3:.1f} ms, "
          f"rank 1 {times[1] * 1e3:.1f} ms); a step's slowest submit, p50 {worst * 1e3:.1f} ms "
          f"(max {max(slowest) * 1e3:.1f} ms)", flush=True)
    if rank == 0:
        assert times[0] <= 1.5 * times[1] + 0.005, f"rank 0's backward waited for rank 1: {times}"
        assert worst < lag / 2, f"rank 0: submits took {worst * 1e3:.1f} ms, rank 1 lags {lag * 1e3:.0f} ms"
    print(f"WORKER OK rank={rank}", flush=True)


if __name__ == "__main__":
    main()
