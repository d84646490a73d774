"""The dispatcher's decision, where each op goes, and the order in which it starts and ends the lane and the engine.

In memory: a fake engine and a fake lane driver record what reaches them; one test runs the real
lane driver over the in-memory region, two ranks as threads.  What the engine asks of the lane's
owner (``LaneControl``) is tested with the engine (tests/core/test_engine.py).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ringcomm.core import wire
from ringcomm.core.naming import OpCall
from ringcomm.dispatch import Dispatcher
from ringcomm.errors import ShutdownError
from ringcomm.handles import Entry, Handle
from ringcomm.job.config import Settings
from ringcomm.lane.driver import LaneDriver
from ringcomm.lane.handle import LaneHandle
from ringcomm.lane.memory_region import MemoryBoard, MemoryLane

pytestmark = pytest.mark.pure


class FakeEngine:
    """Records the entries handed to it (and the order of the lifecycle calls, in ``calls``)."""

    def __init__(self, calls: list[str] | None = None, failure: BaseException | None = None) -> None:
        self.entries: list[Entry] = []
        self.calls = calls if calls is not None else []
        self.failure = failure
        self.timeline_active = False

    def submit(self, entry: Entry) -> Handle:
        if self.failure is not None:
            raise self.failure
        self.entries.append(entry)
        return entry.handle

    def start(self) -> None:
        self.calls.append("engine.start")

    def shutdown(self, timeout: float = 10.0) -> None:
        self.calls.append(f"engine.shutdown({timeout:g})")

    def lane_stalled(self, name: str) -> None:  # pragma: no cover - no op stalls here
        self.calls.append(f"engine.lane_stalled({name})")


class FakeLane:
    """A lane driver that takes an op (True) or hands it back (False), as told per op name."""

    def __init__(self, declines: set[str] | None = None) -> None:
        self.declines = declines or set()
        self.entries: list[tuple[Entry, int]] = []

    def submit(self, entry: Entry, others: int) -> bool:
        self.entries.append((entry, others))
        return entry.req.name not in self.declines


class FakeOwner:
    """The lane's owner: ``start`` returns ``lane`` (None: a job without a lane); records its calls."""

    def __init__(self, lane: Any, calls: list[str]) -> None:
        self.lane, self.calls = lane, calls
        self.started_with: tuple[Any, float, float] | None = None

    def start(self, engine: Any, stall_check: float, stall_shutdown: float) -> Any:
        self.calls.append("lane.start")
        self.started_with = (engine, stall_check, stall_shutdown)
        return self.lane

    def close(self, timeout: float) -> None:
        self.calls.append(f"lane.close({timeout:g})")

    def reopen_after_join(self, barrier: Any) -> None:
        self.calls.append("lane.reopen")
        barrier()


def dispatcher(lane: Any, calls: list[str] | None = None,
               engine_failure: BaseException | None = None) -> tuple[Dispatcher, FakeEngine]:
    calls = calls if calls is not None else []
    engine = FakeEngine(calls, engine_failure)
    d = Dispatcher(engine, FakeOwner(lane, calls), Settings(stall_check_seconds=7.0, stall_shutdown_seconds=9.0))
    d.start()
    return d, engine


def allreduce(name: str, pset: int = 0, n: int = 4) -> tuple[wire.Request, list[np.ndarray]]:
    x = np.ones(n, np.float32)
    return wire.Request(name, wire.ALLREDUCE, "float32", (x.shape,), 1, pset=pset), [x]


# -- where an op goes ------------------------------------------------------------------------


def test_an_op_of_the_global_set_goes_to_the_lane_and_only_there() -> None:
    lane = FakeLane()
    d, engine = dispatcher(lane)
    req, arrays = allreduce("g")
    outs: list[np.ndarray | None] = [None]
    handle = d.submit(req, arrays, outs, True, None, 3)
    assert isinstance(handle, LaneHandle) and handle.name == "g"
    [(entry, others)] = lane.entries
    assert others == 3 and entry.handle is handle and entry.req is req
    assert entry.arrays is arrays and entry.outs is outs and entry.grouped
    assert engine.entries == []


def test_an_op_the_lane_hands_back_goes_to_the_engine_with_the_same_entry() -> None:
    lane = FakeLane(declines={"big"})
    d, engine = dispatcher(lane)
    handle = d.submit(*allreduce("big"), [], False, None, 0)
    assert isinstance(handle, LaneHandle)  # the lane may still have posted its index for the engine
    assert [e for e, _ in lane.entries] == engine.entries and engine.entries[0].handle is handle


def test_an_op_of_another_process_set_never_reaches_the_lane() -> None:
    lane = FakeLane()
    d, engine = dispatcher(lane)
    handle = d.submit(*allreduce("s", pset=2), [], False, None, 0)
    assert type(handle) is Handle
    assert lane.entries == [] and [e.handle for e in engine.entries] == [handle]


def test_a_job_without_a_lane_sends_every_op_to_the_engine() -> None:
    d, engine = dispatcher(None)
    assert d.lane is None
    handles = [d.submit(*allreduce(f"op{p}", pset=p), [], False, None, 0) for p in (0, 1, 0)]
    assert all(type(h) is Handle for h in handles)
    assert [e.handle for e in engine.entries] == handles


def test_before_start_there_is_no_lane_to_send_to() -> None:
    engine = FakeEngine()
    d = Dispatcher(engine, FakeOwner(FakeLane(), []), Settings())
    assert type(d.submit(*allreduce("early"), [], False, None, 0)) is Handle and len(engine.entries) == 1


def test_the_handle_runs_on_done_once_the_op_finishes() -> None:
    released: list[str] = []
    d, engine = dispatcher(None)
    handle = d.submit(*allreduce("r"), [], False, lambda: released.append("r"), 0)
    assert released == []
    engine.entries[0].handle.set_result(None)
    assert released == ["r"] and handle.done()


def test_what_the_engine_raises_reaches_the_caller_with_the_handle_unfinished() -> None:
    released: list[str] = []
    for lane in (None, FakeLane(declines={"x"})):
        d, _ = dispatcher(lane, engine_failure=ShutdownError("shutting down"))
        with pytest.raises(ShutdownError):
            d.submit(*allreduce("x"), [], False, lambda: released.append("x"), 0)
    assert released == []  # the runtime releases the name itself


@settings(max_examples=60, deadline=None)
@given(has_lane=st.booleans(), ops=st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=12))
def test_every_op_lands_once_in_the_lane_or_the_engine(has_lane: bool, ops: list[tuple[int, bool]]) -> None:
    """An op of the global set in a job with a lane is the lane's (a LaneHandle) unless the lane hands
    it back; every other op is the engine's (a plain Handle); none is lost or sent twice."""
    lane = FakeLane(declines={f"op{i}" for i, (_, declined) in enumerate(ops) if declined})
    d, engine = dispatcher(lane if has_lane else None)
    handles = [d.submit(*allreduce(f"op{i}", pset), [], False, None, i) for i, (pset, _) in enumerate(ops)]
    in_lane = {id(e.handle) for e, _ in lane.entries}
    in_engine = [id(e.handle) for e in engine.entries]
    assert len(in_engine) == len(set(in_engine))
    for (pset, declined), h in zip(ops, handles):
        lane_op = has_lane and pset == 0
        assert isinstance(h, LaneHandle) == lane_op
        assert (id(h) in in_lane) == lane_op
        assert (id(h) in in_engine) == (not lane_op or declined)
    assert all(others == int(e.req.name[2:]) for e, others in lane.entries)


# -- refused calls ---------------------------------------------------------------------------


def test_a_refused_call_of_the_global_set_goes_through_the_lane_with_no_others() -> None:
    lane = FakeLane()
    d, engine = dispatcher(lane)
    req = OpCall(0, wire.ALLREDUCE, "bad", 0).refusal("dtype not supported")
    handle = d.refuse(req)
    [(entry, others)] = lane.entries
    assert isinstance(handle, LaneHandle) and entry.req.refused.endswith("dtype not supported") and others == 0
    assert entry.arrays == [] and engine.entries == []


def test_a_refused_call_the_lane_posted_for_the_engine_goes_to_the_engine() -> None:
    lane = FakeLane(declines={"bad"})
    d, engine = dispatcher(lane)
    handle = d.refuse(OpCall(0, wire.ALLREDUCE, "bad", 0).refusal("no"))
    assert [e.handle for e in engine.entries] == [handle]


def test_a_refused_call_of_a_process_set_or_without_a_lane_goes_to_the_engine() -> None:
    for lane, pset in ((FakeLane(), 1), (None, 0)):
        d, engine = dispatcher(lane)
        handle = d.refuse(OpCall(0, wire.BROADCAST, "bad", pset).refusal("root out of range"))
        assert type(handle) is Handle and [e.req.refused for e in engine.entries] == ["rank 0: root out of range"]
        assert lane is None or lane.entries == []


# -- the lifecycle ---------------------------------------------------------------------------


def test_the_engine_starts_before_the_lane_and_the_lane_closes_before_the_engine() -> None:
    calls: list[str] = []
    lane = FakeLane()
    d, engine = dispatcher(lane, calls)
    assert calls == ["engine.start", "lane.start"] and d.lane is lane
    assert d.lane_owner.started_with == (engine, 7.0, 9.0)
    d.reopen_after_join(lambda: calls.append("barrier"))
    d.shutdown(2.5)
    assert calls[2:] == ["lane.reopen", "barrier", "lane.close(2.5)", "engine.shutdown(2.5)"]


# -- with the real lane driver ------------------------------------------------------------------


class Exchange:
    """Where two fake engines meet: an op finishes on both once both handed it over (sum of the arrays)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, list[Entry]] = {}

    def arrive(self, entry: Entry) -> None:
        with self._lock:
            got = self._waiting.setdefault(entry.req.name, [])
            got.append(entry)
            if len(got) < 2:
                return
            del self._waiting[entry.req.name]
        total = sum(e.arrays[0] for e in got)
        for e in got:
            e.handle.set_result(total.copy())


class ExchangeEngine(FakeEngine):
    def __init__(self, exchange: Exchange) -> None:
        super().__init__()
        self.exchange = exchange

    def submit(self, entry: Entry) -> Handle:
        super().submit(entry)
        self.exchange.arrive(entry)
        return entry.handle


class DriverOwner(FakeOwner):
    """An owner whose ``start`` makes the real driver over one rank's view of an in-memory board."""

    def __init__(self, board: MemoryBoard, rank: int) -> None:
        super().__init__(None, [])
        self.board, self.rank = board, rank

    def start(self, engine: Any, stall_check: float, stall_shutdown: float) -> Any:
        self.lane = LaneDriver(MemoryLane(self.board, self.rank), engine, self.board.payload_bytes, stall_check,
                               stall_shutdown)
        return self.lane

    def close(self, timeout: float) -> None:
        self.lane.close(timeout)


@pytest.mark.timeout(60)
def test_two_ranks_small_ops_of_the_global_set_skip_the_engine_and_a_process_sets_do_not() -> None:
    board, exchange = MemoryBoard(2, 4, 4096), Exchange()
    engines = [ExchangeEngine(exchange) for _ in range(2)]
    ds = [Dispatcher(engines[r], DriverOwner(board, r), Settings(stall_check_seconds=0.0, stall_shutdown_seconds=0.0))
          for r in range(2)]
    for d in ds:
        d.start()
    results: list[list[np.ndarray]] = [[], []]

    def rank_body(r: int) -> None:
        for i in range(20):
            x = np.full(8, r + 1.0, np.float32)
            req = wire.Request(f"a{i}", wire.ALLREDUCE, "float32", (x.shape,), 1, pset=0 if i % 5 else 1)
            results[r].append(np.asarray(ds[r].submit(req, [x], [None], False, None, 0).wait(20.0)))

    threads = [threading.Thread(target=rank_body, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    try:
        assert not any(t.is_alive() for t in threads)
        for r in range(2):
            assert len(results[r]) == 20 and all((got == 3.0).all() for got in results[r])
            # the set's ops (every fifth) reached the engine; the global set's went fast, through the lane
            assert [e.req.name for e in engines[r].entries] == [f"a{i}" for i in range(0, 20, 5)]
    finally:
        for d in ds:
            d.shutdown(1.0)
