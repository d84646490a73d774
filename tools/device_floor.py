"""What a small exchange between two ranks on one device costs at least, with none of ringcomm's work:

    ringcomm-run -np 2 python tools/device_floor.py [--bytes 4K] [--ops 300]

ringcomm only starts the pair and shares a file between them.  Each way runs after a barrier:

* ``handshake``: each rank bumps its word in a shared page and spins until the other's word has
  caught up (two processes agreeing, on the host alone);
* ``copies alone``: one rank at a time while the other waits: the tensor copied to a pinned host
  buffer on a side stream, that copy's event waited for, then copied back and waited for;
* ``copies together``: the same on both ranks at once (two processes on one GPU take turns on it);
* ``pinned exchange``: the copy to the host, the handshake, the copy back: a floor for a small
  allreduce through pinned memory, which also sums and agrees through the lane;
* ``ipc events`` (CUDA only): the two ranks' side streams take turns, each waiting for the other's
  interprocess event (recorded after a one-element add), the hosts agreeing through the handshake
  that it was recorded; rank 0 waits for its last event: a floor for a device-side step that waits
  for a peer.

Rank 0 prints each way's p50 and p99 on each rank, in microseconds, with the device's name.  The
copies go through ``ringcomm_torch.device``'s operations (those of the CUDA path; without CUDA, its
fake on CPU tensors, which times the host side alone).  Compare with ``tools/allreduce_phases.py``
at the same size: the difference is ringcomm's own cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

import ringcomm_torch as hvd
from ringcomm_torch import device


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


class Handshake:
    """Two ranks' counters in one shared page: :meth:`meet` returns once the other rank has met as often."""

    def __init__(self, path: str, rank: int) -> None:
        self.words = np.memmap(path, dtype=np.uint32, mode="r+", shape=(16,))
        self.me, self.peer, self.count = rank * 8, (1 - rank) * 8, 0  # a cache line apart

    def post(self) -> None:
        self.count += 1
        self.words[self.me] = self.count

    def wait(self, ahead: int = 0) -> None:
        """Until the other rank has posted ``ahead`` times more than this one (at most 30 s)."""
        spins, deadline = 0, time.monotonic() + 30
        while self.words[self.peer] < self.count + ahead:
            spins += 1
            if spins % 100_000 == 0 and time.monotonic() > deadline:
                raise TimeoutError(f"rank {hvd.rank()}: the other rank did not post {self.count + ahead} in 30 s")

    def wait_next(self) -> None:
        self.wait(1)

    def meet(self) -> None:
        self.post()
        self.wait()


def shared_page() -> str:
    """A zeroed page both ranks map (rank 0 makes it; the name reaches rank 1 through ringcomm)."""
    path = None
    if hvd.rank() == 0:
        fd, path = tempfile.mkstemp(prefix="ringcomm-floor-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.write(fd, bytes(64))
        os.close(fd)
    return hvd.broadcast_object(path, root_rank=0, name="floor.page")


def timed(way: Callable[[], None], ops: int) -> list[float]:
    for _ in range(max(5, ops // 10)):
        way()
    out = []
    for _ in range(ops):
        t0 = time.perf_counter()
        way()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", default="4K", help="bytes per rank (default: 4K)")
    parser.add_argument("--ops", type=int, default=300, help="timed rounds per way (default: 300)")
    args = parser.parse_args()
    hvd.init()
    if hvd.size() != 2:
        raise SystemExit(f"device_floor.py times a pair of ranks: run it with -np 2, not {hvd.size()}")
    rank, cuda = hvd.rank(), torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    where = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ops: device.DeviceOps = device.cuda_ops() if cuda else device.FakeOps()
    nbytes = parse_size(args.bytes)
    x = torch.ones(nbytes // 4, device=where)
    host = ops.pinned(nbytes).view(torch.float32)
    if cuda:
        torch.cuda.synchronize()  # x is filled before the side stream first reads it
    side = ops.side_stream(where)
    path = shared_page()
    shake = Handshake(path, rank)
    hvd.barrier()
    if rank == 0:
        os.unlink(path)  # both ranks have mapped it

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        ops.copy(dst, src, side)
        done = ops.event()
        ops.record(done, side)
        ops.wait_event(done)

    def copies() -> None:
        copy(host, x)
        copy(x, host)

    def exchange() -> None:
        copy(host, x)
        shake.meet()
        copy(x, host)

    results: dict[str, list[float]] = {}
    hvd.barrier()
    results["handshake"] = timed(shake.meet, args.ops)
    for turn in (0, 1):  # one rank copies while the other waits at the barrier
        hvd.barrier()
        if rank == turn:
            results["copies alone"] = timed(copies, args.ops)
        hvd.barrier()
    hvd.barrier()
    results["copies together"] = timed(copies, args.ops)
    hvd.barrier()
    results["pinned exchange"] = timed(exchange, args.ops)
    failed = ""
    if cuda:
        hvd.barrier()
        try:
            results["ipc events"] = ipc_events(x, side, shake, args.ops)
        except Exception as exc:  # noqa: BLE001 - the other ways are still worth printing
            failed = f"rank {rank}: {type(exc).__name__}: {exc}"
    report = hvd.allgather_object({way: (statistics.median(ts), sorted(ts)[int(0.99 * (len(ts) - 1))])
                                   for way, ts in results.items()}, name="floor.report")
    failures = [f for f in hvd.allgather_object(failed, name="floor.failed") if f]
    if rank == 0:
        name = torch.cuda.get_device_name(where) if cuda else "no GPU: the fake device (host side only)"
        print(f"floor np=2 {args.bytes} per rank on {name}; p50 / p99 us, rank 0 | rank 1", flush=True)
        for way in report[0]:
            if all(way in r for r in report):
                cells = " | ".join(f"{r[way][0] * 1e6:8.1f} / {r[way][1] * 1e6:8.1f}" for r in report)
                print(f"floor {way:16s} {cells}", flush=True)
        if not cuda:
            print("floor ipc events: CUDA only", flush=True)
        for f in failures:
            print(f"floor ipc events failed: {f}", flush=True)
    hvd.barrier()
    hvd.shutdown()


def ipc_events(x: torch.Tensor, side: torch.cuda.Stream, shake: Handshake, ops: int) -> list[float]:
    """The ``ipc events`` way's round times on this rank (see the module docstring): rank 0's stream
    adds and records, rank 1's waits for that record, adds and records, rank 0's waits for it."""
    rank = hvd.rank()
    mine = torch.cuda.Event(interprocess=True)
    mine.record(side)  # recorded once before its handle is taken
    handles = hvd.allgather_object(bytes(mine.ipc_handle()), name="floor.events")
    theirs = torch.cuda.Event.from_ipc_handle(x.device, handles[1 - rank])
    mine.synchronize()
    hvd.barrier()

    def add_and_record() -> None:
        with torch.cuda.stream(side):
            x[:1].add_(1)
        mine.record(side)

    def round_() -> None:
        if rank == 0:
            add_and_record()
            shake.post()  # recorded: rank 1's stream may wait for it now
            shake.wait()  # rank 1 recorded after it
            side.wait_event(theirs)
            mine.record(side)
        else:
            shake.wait_next()
            side.wait_event(theirs)
            add_and_record()
            shake.post()
        mine.synchronize()
    return timed(round_, ops)


if __name__ == "__main__":
    main()
