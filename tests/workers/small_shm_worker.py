"""Worker for tests/jobs/test_small_shm.py: collectives of many sizes and a small training loop, checked exactly.

Usage: ``small_shm_worker.py [--torch] [--no-ring-on-rank R] [--repeat K] [--pause S] BYTES...``

For every size: a broadcast from the last rank, an allgather and a sum allreduce of float32
arrays of that many bytes whose values are small integers (so every result is exact), each
compared element by element with what it must be.  ``--torch``: then a few steps of a
DistributedOptimizer on a model with about 8 MB of gradients, compared with one process
training on the global batch.  ``--no-ring-on-rank R``: rank R sends through its sockets only
(RINGCOMM_SHM_SLOTS=0) while the others use shared memory.  ``--repeat K``: the sizes K times
over, and ``--pause S``: S seconds between ``init()`` (after which rank 0 prints ``SMALLSHM up``) and
the first op, as a job that builds its model there (a job to kill).  Prints ``SMALLSHM OK rank=R``.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

args = sys.argv[1:]
use_torch = "--torch" in args

def option(name: str, default: int) -> int:
    return int(args[args.index(name) + 1]) if name in args else default


no_ring, repeat, pause = option("--no-ring-on-rank", -1), option("--repeat", 1), option("--pause", 0)
sizes = [int(a) for i, a in enumerate(args) if a.isdigit() and args[i - 1] not in ("--no-ring-on-rank", "--repeat",
                                                                                     "--pause")]
if int(os.environ["RINGCOMM_RANK"]) == no_ring:
    os.environ["RINGCOMM_SHM_SLOTS"] = "0"

import ringcomm as rc  # noqa: E402

started = time.monotonic()
rc.init()
R, N = rc.rank(), rc.size()
if R == 0:
    print("SMALLSHM up", flush=True)
time.sleep(pause)


_PERIOD = np.arange(97, dtype=np.float32)


def values(rank: int, n: int) -> np.ndarray:
    """What ``rank`` contributes: small integers that differ along the array and between ranks
    (``(7 i + 13 rank) % 97`` at element ``i``)."""
    return np.resize(_PERIOD[(np.arange(97) * 7 + rank * 13) % 97], n)


for nbytes in sizes * repeat:
    n = nbytes // 4
    every = [values(r, n) for r in range(N)]
    got = rc.broadcast(every[R], root_rank=N - 1)
    assert np.array_equal(got, every[N - 1]), f"rank {R}: broadcast of {nbytes} B differs"
    got = rc.allgather(every[R])
    assert got.shape == (N * n,), got.shape
    for r in range(N):
        assert np.array_equal(got[r * n:(r + 1) * n], every[r]), f"rank {R}: allgather of {nbytes} B, part {r}"
    total = np.resize(sum(values(r, 97) for r in range(N)), n)
    got = rc.allreduce(every[R], op=rc.Sum)
    assert np.array_equal(got, total), f"rank {R}: allreduce of {nbytes} B differs"
    del every, got, total
    if R == 0:
        print(f"SMALLSHM {nbytes} B right ({time.monotonic() - started:.1f} s)", flush=True)

if use_torch:
    import torch

    import ringcomm_torch as hvd

    torch.set_num_threads(1)
    B = 4

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)  # 512 x 2048 x 2 weights: about 8 MB of float32 gradients
        return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 512))

    net, ref = model(R), model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), named_parameters=net.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(N * B, 512, generator=g), torch.randn(N * B, 512, generator=g)
        opt.zero_grad()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[R * B:(R + 1) * B]), y[R * B:(R + 1) * B]).backward()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        ref_opt.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        err = (p - q).abs().max().item()
        assert err < 1e-5, f"rank {R}: training differs from one process on the global batch by {err}"

rc.shutdown()
print(f"SMALLSHM OK rank={R} ({time.monotonic() - started:.1f} s)", flush=True)
