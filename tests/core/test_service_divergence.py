"""Rank 0's service ends a deadlock between ranks that diverged (a test failed on some ranks only).

The ranks that failed wait in a barrier (a suite's tear-down); the others wait in the next op of
the test, for them.  Once that op has waited the stall-check time, it fails on its ranks, which
then reach the barrier: every rank is in step again.  No sockets: the service is fed requests.
"""

from __future__ import annotations

import pytest

from ringcomm.core import wire
from ringcomm.core.service import Service
from ringcomm.core.wire import Request

pytestmark = pytest.mark.pure

CHECK = 5.0


def service(size: int) -> Service:
    return Service(size, b"k" * 32, fusion_threshold=1 << 20, small_bytes=0, cache_capacity=8)


def rs(name: str) -> Request:
    return Request(name, wire.REDUCESCATTER, "float32", ((6,),), 1, -1, 1.0, 1.0)


def barrier(name: str) -> Request:
    return Request(name, wire.BARRIER)


def test_op_waiting_for_ranks_in_a_barrier_fails_and_the_barrier_goes_on() -> None:
    svc = service(3)
    svc.controller.submit(1, rs("rs.7"), now=0.0)  # rank 1 passed its check and goes on
    svc.controller.submit(0, barrier("b.0"), now=1.0)  # ranks 0 and 2 failed it: tear-down barrier
    svc.controller.submit(2, barrier("b.0"), now=1.0)
    assert svc.stalls(now=4.0, check_seconds=CHECK, shutdown_seconds=0.0) == []
    svc.stalls(now=5.5, check_seconds=CHECK, shutdown_seconds=0.0)
    emitted = svc.take(now=5.5)
    assert emitted is not None
    # every rank stops posting to the small-op lane (its indexes no longer line up), then the op fails
    (off, everyone), (resp, members) = emitted.pairs
    assert off.kind == wire.LANE_OFF and everyone == (0, 1, 2)
    assert resp.names == ("rs.7",) and members == (0, 1, 2) and resp.error_kind == "stall"
    assert "diverged" in resp.error and "barrier 'b.0'" in resp.error and "ranks [0, 2]" in resp.error
    svc.controller.submit(1, barrier("b.0"), now=6.0)  # rank 1 raised and reaches the barrier
    emitted = svc.take(now=6.0)
    assert emitted is not None
    ((resp, _),) = emitted.pairs
    assert resp.names == ("b.0",) and not resp.error


def test_op_waiting_for_a_busy_rank_only_warns() -> None:
    svc = service(2)
    svc.controller.submit(0, rs("rs.1"), now=0.0)  # rank 1 computes: no barrier anywhere
    (warning,) = svc.stalls(now=60.0, check_seconds=CHECK, shutdown_seconds=0.0)
    assert warning[0] == (0, "rs.1") and svc.take(now=60.0) is None


def test_barrier_that_misses_a_rank_outside_the_op_is_no_deadlock() -> None:
    svc = service(3)
    svc.controller.submit(0, rs("rs.1"), now=0.0)
    svc.controller.submit(1, barrier("b.0"), now=0.0)  # rank 2 has reached neither: it may be slow
    warnings = svc.stalls(now=60.0, check_seconds=CHECK, shutdown_seconds=0.0)
    assert {key for key, _ in warnings} == {(0, "rs.1"), (0, "b.0")} and svc.take(now=60.0) is None


def test_two_barriers_are_left_to_the_stall_shutdown() -> None:
    svc = service(2)
    svc.controller.submit(0, barrier("b.1"), now=0.0)
    svc.controller.submit(1, barrier("b.2"), now=0.0)
    assert len(svc.stalls(now=60.0, check_seconds=CHECK, shutdown_seconds=0.0)) == 2
    assert svc.take(now=60.0) is None
