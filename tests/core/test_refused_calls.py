"""A rank that refuses a call (bad arguments) makes the call fail on every rank instead of hanging them."""

from __future__ import annotations

import pytest

from conftest import WORKERS, launch
from ringcomm.core import wire
from ringcomm.core.coordinator import Coordinator


def test_a_refusal_fails_the_op_on_every_rank_with_its_reason() -> None:
    c = Coordinator(3, 1 << 20)
    ok = wire.Request("x", wire.ALLREDUCE, "float32", ((4,),), 1)
    c.submit(0, ok)
    c.submit(1, wire.Request("x", wire.ALLREDUCE, refused="rank 1: allreduce 'x': the array is not C-contiguous"))
    assert not c.take_responses()  # still waits for rank 2: every member answers, the refusal too
    c.submit(2, ok)
    (resp,) = c.take_responses()
    assert resp.error.startswith("rank 1 refused the call: rank 1: allreduce 'x': the array is not C-contiguous")


def test_refusals_survive_the_wire() -> None:
    req = wire.Request("x", wire.BROADCAST, pset=2, refused="rank 3: broadcast 'x': root_rank=9 is out of range")
    assert wire.request_from_wire(list(req)) == req


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_every_rank_fails_the_refused_call_and_the_next_one_works(np_: int) -> None:
    proc = launch(np_, [str(WORKERS / "refused_call_worker.py")], timeout=140)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert proc.stdout.count("REFUSALS OK") == np_, out[-4000:]
    assert proc.stdout.count("CASE ") == 9 * np_
