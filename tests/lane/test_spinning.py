"""The lane's spin budget: how many times a waiting rank re-reads a peer's counter before it sleeps.

In memory, no clock: a run of waits whose re-reads miss (a peer that is not running) spends the
budget in a few waits and leaves one short probe in every PROBE_EVERY; catches win it back.  Over
the in-memory region, a driver whose peer lags stops re-reading within a few ops.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
from hypothesis import given, strategies as st

from ringcomm.core import wire
from ringcomm.core.ops import ReduceOp
from ringcomm.handles import Entry
from ringcomm.lane import spinning
from ringcomm.lane.driver import LaneDriver
from ringcomm.lane.handle import LaneHandle
from ringcomm.lane.memory_region import MemoryBoard, MemoryLane
from ringcomm.lane.spinning import PROBE, PROBE_EVERY, SPINS, SpinBudget


def misses_to_spend(most: int) -> int:
    """Misses that take a full budget to nothing: halvings down to below two probes, then one."""
    return math.floor(math.log2(most / (2 * PROBE))) + 2 if most >= 2 * PROBE else 1


@given(st.integers(0, 2000), st.lists(st.sampled_from(["caught", "missed", "none"]), max_size=300))
def test_the_budget_stays_within_its_bounds_and_moves_the_way_the_last_wait_went(most, outcomes):
    b = SpinBudget(most)
    for outcome in outcomes:
        reads = b.reads()
        assert 0 <= reads <= most and 0 <= b.budget <= most
        before = b.budget
        if reads == 0 or outcome == "none":  # nothing re-read, or the post was there at the first read
            continue
        getattr(b, outcome)()
        assert (b.budget >= before if outcome == "caught" else b.budget <= before), (outcome, before, b.budget)
        assert b.budget == 0 or b.budget >= min(PROBE, most)
    if most == 0:
        assert b.reads() == 0 and b.budget == 0


@given(st.integers(1, 4000))
def test_a_peer_that_is_not_running_spends_the_budget_in_a_few_waits_then_only_probes(most):
    b = SpinBudget(most)
    spent_after = 0
    while b.budget:
        assert b.reads() == b.budget
        b.missed()
        spent_after += 1
    assert spent_after == misses_to_spend(most)
    reads = []
    for _ in range(3 * PROBE_EVERY):
        n = b.reads()
        reads.append(n)
        if n:
            b.missed()
    assert reads == ([0] * (PROBE_EVERY - 1) + [min(PROBE, most)]) * 3


@given(st.integers(1, 4000))
def test_a_probe_that_catches_wins_the_whole_budget_back_in_a_few_waits(most):
    b = SpinBudget(most)
    for _ in range(misses_to_spend(most)):
        b.reads()
        b.missed()
    while not b.reads():
        pass
    b.caught()
    steps = 1
    while b.budget < most:
        b.reads()
        b.caught()
        steps += 1
    assert steps <= math.ceil(math.log2(max(most / PROBE, 1))) + 1
    assert b.reads() == most


def test_the_defaults_spin_a_few_hundred_reads_and_probe_rarely():
    assert SpinBudget().reads() == SPINS == 400
    assert 0 < PROBE < SPINS and PROBE_EVERY >= 8


class CountingLane(MemoryLane):
    """The in-memory region as a shared-memory one: the driver re-reads before it sleeps; reads counted."""

    SPIN = True

    def __init__(self, board: MemoryBoard, rank: int) -> None:
        super().__init__(board, rank)
        self.reads = 0

    def still_missing(self, ranks, index, key):
        self.reads += 1
        return super().still_missing(ranks, index, key)


class NoEngine:
    failure = None
    timeline_active = False

    def submit(self, entry):  # pragma: no cover - every op here goes fast
        raise AssertionError(f"{entry.req.name} left the lane")

    def lane_stalled(self, name):  # pragma: no cover
        raise AssertionError(name)


def test_a_driver_whose_peer_lags_stops_re_reading_within_a_few_ops(monkeypatch):
    monkeypatch.setattr(spinning, "available_cores", lambda: 2)
    board = MemoryBoard(2, 4, 4096)
    regions = [CountingLane(board, r) for r in range(2)]
    drivers = [LaneDriver(regions[r], NoEngine(), 4096, 0.0, 0.0) for r in range(2)]
    per_op: list[int] = []

    def op(rank: int, i: int) -> np.ndarray:
        x = np.full(4, float(rank + i), dtype=np.float32)
        e = Entry(wire.Request(f"op{i}", wire.ALLREDUCE, "float32", ((4,),), int(ReduceOp.SUM)), [x], LaneHandle(f"op{i}"))
        assert drivers[rank].submit(e, 0)
        return e.handle.wait(10)

    def peer() -> None:
        for i in range(12):
            time.sleep(0.01)  # rank 0 waits for each of these: its re-reads miss
            op(1, i)

    t = threading.Thread(target=peer, daemon=True)
    t.start()
    try:
        for i in range(12):
            before = regions[0].reads
            got = op(0, i)
            per_op.append(regions[0].reads - before)
            assert np.array_equal(got, np.full(4, 2.0 * i + 1, dtype=np.float32))
        t.join(10)
    finally:
        for d in drivers:
            d.close(timeout=1.0)
    # the first waits re-read hundreds of times; once the budget is spent a wait reads a few times
    assert per_op[0] > SPINS // 2, per_op
    spent = misses_to_spend(SPINS)
    assert max(per_op[spent + 1:]) < PROBE + 4, per_op
