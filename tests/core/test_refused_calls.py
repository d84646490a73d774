"""A rank that refuses a call (bad arguments) makes the call fail on every rank instead of hanging them."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ringcomm as rc
from conftest import WORKERS, launch
from ringcomm import runtime
from ringcomm.core import wire
from ringcomm.core.coordinator import Coordinator
from ringcomm.core.naming import OpCall
from ringcomm.errors import DuplicateNameError, InvalidInputError, InvalidSplitsError, InvalidTypeError, name_rank
from ringcomm.process_runtime import Refusing


def test_a_refusal_fails_the_op_on_every_rank_with_its_reason() -> None:
    c = Coordinator(3, 1 << 20)
    ok = wire.Request("x", wire.ALLREDUCE, "float32", ((4,),), 1)
    c.submit(0, ok)
    c.submit(1, wire.Request("x", wire.ALLREDUCE, refused="rank 1: allreduce 'x': the array is not C-contiguous"))
    assert not c.take_responses()  # still waits for rank 2: every member answers, the refusal too
    c.submit(2, ok)
    (resp,) = c.take_responses()
    assert resp.error.startswith("rank 1 refused the call: allreduce 'x': the array is not C-contiguous")


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


class _RecordingRuntime:
    """Stands in for the runtime: records what it is asked to refuse."""

    rank = 3

    def __init__(self) -> None:
        self.refused: list[tuple[OpCall, str]] = []

    def refuse(self, call: OpCall, reason: str) -> None:
        self.refused.append((call, reason))


@pytest.mark.pure
@pytest.mark.parametrize("error, refused", [
    (InvalidInputError("allreduce 'x': the array is not C-contiguous"), True),
    (InvalidTypeError("allreduce 'x': dtype complex64 is not supported"), True),
    (InvalidSplitsError("alltoall 'x': splits must be integers"), True),
    (DuplicateNameError("allreduce: an op named 'x' is already in flight on rank 0"), False),  # the name is taken
    (RuntimeError("something else"), False),
])
def test_a_refusing_block_refuses_its_call_on_argument_errors_and_lets_every_error_through(error, refused) -> None:
    rt = _RecordingRuntime()
    call = OpCall(1, wire.ALLREDUCE, "x", 0)
    reason = str(error)
    with pytest.raises(type(error)) as raised:
        with Refusing(rt, call):  # type: ignore[arg-type]
            raise error
    assert raised.value is error
    assert rt.refused == ([(call, reason)] if refused else [])
    # a refused call's error names the rank that raised it, as the others' errors of the op do
    assert str(error) == (f"{reason} [raised on rank 3]" if refused else reason)
    with Refusing(rt, call):  # type: ignore[arg-type]
        pass
    assert len(rt.refused) == int(refused)  # nothing raised: nothing refused


@pytest.mark.timeout(60)
def test_each_core_call_refuses_the_op_it_named_and_only_after_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank: the call object each collective names is the one refused (no state kept between calls)."""
    refused: list[tuple[OpCall, str]] = []
    monkeypatch.setattr(runtime.Runtime, "refuse", lambda self, call, reason: refused.append((call, reason)))
    rc.init()
    try:
        with pytest.raises(InvalidInputError, match="not C-contiguous"):
            rc.allreduce_async(np.ones((3, 3), np.float32)[:, 0])
        with pytest.raises(InvalidInputError, match="out of range"):
            rc.broadcast_async(np.ones(2), root_rank=5, name="b")
        with pytest.raises(InvalidInputError, match="name must be a non-empty string"):
            rc.allgather_async(np.ones(2), name="")  # refused before it is named: nothing to refuse
        with pytest.raises(InvalidTypeError, match="must be a ProcessSet"):
            rc.allgather_async(np.ones(2), process_set=3)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="cannot pickle"):
            rc.allgather_object(threading.Lock())
        with pytest.raises(InvalidInputError, match="cannot pickle"):
            rc.broadcast_object(threading.Lock(), name="o")
        rc.allreduce(np.ones(2), name="after")  # a call that is not refused refuses nothing
        assert [(c.kind, c.name, c.pset, c.rank) for c, _ in refused] == [
            (wire.ALLREDUCE, "allreduce.noname.0", 0, 0), (wire.BROADCAST, "b", 0, 0),
            (wire.ALLGATHER, "allgather_object.noname.0.len", 0, 0), (wire.BROADCAST, "o.len", 0, 0)]
        assert "strides" in refused[0][1] and "np.ascontiguousarray" in refused[0][1]
        assert "root_rank=5" in refused[1][1] and "0..0" in refused[1][1]
        assert refused[3][1].startswith("broadcast_object 'o': cannot pickle the lock object")
    finally:
        rc.shutdown()


@pytest.mark.pure
def test_a_refused_calls_error_names_its_rank_once_and_a_message_naming_it_already_stays() -> None:
    error = InvalidInputError("broadcast 'b': root_rank=5 is out of range")
    name_rank(error, 2)
    name_rank(error, 2)
    assert str(error) == "broadcast 'b': root_rank=5 is out of range [raised on rank 2]"
    taken = DuplicateNameError("allreduce: an op named 'x' is already in flight on rank 1; use another name")
    name_rank(taken, 1)
    assert str(taken).endswith("use another name")
    other = InvalidInputError("checked on rank 12")
    name_rank(other, 1)
    assert str(other) == "checked on rank 12 [raised on rank 1]"
