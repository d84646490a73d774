"""Collective benchmark worker for torch.distributed with the gloo backend; one plain process per rank.

    python -m ringcomm.bench._gloo_worker --rank 0 --world-size 2 --port 29500 \\
        --op allreduce --plan 4096:50 --out /tmp/gloo.json
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import _timing


class GlooBackend:
    """torch.distributed (gloo) on float32 CPU tensors; allreduce and broadcast are in place."""

    name = "gloo"

    def __init__(self, rank: int, world_size: int, port: int, timeout_s: float, master_addr: str = "127.0.0.1",
                 device: str = "cpu") -> None:
        torch.set_num_threads(1)
        self.device = torch.device("cpu")
        if device == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def barrier(self) -> None:
        dist.barrier()

    def prepare(self, op: str, count: int) -> tuple[Callable[[], None], Callable[[], None]]:
        buf = torch.zeros(count, dtype=torch.float32, device=self.device)
        n = self.size
        if op == "allreduce":
            def step() -> None:
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
                _settle(buf)

            def check() -> None:
                buf.fill_(self.rank + 1)
                step()
                _expect(bool(torch.all(buf == n * (n + 1) / 2)), op)
                buf.zero_()
        elif op == "allgather":
            out = torch.empty(count * n, dtype=torch.float32, device=self.device)
            chunks = list(out.chunk(n))

            def step() -> None:
                dist.all_gather(chunks, buf)
                _settle(out)

            def check() -> None:
                buf.fill_(self.rank)
                step()
                want = torch.arange(n, dtype=torch.float32, device=self.device).repeat_interleave(count)
                _expect(bool(torch.equal(out, want)), op)
                buf.zero_()
        elif op == "broadcast":
            def step() -> None:
                dist.broadcast(buf, 0)
                _settle(buf)

            def check() -> None:
                buf.fill_(self.rank + 1)
                step()
                _expect(bool(torch.all(buf == 1)), op)
                buf.zero_()
        else:
            raise ValueError(f"unknown op {op!r}")
        return step, check

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        dist.destroy_process_group()


def _settle(t: torch.Tensor) -> None:
    """A timed step ends when the GPU has the result."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _expect(ok: bool, op: str) -> None:
    if not ok:
        raise AssertionError(f"gloo {op} returned a wrong result")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench._gloo_worker", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address (default: 127.0.0.1)")
    return _timing.main(lambda a: GlooBackend(a.rank, a.world_size, a.port, a.deadline, a.master_addr, a.device),
                        parser, argv)


if __name__ == "__main__":
    sys.exit(main())
