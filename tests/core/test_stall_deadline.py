"""Rank 0's service at the stall deadline, in memory: an op completes on every rank or fails on every rank.

The service is fed every rank's announcements (rank 0's own, the others' as signed frames) in any
order, between clock ticks; ranks may submit an op long after the others, or have waited for it
already (an op their small-op lane handed on).  What each rank would execute is read from the
service's output as the engine reads it: a response completes the ops the rank has in flight, and
a rank that has not submitted an op must never be sent its result.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from ringcomm.core import wire
from ringcomm.core.service import HAND_OVER_SECONDS, Service
from ringcomm.core.wire import Request, Response

pytestmark = pytest.mark.pure

SECRET = b"d" * 32
CHECK, DEADLINE = 2.0, 5.0
OPS = {"a": Request("a", wire.ALLREDUCE, "float32", ((4,),), 1), "b": Request("b", wire.BROADCAST, "int64", ((3,),),
       root=0), "c": Request("c", wire.ALLREDUCE, "float64", ((2, 2),), 1)}


class Job:
    """The service and what each rank has in flight and got back."""

    def __init__(self, size: int) -> None:
        self.size, self.now = size, 0.0
        self.svc = Service(size, SECRET, fusion_threshold=1 << 20, small_bytes=0, cache_capacity=0)
        self.inflight: list[set[str]] = [set() for _ in range(size)]
        self.outcome: list[dict[str, str]] = [{} for _ in range(size)]  # name -> "ok" or the error
        self.arrivals: dict[str, list[tuple[float, float]]] = {}  # name -> (arrived, waited before)
        self.lane_off = 0

    def submit(self, rank: int, name: str, waited: float) -> None:
        self.inflight[rank].add(name)
        self.arrivals.setdefault(name, []).append((self.now, waited))
        if rank == 0:
            self.svc.submit_local(OPS[name], [], self.now, waited)
        else:
            (frame,) = wire.encode_requests(SECRET, rank, [(OPS[name], 0, None, waited)])
            self.svc.receive(frame, self.now)
        self.turn()

    def tick(self, dt: float) -> None:
        self.now += dt
        self.turn()

    def turn(self) -> None:
        """One turn of rank 0's loop: answer what is ready, then check for stalls (and answer again)."""
        for _ in range(2):
            emitted = self.svc.take(self.now)
            for resp, members in emitted.pairs if emitted is not None else []:
                self.deliver(resp, members)
            self.svc.stalls(self.now, CHECK, DEADLINE)

    def deliver(self, resp: Response, members: tuple[int, ...]) -> None:
        if resp.kind == wire.LANE_OFF:
            assert members == tuple(range(self.size))
            self.lane_off += 1
            return
        for r in members:
            for name in resp.names:
                assert name in self.inflight[r], f"rank {r} was sent {name!r}, which it has not submitted"
                self.inflight[r].discard(name)
                assert name not in self.outcome[r]
                self.outcome[r][name] = resp.error or "ok"


events = st.lists(st.one_of(st.tuples(st.just("tick"), st.sampled_from([0.3, 1.0, 2.5, 4.0, 6.0])),
                            st.tuples(st.just("submit"), st.integers(0, 3), st.sampled_from([0.0, 0.0, 1.5, 6.0]))),
                  max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 4), st.data(), events)
def test_an_op_runs_on_every_rank_or_fails_on_every_rank_whatever_the_order(size, data, script) -> None:
    job = Job(size)
    orders = [data.draw(st.permutations(sorted(OPS)), label=f"order of rank {r}") for r in range(size)]
    for event in script:
        if event[0] == "tick":
            job.tick(event[1])
        elif orders[event[1] % size]:
            job.submit(event[1] % size, orders[event[1] % size].pop(0), event[2])
    for r in range(size):  # every late rank comes in the end
        while orders[r]:
            job.submit(r, orders[r].pop(0), 0.0)
    job.tick(DEADLINE + HAND_OVER_SECONDS + 1)
    for name in OPS:
        got = {job.outcome[r].get(name) for r in range(size)}
        assert None not in got, f"{name!r} never finished on some rank: {[o.get(name) for o in job.outcome]}"
        assert len(got) == 1, f"{name!r}: the ranks disagree: {got}"
        (result,) = got
        first = min(t - w for t, w in job.arrivals[name])
        last = max(t for t, _ in job.arrivals[name])
        if last - first < DEADLINE:  # every rank came within the deadline: never failed
            assert result == "ok", result
        if result != "ok":
            assert result.startswith(f"stalled: {OPS[name].kind} '{name}' was submitted by ranks")
            assert f"RINGCOMM_STALL_SHUTDOWN_SECONDS={DEADLINE:g}" in result
    failed = [n for n in OPS if job.outcome[0][n] != "ok"]
    assert job.lane_off >= (1 if failed else 0)  # a failed op of the global set stops every rank's lane


def test_the_late_rank_gets_the_error_the_others_got_and_then_the_name_runs_again() -> None:
    job = Job(3)
    job.submit(0, "a", 0.0)
    job.submit(1, "a", 0.0)
    job.tick(DEADLINE + 0.1)
    error = job.outcome[0]["a"]
    assert job.outcome[1]["a"] == error and "a" not in job.outcome[2]
    assert "ranks [0, 1]" in error and "ranks [2] have not submitted it" in error and "rank 2 gets" in error
    job.tick(100.0)
    job.submit(2, "a", 0.0)  # much later: still that op
    assert job.outcome[2]["a"] == error
    for r in range(3):  # the name is free again: its next instance runs as usual
        del job.outcome[r]["a"]
        job.submit(r, "a", 0.0)
    assert [job.outcome[r]["a"] for r in range(3)] == ["ok"] * 3


def test_ops_a_small_op_lane_handed_over_fail_once_every_waiting_rank_has_handed_it_over() -> None:
    job = Job(3)
    job.submit(0, "a", DEADLINE + 0.2)  # its lane waited past the deadline; rank 1's lane is about to
    job.tick(0.1)
    assert "a" not in job.outcome[0]  # rank 1 may still hand it over: the error would miss it
    job.submit(1, "a", DEADLINE)
    job.tick(HAND_OVER_SECONDS)
    assert job.outcome[0]["a"] == job.outcome[1]["a"]
    assert "ranks [0, 1]" in job.outcome[0]["a"] and "ranks [2] have not" in job.outcome[0]["a"]


def test_a_wait_is_warned_about_every_check_period_with_the_time_waited() -> None:
    svc = Service(2, SECRET, fusion_threshold=1 << 20, small_bytes=0, cache_capacity=0)
    svc.submit_local(OPS["a"], [], 0.0)
    texts = []
    for now in [0.5 * i for i in range(1, 14)]:  # 0.5 .. 6.5 s, the deadline off
        texts += [text for _, text in svc.stalls(now, CHECK, 0.0)]
    assert [t.split(" s ago")[0].rsplit(" ", 1)[1] for t in texts] == ["2.0", "4.0", "6.0"]
    assert all("ranks [1] have not submitted it" in t and "fails on every rank" not in t for t in texts)
    (text,) = [t for _, t in svc.stalls(60.0, CHECK, 1800.0)]
    assert "60 s ago" in text and "once it has waited 1800 s (RINGCOMM_STALL_SHUTDOWN_SECONDS)" in text


def test_a_join_or_a_shutdown_is_never_a_stall() -> None:
    svc = Service(2, SECRET, fusion_threshold=1 << 20, small_bytes=0, cache_capacity=0)
    svc.submit_local(Request("__join__", wire.JOIN), [], 0.0)  # rank 1 still trains on its last batches
    assert svc.stalls(3600.0, CHECK, DEADLINE) == [] and svc.take(3600.0) is None


def test_the_deadline_defaults_to_30_minutes_and_an_explicit_setting_wins() -> None:
    from ringcomm.job.config import Settings

    assert Settings.from_env({}).stall_shutdown_seconds == 1800.0
    assert Settings.from_env({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}).stall_shutdown_seconds == 0.0
    assert Settings.from_env({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"}).stall_shutdown_seconds == 5.0
    assert Settings.from_env({"RINGCOMM_STALL_SHUTDOWN_SECONDS": "7",
                              "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}).stall_shutdown_seconds == 7.0
    off = Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1"})
    assert off.stall_shutdown_seconds == 0.0 and off.stall_check_seconds == float("inf")
