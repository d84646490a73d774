"""No lost wake-ups: an op whose data every rank has posted completes without waiting for a timer.

The engine loop sleeps up to a second between stall checks.  An op that became ready while rank 0
was busy inside a transfer (it takes requests there, and answers only the sets without itself) must
not wait for that second: the pure test holds the decision, the job test the whole path.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import WORKERS, launch
from ringcomm.core import wire
from ringcomm.core.service import Service

SECRET = b"k" * 32


def _allreduce(name: str, pset: int = 0) -> wire.Request:
    return wire.Request(name, wire.ALLREDUCE, "float32", ((4,),), pset=pset)


def test_an_op_left_ready_by_a_nested_take_wakes_the_loop_at_once() -> None:
    svc = Service(2, SECRET, fusion_threshold=1 << 20, small_bytes=0, cache_capacity=0)
    svc.submit_local(_allreduce("t"), [np.ones(4, np.float32)], now=0.0)
    svc.controller.submit(1, _allreduce("t"), 0.0)
    assert svc.take(0.0, nested=True) is None  # rank 0 is inside a transfer: its own sets wait
    assert svc.next_wake(0.0) == 0  # ... but not for a timer once the loop is back
    out = svc.take(0.0)
    assert out is not None and [r.names for r in out.local] == [("t",)]
    assert svc.next_wake(0.0) is None  # nothing pending: sleep until a message or a submit


def test_with_a_cycle_time_a_ready_op_waits_only_for_what_is_left_of_the_cycle() -> None:
    svc = Service(2, SECRET, fusion_threshold=1 << 20, small_bytes=0, cache_capacity=0, cycle_time_ms=50)
    svc.submit_local(_allreduce("a"), [np.ones(4, np.float32)], now=0.0)
    svc.controller.submit(1, _allreduce("a"), 0.0)
    assert svc.take(10.0) is not None  # emits at t=10 s
    svc.submit_local(_allreduce("b"), [np.ones(4, np.float32)], now=10.01)
    svc.controller.submit(1, _allreduce("b"), 10.01)
    assert svc.take(10.02) is None  # held: 20 ms of the 50 ms cycle have passed
    assert 29 <= svc.next_wake(10.02) <= 31
    assert svc.next_wake(10.2) == 0


def test_pending_but_not_ready_sleeps_only_until_the_stall_check() -> None:
    svc = Service(2, SECRET, fusion_threshold=1 << 20, small_bytes=0, cache_capacity=0)
    svc.submit_local(_allreduce("late"), [np.ones(4, np.float32)], now=0.0)
    assert svc.next_wake(0.0) == 1000


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("lane", ["on", "off"])
def test_async_collectives_never_wait_for_a_timer(np_: int, lane: str) -> None:
    # The loop sleeps 1 s between stall checks: a lost wake-up costs an iteration about a second,
    # where a normal one takes a few ms (tens under a loaded machine).
    env = {"RINGCOMM_SHM_LANE_BYTES": "0"} if lane == "off" else {}
    proc = launch(np_, [str(WORKERS / "wakeup_worker.py"), "25"], timeout=50, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    slowest = [int(m) for m in re.findall(r"wakeups ok max_ms=(\d+)", proc.stdout)]
    assert len(slowest) == np_, proc.stdout + proc.stderr
    assert max(slowest) < 600, f"an iteration took {max(slowest)} ms (a lost wake-up waits ~1000 ms)\n{proc.stdout}"
