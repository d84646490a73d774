"""Which rank ringcomm-run stops because the job lost it (ringcomm/launch/lost.py), and how the ranks' reports
reach it (the rendezvous store's keys, PeerLostError.lost_rank); in memory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.errors import PeerLostError
from ringcomm.launch.lost import LostRanks
from ringcomm.net.rendezvous_client import LOST_KEY_PREFIX, lost_reports

pytestmark = pytest.mark.pure


def test_a_stopped_process_is_stopped_at_once_a_running_one_after_the_confirmation():
    lost = LostRanks(confirm_seconds=2.0)
    lost.update({0: 1, 2: 3}, now=100.0)
    assert lost.to_stop(running={0, 1, 2, 3}, frozen={3}, now=100.0) == [3]
    assert lost.to_stop(running={0, 1, 2, 3}, frozen=set(), now=101.9) == []
    assert lost.to_stop(running={0, 1, 2}, frozen=set(), now=102.0) == [1]
    assert lost.to_stop(running={0, 1, 2}, frozen={1}, now=200.0) == []  # each once
    assert lost.reporters_of(1) == [0] and lost.reported() == [1, 3]


def test_two_ranks_that_report_each_other_are_both_alive_and_neither_is_stopped():
    """The link between two live ranks broke: each reports the other; each ends on its own error."""
    lost = LostRanks(confirm_seconds=2.0)
    lost.update({0: 1}, now=10.0)
    lost.update({0: 1, 1: 0}, now=11.0)
    assert lost.to_stop(running={0, 1}, frozen=set(), now=60.0) == []


def test_a_rank_that_exited_is_not_stopped_and_reports_are_never_withdrawn():
    lost = LostRanks(confirm_seconds=0.0)
    lost.update({2: 1}, now=1.0)
    assert lost.to_stop(running={0, 2}, frozen=set(), now=5.0) == []  # rank 1 already ended by itself
    lost.update({}, now=6.0)
    assert lost.reports == {2: 1}


@given(st.dictionaries(st.integers(0, 7), st.integers(0, 7)), st.sets(st.integers(0, 7)),
       st.sets(st.integers(0, 7)), st.floats(0, 10))
def test_only_a_running_rank_reported_by_another_and_not_reporting_itself_is_ever_stopped(reports, running, frozen,
                                                                                           later):
    lost = LostRanks(confirm_seconds=2.0)
    lost.update(reports, now=0.0)
    stopped = lost.to_stop(running, frozen, now=later)
    reporters = {r for r, x in reports.items() if r != x}
    for rank in stopped:
        assert rank in running and rank not in reporters
        assert any(x == rank and r != rank for r, x in reports.items())
        assert rank in frozen or later >= 2.0
    assert lost.to_stop(running, frozen, now=later + 10) == [
        r for r in sorted(set(reports[q] for q in reporters)) if r in running and r not in reporters and r not in stopped]


def test_reports_in_the_rendezvous_store_and_the_rank_an_error_names():
    store = {f"{LOST_KEY_PREFIX}0": b"1", f"{LOST_KEY_PREFIX}2": b"1", f"{LOST_KEY_PREFIX}x": b"1",
             f"{LOST_KEY_PREFIX}3": b"junk", "other/4": b"1"}
    assert lost_reports(store) == {0: 1, 2: 1}
    assert PeerLostError("rank 0: lost rank 12 (host a, pid 7): its process ended").lost_rank == 12
    assert PeerLostError("rank 0: the job ended").lost_rank is None
