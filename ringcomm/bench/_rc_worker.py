"""Collective benchmark worker for ringcomm; started by the ringcomm launcher, one process per rank.

    python -m ringcomm.launcher -np 2 python -m ringcomm.bench._rc_worker \\
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


def _expect(ok: bool | np.bool_, op: str) -> None:
    if not ok:
        raise AssertionError(f"ringcomm {op} returned a wrong result")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench._rc_worker", description=__doc__)
    return _timing.main(lambda args: RingcommBackend(), parser, argv)


if __name__ == "__main__":
    sys.exit(main())
