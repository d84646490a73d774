"""Collective benchmark worker for Horovod (``horovod.torch``); started by ``horovodrun``.

Only used when ``import horovod.torch`` works; untested where Horovod is not
installed (building it needs the fixes ANCHORS.md describes).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from . import _timing


class HorovodBackend:
    """horovod.torch on float32 CPU tensors; allreduce and broadcast in place."""

    name = "horovod"

    def __init__(self) -> None:
        import horovod.torch as hvd

        torch.set_num_threads(1)
        hvd.init()
        self.hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        self._token = torch.zeros(1)

    def barrier(self) -> None:
        if hasattr(self.hvd, "barrier"):
            self.hvd.barrier()
        else:  # old releases: a one-element allreduce synchronizes as well
            self.hvd.allreduce(self._token, name="bench.barrier")

    def prepare(self, op: str, count: int) -> tuple[Callable[[], None], Callable[[], None]]:
        hvd = self.hvd
        buf = torch.zeros(count, dtype=torch.float32)
        name = f"bench.{op}.{count}"
        n = self.size
        if op == "allreduce":
            def step() -> None:
                hvd.allreduce_(buf, op=hvd.Sum, name=name)

            def check() -> None:
                buf.fill_(self.rank + 1)
                step()
                _expect(bool(torch.all(buf == n * (n + 1) / 2)), op)
                buf.zero_()
        elif op == "allgather":
            def step() -> None:
                hvd.allgather(buf, name=name)

            def check() -> None:
                buf.fill_(self.rank)
                want = torch.arange(n, dtype=torch.float32).repeat_interleave(count)
                _expect(bool(torch.equal(hvd.allgather(buf, name=name), want)), op)
                buf.zero_()
        elif op == "broadcast":
            def step() -> None:
                hvd.broadcast_(buf, 0, name=name)

            def check() -> None:
                buf.fill_(self.rank + 1)
                step()
                _expect(bool(torch.all(buf == 1)), op)
                buf.zero_()
        else:
            raise ValueError(f"unknown op {op!r}")
        return step, check

    def gather(self, obj: Any) -> list[Any] | None:
        everything = self.hvd.allgather_object(obj, name="bench.gather")
        return everything if self.rank == 0 else None

    def close(self) -> None:
        self.hvd.shutdown()


def _expect(ok: bool, op: str) -> None:
    if not ok:
        raise AssertionError(f"horovod {op} returned a wrong result")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench._hvd_worker", description=__doc__)
    return _timing.main(lambda args: HorovodBackend(), parser, argv)


if __name__ == "__main__":
    sys.exit(main())
