"""Collective benchmark worker for MPI through mpi4py (Open MPI or MPICH); started by ``mpirun``.

    mpirun -np 2 python -m ringcomm.bench._mpi_worker --op allreduce --plan 4096:1000 --loop --out /tmp/mpi.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from . import _timing


class MpiBackend:
    """MPI_Allreduce / MPI_Allgather / MPI_Bcast on float32 NumPy buffers (allreduce in place)."""

    name = "mpi"

    def __init__(self) -> None:
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    def prepare(self, op: str, count: int) -> tuple[Callable[[], None], Callable[[], None]]:
        buf = np.zeros(count, dtype=np.float32)
        n = self.size
        if op == "allreduce":
            def step() -> None:
                self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

            def check() -> None:
                buf.fill(self.rank + 1)
                step()
                _expect(bool(np.all(buf == n * (n + 1) / 2)), op)
                buf.fill(0)
        elif op == "allgather":
            out = np.empty(count * n, dtype=np.float32)

            def step() -> None:
                self.comm.Allgather(buf, out)

            def check() -> None:
                buf.fill(self.rank)
                step()
                _expect(bool(np.array_equal(out, np.repeat(np.arange(n, dtype=np.float32), count))), op)
                buf.fill(0)
        elif op == "broadcast":
            def step() -> None:
                self.comm.Bcast(buf, root=0)

            def check() -> None:
                buf.fill(self.rank + 1)
                step()
                _expect(bool(np.all(buf == 1)), op)
                buf.fill(0)
        else:
            raise ValueError(f"unknown op {op!r}")
        return step, check

    def gather(self, obj: Any) -> list[Any] | None:
        return self.comm.gather(obj, root=0)

    def close(self) -> None:
        pass


def _expect(ok: bool, op: str) -> None:
    if not ok:
        raise AssertionError(f"MPI {op} returned a wrong result")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench._mpi_worker", description=__doc__)
    return _timing.main(lambda args: MpiBackend(), parser, argv)


if __name__ == "__main__":
    sys.exit(main())
