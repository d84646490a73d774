"""One rank of the backend benchmark: torch.distributed collectives on a given backend, timed.

    python -m ringcomm.bench._backend_worker --backend ringcomm --rank R --world N --port P \\
        --ops scatter all_to_all_single --sizes 4096 4194304 --iters 200 --warmup 20 --out F

Each op of each size (bytes of float32 per rank: the tensor each rank sends or holds) runs
``warmup`` times untimed, then ``iters`` times, each a blocking call timed on every rank; rank 0
writes every iteration's slowest rank's milliseconds to ``--out`` as ``{op: {size: [ms, ...]}}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import _torch_group
from ._timing import exit_now
from .backend_ops import OPS


def make(op: str, rank: int, world: int, numel: int) -> Callable[[], object]:
    """A blocking call of ``op`` with its tensors made once (``uneven_all_to_all_single``: rank r
    sends (r + j + 1) / (2 world) of ``numel`` to rank j, so ranks split differently)."""
    x = torch.ones(numel)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x)
    if op == "broadcast":
        return lambda: dist.broadcast(x, 0)
    if op == "reduce":
        return lambda: dist.reduce(x, 0)
    if op == "all_gather":  # into a list of tensors, one per rank
        outs = [torch.empty(numel) for _ in range(world)]
        return lambda: dist.all_gather(outs, x)
    if op == "all_gather_into_tensor":
        whole = torch.empty(numel * world)
        return lambda: dist.all_gather_into_tensor(whole, x)
    if op == "reduce_scatter_tensor":
        block = torch.empty(numel // world)
        whole = torch.ones(block.numel() * world)
        return lambda: dist.reduce_scatter_tensor(block, whole)
    if op == "all_to_all_single":
        x = torch.ones(numel // world * world)
        got = torch.empty_like(x)
        return lambda: dist.all_to_all_single(got, x)
    if op == "uneven_all_to_all_single":
        unit = max(1, numel // (2 * world))
        sends = [(rank + j + 1) * unit // world for j in range(world)]
        recvs = [(k + rank + 1) * unit // world for k in range(world)]
        src, dst = torch.ones(sum(sends)), torch.empty(sum(recvs))
        return lambda: dist.all_to_all_single(dst, src, recvs, sends)
    if op == "all_to_all":  # lists of tensors, one per rank
        ins, outs = [torch.ones(numel // world) for _ in range(world)], [torch.empty(numel // world) for _ in range(world)]
        return lambda: dist.all_to_all(outs, ins)
    if op == "gather":
        parts = [torch.empty(numel) for _ in range(world)] if rank == 0 else None
        return lambda: dist.gather(x, parts, dst=0)
    if op == "scatter":
        parts = [torch.ones(numel) for _ in range(world)] if rank == 0 else None
        got = torch.empty(numel)
        return lambda: dist.scatter(got, parts, src=0)
    raise ValueError(f"unknown op {op!r}; one of {', '.join(OPS)}")


def main() -> None:
    p = _torch_group.parser()
    p.add_argument("--ops", nargs="+", choices=OPS, required=True)
    p.add_argument("--sizes", nargs="+", type=int, required=True)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    a = p.parse_args()
    _torch_group.join(a)
    results: dict[str, dict[str, list[float]]] = {}
    for op in a.ops:
        for nbytes in a.sizes:
            call = make(op, a.rank, a.world, max(1, nbytes // 4))
            for _ in range(a.warmup):
                call()
            dist.barrier()
            mine = torch.empty(a.iters, dtype=torch.float64)
            for i in range(a.iters):
                t0 = time.perf_counter()
                call()
                mine[i] = (time.perf_counter() - t0) * 1e3
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # each iteration's slowest rank
            results.setdefault(op, {})[str(nbytes)] = mine.tolist()
    if a.rank == 0:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    exit_now(0)


if __name__ == "__main__":
    main()
