"""The lane's driver over the in-memory region: N ranks as threads of one process, no OS resource.

Each simulated rank has a :class:`~ringcomm.lane.driver.LaneDriver` over its view of one
:class:`~ringcomm.lane.memory_region.MemoryBoard` and a fake engine side that records what the
lane diverts to it; the ranks' fake engines meet in an :class:`Exchange`, which completes an op
once every rank handed it over (matching by name, in any order, as rank 0's negotiation does)
with the reference arithmetic of :mod:`ringcomm.core.lane`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ringcomm.core import lane, ops, wire
from ringcomm.core.ops import ReduceOp
from ringcomm.errors import HorovodInternalError, PeerLostError, ShutdownError
from ringcomm.handles import Entry, Handle
from ringcomm.lane.driver import LaneDriver
from ringcomm.lane.handle import LaneHandle
from ringcomm.lane.memory_region import MemoryBoard, MemoryLane
from ringcomm.lane.records import State
from ringcomm.lane.shm_lane import ShmLane
from ringcomm.lane.net_lane import NetLane


def reference(req: wire.Request, per_rank: list[list[np.ndarray]], size: int) -> Any:
    """What every rank must get for ``req``, from every rank's arrays: rank 0's small-path arithmetic."""
    if req.kind in (wire.BARRIER, wire.JOIN):
        return None
    assert req.kind == wire.ALLREDUCE
    op = ReduceOp(req.op)
    flat = [np.concatenate([a.reshape(-1) for a in arrays]) for arrays in per_rank]
    reduced = lane.reduce_ordered(op, flat, req.prescale, ops.postscale(op, size, req.postscale))
    return reduced.reshape(per_rank[0][0].shape)


class Exchange:
    """Where the ranks' fake engines meet: an op finishes on every rank once all handed it over."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._waiting: dict[str, dict[int, Entry]] = {}

    def arrive(self, rank: int, entry: Entry) -> None:
        with self._lock:
            got = self._waiting.setdefault(entry.req.name, {})
            got[rank] = entry
            if len(got) < self.size:
                return
            del self._waiting[entry.req.name]
        entries = [got[r] for r in range(self.size)]
        result = reference(entry.req, [e.arrays for e in entries], self.size)
        for e in entries:
            e.handle.set_result(None if result is None else result.copy())


class FakeEngine:
    """One rank's engine side: records what the lane diverts, hands it to the exchange."""

    def __init__(self, rank: int, exchange: Exchange) -> None:
        self.rank, self._exchange = rank, exchange
        self.diverted: list[str] = []
        self.waited: dict[str, float] = {}  # what the lane told the engine each op had waited
        self.stalled: list[str] = []  # ops the lane reported past the stall deadline
        self.failure: BaseException | None = None
        self.timeline_active = False

    def lane_stalled(self, name: str) -> None:
        self.stalled.append(name)  # the real engine tells rank 0, which stops every rank's lane

    def submit(self, entry: Entry) -> Handle:
        if self.failure is not None:
            raise self.failure
        self.diverted.append(entry.req.name)
        self.waited[entry.req.name] = entry.waited
        self._exchange.arrive(self.rank, entry)
        return entry.handle


class Job:
    """``size`` simulated ranks over one in-memory board."""

    def __init__(self, size: int, slots: int = 4, payload_bytes: int = 4096, stall_check: float = 0.0,
                 stall_shutdown: float = 0.0, reduce_bytes: int | None = None) -> None:
        self.size = size
        self.board = MemoryBoard(size, slots, payload_bytes)
        self.exchange = Exchange(size)
        self.engines = [FakeEngine(r, self.exchange) for r in range(size)]
        # reduce_bytes: the reductions' bound, below the entries that broadcasts and the like fill
        self.drivers = [LaneDriver(MemoryLane(self.board, r), self.engines[r],
                                   payload_bytes if reduce_bytes is None else reduce_bytes, stall_check,
                                   stall_shutdown, move_bytes=payload_bytes) for r in range(size)]

    def submit(self, rank: int, entry: Entry, others: int) -> Handle:
        """As the runtime does: the lane, or the engine when the lane hands the op back."""
        if not self.drivers[rank].submit(entry, others):
            self.engines[rank].submit(entry)
        return entry.handle

    def close(self) -> None:
        for d in self.drivers:
            d.close(timeout=1.0)


def allreduce(name: str, x: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> Entry:
    return Entry(wire.Request(name, wire.ALLREDUCE, x.dtype.name, (x.shape,), int(op)), [x], LaneHandle(name))


def barrier(name: str) -> Entry:
    return Entry(wire.Request(name, wire.BARRIER), [], LaneHandle(name))


def run_ranks(size: int, body: Any, timeout: float = 30.0) -> list[Any]:
    """``body(rank)`` on one thread per rank; their return values, or the first error raised."""
    out: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a simulated rank did not finish"
    if errors:
        raise errors[0]
    return out


def values(rank: int, i: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * i + rank)
    if dtype.startswith("int"):
        return rng.integers(-50, 50, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def same_bits(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# -- the region ------------------------------------------------------------------------------


def test_every_region_offers_what_the_driver_uses() -> None:
    data = set(lane.LaneRegion.__annotations__)  # set per instance: rank, size, slots (SPIN per class)
    methods = {m for m, v in vars(lane.LaneRegion).items() if callable(v) and not m.startswith("_")}
    assert {"SPIN", "rank", "size", "slots"} == data
    assert {"post", "seen", "sleep_on_posted", "all_read_below", "set_read_below", "close"} <= methods
    for cls in (ShmLane, NetLane, MemoryLane):
        missing = sorted(m for m in methods | {"SPIN"} if not callable(getattr(cls, m, None)) and m != "SPIN")
        assert not missing and isinstance(cls.SPIN, bool), f"{cls.__name__} lacks {missing} of LaneRegion"
    region = MemoryLane(MemoryBoard(2, 4, 64), 1)
    assert isinstance(region, lane.LaneRegion)
    assert not isinstance(object(), lane.LaneRegion)


def test_the_memory_region_catches_a_slot_rewritten_before_a_rank_read_it() -> None:
    board = MemoryBoard(2, 2, 64)
    mine, peer = MemoryLane(board, 0), MemoryLane(board, 1)
    x = np.arange(4, dtype=np.float32)
    mine.post(0, 7, True, [x])
    assert peer.seen(0, 0) == lane.Seen(True, False, True, 7, 16)
    assert peer.fast_sizes(0, 7, 16) == [16, 16] and peer.still_missing([0], 0, 7) == []
    assert same_bits(peer.typed_parts(0, [16, 0], np.dtype(np.float32))[0], x)
    mine.post(1, 8, False, [])
    mine.post(2, 9, True, [x])  # slot 0 again, though rank 1 never said it read index 0
    with pytest.raises(HorovodInternalError, match="rewritten"):
        peer.seen(0, 0)
    assert peer.key_at(0, 0) is None and peer.key_at(0, 2) == 9
    with pytest.raises(ValueError, match="does not fit"):
        mine.post(3, 1, True, [np.zeros(17, np.float32)])


# -- the driver ------------------------------------------------------------------------------

OPS = st.tuples(st.sampled_from([1, 3, 16, 300, 1500]), st.sampled_from(["float32", "float64", "int32"]),
                st.sampled_from([ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVERAGE, ReduceOp.PRODUCT]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(2, 3), plan=st.lists(OPS, min_size=1, max_size=10),
       batches=st.lists(st.integers(1, 3), min_size=3, max_size=3), reverse=st.lists(st.booleans(), min_size=3,
                                                                                       max_size=3))
def test_results_are_bitwise_the_reference_arithmetic_whatever_each_rank_keeps_in_flight(size, plan, batches,
                                                                                          reverse) -> None:
    """Every rank submits the same ops in the same order, but each keeps its own number in flight
    and waits for them in its own order: fast or diverted, every result is the reference's."""
    plan = [(n, dt, ReduceOp.SUM if op == ReduceOp.AVERAGE and dt == "int32" else op) for n, dt, op in plan]
    job = Job(size)

    def rank_body(rank: int) -> list[np.ndarray]:
        results: list[Any] = [None] * len(plan)
        batch = batches[rank]
        for start in range(0, len(plan), batch):
            chunk = list(range(start, min(start + batch, len(plan))))
            handles = []
            for j, i in enumerate(chunk):
                n, dt, op = plan[i]
                handles.append((i, job.submit(rank, allreduce(f"op{i}", values(rank, i, n, dt), op), others=j)))
            for i, h in (reversed(handles) if reverse[rank] else handles):
                results[i] = h.wait(timeout=20)
        return results

    try:
        got = run_ranks(size, rank_body)
    finally:
        job.close()
    for i, (n, dt, op) in enumerate(plan):
        req = allreduce(f"op{i}", values(0, i, n, dt), op).req
        want = reference(req, [[values(r, i, n, dt)] for r in range(size)], size)
        for r in range(size):
            assert same_bits(got[r][i], want), f"rank {r}, op {i}: {got[r][i]} != {want}"
    small = all(n * np.dtype(dt).itemsize <= 4096 for n, dt, _ in plan)
    if small and all(b == 1 for b in batches[:size]):  # nothing else in flight: nothing to disagree on
        assert not any(e.diverted for e in job.engines)


def test_ops_beyond_the_slots_are_queued_and_never_block_the_submitter() -> None:
    job = Job(2, slots=4)
    try:
        started = time.monotonic()
        mine = [job.submit(0, allreduce(f"x{i}", values(0, i, 8, "float32")), others=0) for i in range(10)]
        assert time.monotonic() - started < 1.0  # rank 1 posted nothing: 6 of them wait in the queue
        assert not any(h.done() for h in mine)

        def rank1(_: int) -> list[Any]:
            return [job.submit(1, allreduce(f"x{i}", values(1, i, 8, "float32")), others=0).wait(20)
                    for i in range(10)]
        theirs = run_ranks(1, rank1)[0]
        for i in range(10):
            want = reference(allreduce(f"x{i}", values(0, i, 8, "float32")).req,
                             [[values(r, i, 8, "float32")] for r in range(2)], 2)
            assert same_bits(mine[i].wait(20), want) and same_bits(theirs[i], want)
        assert job.engines[0].diverted == [] and job.engines[1].diverted == []
    finally:
        job.close()


def test_a_lagging_rank_does_not_make_another_ranks_submit_wait() -> None:
    job = Job(3)
    lag = 0.5
    took: dict[int, float] = {}

    def body(rank: int) -> list[Any]:
        if rank == 2:
            time.sleep(lag)
        started = time.monotonic()
        a = job.submit(rank, allreduce("a", values(rank, 0, 4, "float64")), others=0)
        b = job.submit(rank, allreduce("b", values(rank, 1, 4, "float64")), others=1)  # a still in flight
        took[rank] = time.monotonic() - started
        return [a.wait(20), b.wait(20)]
    try:
        got = run_ranks(3, body)
    finally:
        job.close()
    assert took[0] < lag / 2 and took[1] < lag / 2, took
    for i, name in enumerate("ab"):
        want = reference(allreduce(name, values(0, i, 4, "float64")).req,
                         [[values(r, i, 4, "float64")] for r in range(3)], 3)
        assert all(same_bits(got[r][i], want) for r in range(3))


def test_an_op_the_lane_cannot_take_goes_to_the_engine_on_every_rank() -> None:
    job = Job(2, payload_bytes=64)
    try:
        # too large for a slot: each rank hands it to the engine itself
        big = [allreduce("big", values(r, 0, 100, "float32")) for r in range(2)]
        assert [job.drivers[r].submit(big[r], others=0) for r in range(2)] == [False, False]
        for r in range(2):
            job.engines[r].submit(big[r])
        want = reference(big[0].req, [[e.arrays[0]] for e in big], 2)
        assert all(same_bits(e.handle.wait(5), want) for e in big)
        # a timeline is written on rank 1: it posts nothing fast, so rank 0's fast op diverts too
        job.engines[1].timeline_active = True
        small = [allreduce("small", values(r, 1, 4, "float32")) for r in range(2)]
        got = run_ranks(2, lambda r: job.submit(r, small[r], others=0).wait(10))
        want = reference(small[0].req, [[e.arrays[0]] for e in small], 2)
        assert all(same_bits(g, want) for g in got)
        assert "small" in job.engines[0].diverted and "small" in job.engines[1].diverted
        job.engines[1].timeline_active = False
        # the ranks submit two ops in opposite orders: both indices divert, the engine pairs them by name
        def crossed(rank: int) -> list[Any]:
            names = ["p", "q"] if rank == 0 else ["q", "p"]
            hs = {n: job.submit(rank, allreduce(n, values(rank, ord(n), 4, "float32")), others=j)
                  for j, n in enumerate(names)}
            return [hs["p"].wait(10), hs["q"].wait(10)]
        got = run_ranks(2, crossed)
        for i, n in enumerate("pq"):
            want = reference(allreduce(n, values(0, ord(n), 4, "float32")).req,
                             [[values(r, ord(n), 4, "float32")] for r in range(2)], 2)
            assert same_bits(got[0][i], want) and same_bits(got[1][i], want)
        assert {"p", "q"} <= set(job.engines[0].diverted) and {"p", "q"} <= set(job.engines[1].diverted)
    finally:
        job.close()


def test_a_broadcast_between_the_two_bounds_goes_fast_where_an_allreduce_of_its_size_diverts() -> None:
    job = Job(2, payload_bytes=512, reduce_bytes=64)
    try:
        x = [values(r, 3, 100, "float32") for r in range(2)]  # 400 B: above the reductions' bound
        bcast = [Entry(wire.Request("b", wire.BROADCAST, "float32", ((100,),), root=1), [x[r]], LaneHandle("b"))
                 for r in range(2)]
        got = run_ranks(2, lambda r: job.submit(r, bcast[r], others=0).wait(10))
        assert all(same_bits(g, x[1]) for g in got)
        big = [allreduce("big", x[r]) for r in range(2)]
        got = run_ranks(2, lambda r: job.submit(r, big[r], others=0).wait(10))
        want = reference(big[0].req, [[e.arrays[0]] for e in big], 2)
        assert all(same_bits(g, want) for g in got)
        assert all(e.diverted == ["big"] for e in job.engines), [e.diverted for e in job.engines]
    finally:
        job.close()


def test_a_large_payload_is_not_copied_in_once_a_peer_has_posted_its_index_for_the_engine() -> None:
    from ringcomm.lane.driver import LOOK_FIRST_BYTES

    n = LOOK_FIRST_BYTES // 4
    job = Job(2, payload_bytes=LOOK_FIRST_BYTES + 4096)
    try:
        # rank 1's alltoall is over the bound (it splits otherwise): it posts the index for the engine
        # first; rank 0's fits, but it sees that and posts the index for the engine too, copying nothing
        sends = [[n // 2, n // 2], [n, n]]
        x = [np.arange(sum(sends[r]), dtype=np.float32) + 1000 * r for r in range(2)]
        entries = [Entry(wire.Request("x", wire.ALLTOALL, "float32", ((sum(sends[r]),),), splits=tuple(sends[r])),
                         [x[r]], LaneHandle("x")) for r in range(2)]
        assert job.drivers[1].submit(entries[1], others=0) is False  # the caller hands it to the engine
        assert job.drivers[0].submit(entries[0], others=0) is False  # so does rank 0's
        assert not job.board.payloads[0][0].any()  # its slot was not written
        assert [h[2] for h in (job.board.heads[0][0], job.board.heads[1][0])] == [False, False]  # posted not fast
    finally:
        job.close()


def test_a_join_closes_the_lane_and_every_rank_reopens_it_from_index_zero() -> None:
    job = Job(2)

    def body(rank: int) -> list[Any]:
        drv = job.drivers[rank]
        before = job.submit(rank, allreduce("before", values(rank, 0, 4, "float32")), others=0).wait(10)
        join = Entry(wire.Request("join", wire.JOIN), [], LaneHandle("join"))
        assert not drv.submit(join, others=0)  # a joined rank posts no more: the engine runs the join
        job.engines[rank].submit(join)
        join.handle.wait(10)
        assert drv.state is State.CLOSED
        closed = allreduce("while-closed", values(rank, 1, 4, "float32"))
        assert not drv.submit(closed, others=0)
        job.engines[rank].submit(closed)
        drv.reopen_after_join(lambda: job.submit(rank, barrier("rejoin"), others=0).wait(10))
        assert drv.state is State.OPEN
        after = job.submit(rank, allreduce("after", values(rank, 2, 4, "float32")), others=0).wait(10)
        return [before, closed.handle.wait(10), after]
    try:
        got = run_ranks(2, body)
    finally:
        job.close()
    for i, name in enumerate(["before", "while-closed", "after"]):
        want = reference(allreduce(name, values(0, i, 4, "float32")).req,
                         [[values(r, i, 4, "float32")] for r in range(2)], 2)
        assert same_bits(got[0][i], want) and same_bits(got[1][i], want)
    for e in job.engines:  # the join, the op while closed and the barrier; nothing fast went there
        assert e.diverted == ["join", "while-closed", "rejoin"]
    assert job.board.posted == [1, 1]  # "after" took index 0 again


def test_a_closed_rank_makes_the_others_divert_and_fails_what_it_posted_alone() -> None:
    job = Job(2)
    try:
        lonely = job.submit(0, allreduce("lonely", values(0, 0, 4, "float32")), others=0)
        started = time.monotonic()
        job.drivers[0].close(timeout=0.2)  # rank 1 never posts index 0
        assert time.monotonic() - started < 5
        with pytest.raises(ShutdownError, match="rank 0: ringcomm was shut down while op 'lonely'"):
            lonely.wait(1)
        assert job.drivers[0].state is State.CLOSED
        # rank 1's op at index 0 meets rank 0's fast one, which rank 0 gave up: it resolves as fast
        # on rank 1 (rank 0 posted it), and its next op, at an index rank 0 never posts, diverts
        first = job.submit(1, allreduce("lonely", values(1, 0, 4, "float32")), others=0)
        assert first.wait(5) is not None
        nxt = job.submit(1, allreduce("next", values(1, 1, 4, "float32")), others=0)
        with pytest.raises(TimeoutError):
            nxt.wait(0.3)  # diverted: the engine holds it until rank 0 hands it over too
        assert job.engines[1].diverted == ["next"]
    finally:
        job.close()


def test_an_engine_failure_ends_what_waits_in_the_lane_and_names_the_missing_rank() -> None:
    job = Job(2, slots=1)
    try:
        x = job.submit(0, allreduce("x", values(0, 0, 4, "float32")), others=0)
        y = job.submit(0, allreduce("y", values(0, 1, 4, "float32")), others=0)  # no free slot: queued
        lost = PeerLostError("rank 0: rank 1 was lost (its process ended)")
        job.engines[0].failure = lost
        with pytest.raises(PeerLostError, match=r"rank 1 was lost.*'x' was waiting in the small-op lane for rank\(s\) \[1\]"):
            x.wait(5)
        with pytest.raises(PeerLostError, match="rank 1 was lost"):
            y.wait(5)
    finally:
        job.close()


def stop_every_lane(job: Job) -> None:
    """What rank 0 does once a lane reports a stall: every rank stops posting (the engines' LANE_OFF)."""
    for d in job.drivers:
        d.stop_posting()


def test_a_lane_op_past_the_stall_deadline_is_handed_to_the_engine_on_every_rank_never_failed_alone(caplog) -> None:
    job = Job(2, stall_check=0.1, stall_shutdown=0.35)
    try:
        with caplog.at_level("WARNING", logger="ringcomm.lane.driver"):
            h = job.submit(0, allreduce("stuck", values(0, 0, 4, "float32")), others=0)
            with pytest.raises(TimeoutError):
                h.wait(0.6)  # past the deadline: reported, this rank posts no more, the op still waits
        assert job.engines[0].stalled == ["stuck"] and job.drivers[0].state is State.OFF
        assert not h.done() and job.engines[0].diverted == []  # rank 1 may still post it: not decided
        warnings = [r.getMessage() for r in caplog.records if "'stuck'" in r.getMessage()]
        assert len(warnings) >= 3, warnings  # one per check period, with the time waited
        assert "ranks [1] have not submitted it" in warnings[0] and "once it has waited 0.35 s" in warnings[0]
        stop_every_lane(job)  # rank 0's answer reaches rank 1 before it submits the op
        late = allreduce("stuck", values(1, 0, 4, "float32"))
        assert not job.drivers[1].submit(late, others=0)  # off: its op goes to the engine...
        job.engines[1].submit(late)
        got = h.wait(5)  # ...and so does rank 0's (the index diverts): the engine decides for both
        assert job.engines[0].diverted == ["stuck"] and job.engines[0].waited["stuck"] >= 0.35
        np.testing.assert_array_equal(got, late.handle.wait(1))
    finally:
        job.close()


def test_a_late_rank_that_posted_before_it_stopped_finishes_the_op_on_every_rank() -> None:
    job = Job(2, stall_check=0.05, stall_shutdown=0.1)
    try:
        h = job.submit(0, allreduce("x", values(0, 0, 4, "float32")), others=0)
        with pytest.raises(TimeoutError):
            h.wait(0.3)
        assert job.engines[0].stalled == ["x"]
        h1 = job.submit(1, allreduce("x", values(1, 0, 4, "float32")), others=0)  # posted before it heard
        stop_every_lane(job)
        want = reference(wire.Request("x", wire.ALLREDUCE, "float32", ((4,),), int(ReduceOp.SUM)),
                         [[values(0, 0, 4, "float32")], [values(1, 0, 4, "float32")]], 2)
        np.testing.assert_array_equal(h.wait(5), want)  # every slot posted it fast: done, on both ranks
        np.testing.assert_array_equal(h1.wait(5), want)
        assert job.engines[0].diverted == job.engines[1].diverted == []
        nxt = allreduce("next", values(0, 1, 4, "float32"))
        assert not job.drivers[0].submit(nxt, others=0)  # off until the next join: the engine's
    finally:
        job.close()
