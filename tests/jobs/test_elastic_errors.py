"""Elastic training re-forms the job only when its membership changed; a program's own error ends it."""

from __future__ import annotations

import pytest

from ringcomm.elastic.state import membership_failure, run_fn
from ringcomm.errors import HorovodInternalError, MismatchError, PeerLostError, StallError


class CountingState:
    def __init__(self) -> None:
        self.restores = self.resets = self.syncs = 0

    def sync(self) -> None:
        self.syncs += 1

    def save(self) -> None:
        pass

    def restore(self) -> None:
        self.restores += 1

    def on_reset(self) -> None:
        self.resets += 1


def test_what_counts_as_a_membership_failure() -> None:
    assert membership_failure(PeerLostError("rank 0: lost rank 2"))
    assert membership_failure(HorovodInternalError("engine failed"))
    assert not membership_failure(MismatchError("ranks disagree on dtype"))
    assert not membership_failure(StallError("stalled"))
    assert not membership_failure(ValueError("user bug"))


@pytest.mark.parametrize("exc", [MismatchError("allreduce 'x': ranks disagree on shape"), StallError("stall"),
                                 ValueError("a bug in the training loop")])
def test_a_deterministic_error_ends_the_loop_at_once(exc: BaseException) -> None:
    state = CountingState()
    calls = []

    def train(s: CountingState) -> None:
        calls.append(1)
        raise exc

    with pytest.raises(type(exc)):
        run_fn(train, lambda: None)(state)
    assert len(calls) == 1 and state.restores == 0 and state.resets == 0


def test_a_lost_peer_restores_and_re_forms() -> None:
    state = CountingState()
    resets: list[int] = []
    calls = []

    def train(s: CountingState) -> str:
        calls.append(1)
        if len(calls) < 3:
            raise PeerLostError("rank 1: lost rank 3")
        return "done"

    assert run_fn(train, lambda: resets.append(1))(state) == "done"
    assert len(calls) == 3 and state.restores == 2 and len(resets) == 2 and state.resets == 2
