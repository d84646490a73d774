"""The engine built from its constructor, without ``init()``: a topology and settings in, ops through ``submit``.

One engine alone, and two engines in threads of this process joined by a rendezvous server that
runs here too: the loop, the session, rank 0's service, the executor and the data plane are the
real ones; only the process boundary is missing.
"""

from __future__ import annotations

import concurrent.futures
import secrets
from typing import Any

import numpy as np
import pytest

from ringcomm.job.config import Settings
from ringcomm.core import ops, wire
from ringcomm.engine import Engine
from ringcomm.handles import Entry, Handle
from ringcomm.lane.owner import LaneOwner
from ringcomm.net.rendezvous import RendezvousServer
from ringcomm.job.topology import Topology


def _allreduce(name: str, a: np.ndarray, op: int = int(ops.ReduceOp.SUM)) -> Entry:
    req = wire.Request(name, wire.ALLREDUCE, ops.check_dtype(a.dtype, name), (a.shape,), op)
    return Entry(req, [a], Handle(name), [None])


def _allgather(name: str, a: np.ndarray) -> Entry:
    return Entry(wire.Request(name, wire.ALLGATHER, ops.check_dtype(a.dtype, name), (a.shape,)), [a], Handle(name))


def _broadcast(name: str, a: np.ndarray, root: int) -> Entry:
    req = wire.Request(name, wire.BROADCAST, ops.check_dtype(a.dtype, name), (a.shape,), 0, root)
    return Entry(req, [a], Handle(name), [None])


def _result(entry: Entry) -> np.ndarray:
    got = entry.handle.wait(30.0)
    return np.asarray(got[0] if isinstance(got, list) else got)


@pytest.mark.timeout(60)
def test_one_engine_alone_runs_ops_and_shuts_down() -> None:
    topo = Topology(hostname="here", job_id=secrets.token_hex(4), secret=secrets.token_bytes(16))
    engine = Engine(topo, Settings(), LaneOwner(topo.rank, topo.size))
    engine.start()
    try:
        a = np.arange(10, dtype=np.float32)
        summed, gathered, sent = _allreduce("sum", a), _allgather("gather", a), _broadcast("bcast", a, 0)
        for entry in (summed, gathered, sent):
            engine.submit(entry)
        np.testing.assert_array_equal(_result(summed), a)
        np.testing.assert_array_equal(_result(gathered), a)
        np.testing.assert_array_equal(_result(sent), a)
    finally:
        engine.shutdown(timeout=5.0)
    with pytest.raises(Exception, match="shut"):
        engine.submit(_allreduce("late", np.zeros(1, np.float32)))


@pytest.mark.timeout(120)
def test_two_engines_in_threads_agree_on_every_result() -> None:
    size, secret, job = 2, secrets.token_bytes(16), secrets.token_hex(4)
    settings = Settings(start_timeout=30.0)
    with RendezvousServer(size, secret) as server, concurrent.futures.ThreadPoolExecutor(size) as pool:
        topos = [Topology(rank=r, size=size, local_rank=r, local_size=size, rendezvous=server.address, secret=secret,
                          job_id=job, hostname="here") for r in range(size)]
        # each constructor blocks in the rendezvous until both ranks arrived: build them side by side
        engines = list(pool.map(lambda t: Engine(t, settings, LaneOwner(t.rank, t.size)), topos))
        try:
            for e in engines:
                e.start()
            assert [int(p["rank"]) for p in engines[0].peer_table] == [0, 1]
            small = [np.full(8, r + 1, np.float32) for r in range(size)]  # reduced at rank 0 with the requests
            large = [np.arange(200_000, dtype=np.float64) * (r + 1) for r in range(size)]  # through the ring
            parts = [np.full((r + 1, 3), r, np.int32) for r in range(size)]  # uneven first dimensions
            roots = [np.full(5, 10 * r, np.int64) for r in range(size)]
            entries = [[_allreduce("small", small[r]), _allreduce("large", large[r]), _allgather("parts", parts[r]),
                        _broadcast("from1", roots[r], 1)] for r in range(size)]
            for r, e in enumerate(engines):
                for entry in (entries[r] if r == 0 else reversed(entries[r])):  # any order of submission
                    e.submit(entry)
            for r in range(size):
                got = [_result(entry) for entry in entries[r]]
                np.testing.assert_array_equal(got[0], np.full(8, 3, np.float32))
                np.testing.assert_array_equal(got[1], np.arange(200_000, dtype=np.float64) * 3)
                np.testing.assert_array_equal(got[2], np.concatenate(parts))
                np.testing.assert_array_equal(got[3], np.full(5, 10, np.int64))
        finally:
            list(pool.map(lambda e: e.shutdown(timeout=10.0), engines))  # collective: both at once


class RecordingLaneControl:
    """The engine's view of the lane's owner, recording what the engine asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def offer(self, *args: Any) -> dict[str, Any]:  # pragma: no cover - a job of one meets no one
        self.calls.append("offer")
        return {}

    def accept(self, *args: Any) -> None:  # pragma: no cover
        self.calls.append("accept")

    def stop_posting(self) -> None:
        self.calls.append("stop_posting")

    def release(self) -> None:
        self.calls.append("release")


@pytest.mark.timeout(60)
def test_the_engine_stops_the_lane_on_lane_off_and_releases_it_when_it_closes() -> None:
    topo = Topology(hostname="here", job_id=secrets.token_hex(4), secret=secrets.token_bytes(16))
    lane = RecordingLaneControl()
    engine = Engine(topo, Settings(), lane)
    engine.start()
    try:
        engine.lane_stalled("stuck")  # rank 0 answers every rank (here: itself) with LANE_OFF
        barrier = Entry(wire.Request("after", wire.BARRIER), [], Handle("after"))
        engine.submit(barrier)
        barrier.handle.wait(30.0)  # answered after the LANE_OFF: this rank has stopped posting by now
        assert lane.calls == ["stop_posting"]
    finally:
        engine.shutdown(timeout=5.0)
    assert lane.calls == ["stop_posting", "release"]
