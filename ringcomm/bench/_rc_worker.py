"""Collective benchmark worker for ringcomm; started by the ringcomm launcher, one process per rank.

    python -m ringcomm.launch.launcher -np 2 python -m ringcomm.bench._rc_worker \\
        --op allreduce --plan 4096:50 --out /tmp/rc.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import ringcomm as rc

from . import _timing


class RingcommBackend:
    """ringcomm on NumPy float32 arrays; allreduce and broadcast are in place (``out=``), like gloo's."""

    name = "ringcomm"

    def __init__(self) -> None:
        rc.init()
        self.rank = rc.rank()
        self.size = rc.size()

    def barrier(self) -> None:
        rc.barrier()

    def prepare(self, op: str, count: int) -> tuple[Callable[[], None], Callable[[], None]]:
        buf = np.zeros(count, dtype=np.float32)
        name = f"bench.{op}.{count}"
        n = self.size
        if op == "allreduce":
            def step() -> None:
                rc.allreduce(buf, op=rc.Sum, name=name, out=buf)

            def check() -> None:
                buf.fill(self.rank + 1)
                step()
                _expect(np.all(buf == n * (n + 1) / 2), op)
                buf.fill(0)
        elif op == "allgather":
            def step() -> None:
                rc.allgather(buf, name=name)

            def check() -> None:
                buf.fill(self.rank)
                out = rc.allgather(buf, name=name)
                want = np.repeat(np.arange(n, dtype=np.float32), count)
                _expect(out.shape == want.shape and np.array_equal(out, want), op)
                buf.fill(0)
        elif op == "broadcast":
            def step() -> None:
                rc.broadcast(buf, 0, name=name, out=buf)

            def check() -> None:
                buf.fill(self.rank + 1)
                _expect(rc.broadcast(buf, 0, name=name, out=buf) is buf and np.all(buf == 1), op)
                buf.fill(0)
        else:
            raise ValueError(f"unknown op {op!r}")
        return step, check

    def gather(self, obj: Any) -> list[Any] | None:
        everything = rc.allgather_object(obj, name="bench.gather")
        return everything if self.rank == 0 else None

    def close(self) -> None:
        rc.shutdown()


class TorchCudaBackend:
    """ringcomm_torch on float32 CUDA tensors (staged through pinned host memory); a timed step
    ends when the GPU has the result, as the gloo worker's does."""

    name = "ringcomm"

    def __init__(self) -> None:
        import torch

        import ringcomm_torch as hvd

        self.torch, self.hvd = torch, hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(self.device)

    def barrier(self) -> None:
        self.hvd.barrier()

    def prepare(self, op: str, count: int) -> tuple[Callable[[], None], Callable[[], None]]:
        torch, hvd, n = self.torch, self.hvd, self.size
        buf = torch.zeros(count, dtype=torch.float32, device=self.device)
        name = f"bench.{op}.{count}"
        run: Callable[[], Any]
        if op == "allreduce":
            run = lambda: hvd.allreduce_(buf, op=hvd.Sum, name=name)  # noqa: E731
            want = lambda: torch.full_like(buf, n * (n + 1) / 2)  # noqa: E731
            fill = self.rank + 1.0
        elif op == "allgather":
            run = lambda: hvd.allgather(buf, name=name)  # noqa: E731
            want = lambda: torch.arange(n, dtype=torch.float32, device=self.device).repeat_interleave(count)  # noqa: E731
            fill = float(self.rank)
        elif op == "broadcast":
            run = lambda: hvd.broadcast_(buf, 0, name=name)  # noqa: E731
            want = lambda: torch.ones_like(buf)  # noqa: E731
            fill = self.rank + 1.0
        else:
            raise ValueError(f"unknown op {op!r}")

        def step() -> None:
            run()
            torch.cuda.synchronize(self.device)

        def check() -> None:
            buf.fill_(fill)
            out = run()
            _expect(bool(torch.equal(out, want())), op)
            buf.zero_()
        return step, check

    def gather(self, obj: Any) -> list[Any] | None:
        everything = self.hvd.allgather_object(obj, name="bench.gather")
        return everything if self.rank == 0 else None

    def close(self) -> None:
        self.hvd.shutdown()


def _expect(ok: bool | np.bool_, op: str) -> None:
    if not ok:
        raise AssertionError(f"ringcomm {op} returned a wrong result")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench._rc_worker", description=__doc__)
    return _timing.main(lambda args: TorchCudaBackend() if args.device == "cuda" else RingcommBackend(), parser, argv)


if __name__ == "__main__":
    sys.exit(main())
