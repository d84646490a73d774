"""The pipelined hierarchical allreduce's schedule (pure): every pass starts once, after what it needs,
whatever order the passes finish in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.core import pipeline
from ringcomm.core.pipeline import AG, AR, RS, PieceSchedule

pytestmark = pytest.mark.pure


@settings(max_examples=300)
@given(pieces=st.integers(1, 8), data=st.data())
def test_every_pass_starts_once_after_what_it_needs_in_any_order_of_events(pieces: int, data) -> None:
    s = PieceSchedule(pieces)
    started: list[tuple[int, int]] = []
    done: set[tuple[int, int]] = set()
    sent: set[tuple[int, int]] = set()
    running: list[tuple[int, int]] = []

    def take() -> None:
        for key in s.ready():
            phase, c = key
            assert key not in started
            if phase == RS and c:
                assert (RS, c - 1) in done
            if phase == AR:
                assert (RS, c) in done and (c == 0 or (AR, c - 1) in sent)
            if phase == AG:
                assert (AR, c) in done
            started.append(key)
            running.append(key)

    take()
    while running:  # the passes under way report in an order the test picks
        key = running[data.draw(st.integers(0, len(running) - 1))]
        if key[0] == AR and key not in sent and data.draw(st.booleans()):
            sent.add(key)
            s.sent_all(*key)
        else:
            running.remove(key)
            done.add(key)
            sent.add(key)
            s.finished(*key)
        take()
    assert s.over and len(started) == 3 * pieces
    # each lane starts its pieces in order: the reduce-scatters and the cross-host passes
    assert [c for p, c in started if p == RS] == list(range(pieces))
    assert [c for p, c in started if p == AR] == list(range(pieces))


def test_the_link_gets_the_next_piece_once_the_last_is_all_sent() -> None:
    s = PieceSchedule(3)
    assert s.ready() == [(RS, 0)]
    s.finished(RS, 0)
    assert s.ready() == [(AR, 0), (RS, 1)]
    s.finished(RS, 1)
    assert s.ready() == [(RS, 2)]  # AR(1) waits: AR(0) still sends
    s.sent_all(AR, 0)
    assert s.ready() == [(AR, 1)]
    s.finished(AR, 0)
    assert s.ready() == [(AG, 0)]
    assert s.ready() == []


def test_sequence_numbers_are_distinct() -> None:
    offs = {pipeline.seq_offset(p, c) for p in (RS, AR, AG) for c in range(8)}
    assert offs == set(range(24))


def test_at_least_one_piece() -> None:
    with pytest.raises(ValueError):
        PieceSchedule(0)
