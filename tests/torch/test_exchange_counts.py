"""The counts the backend's exchanges send and expect (scatter, gather, all_to_all_single), in
memory: the core's check of them (``unmet_receipts``) passes exactly when every rank's tensors fit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")

from ringcomm.core.coordinator import unmet_receipts  # noqa: E402
from ringcomm_torch.distributed.exchange_counts import gather_counts, scatter_counts, single_receipts  # noqa: E402

pytestmark = pytest.mark.pure


def agreed(counts) -> bool:  # type: ignore[no-untyped-def]
    return unmet_receipts("x", "", [c.splits for c in counts], [c.received for c in counts],
                          range(len(counts))) == ""


def draw_sizes(size, data):  # type: ignore[no-untyped-def]
    """A root, what is sent (``size`` counts) and what is expected (each that count, or another)."""
    root = data.draw(st.integers(0, size - 1))
    sent = data.draw(st.lists(st.integers(0, 4), min_size=size, max_size=size))
    return root, sent, [n if data.draw(st.booleans()) else data.draw(st.integers(0, 4)) for n in sent]


@given(st.integers(1, 5), st.data())
def test_a_scatter_agrees_exactly_when_each_output_fits_the_roots_part_for_it(size, data):
    root, parts, outs = draw_sizes(size, data)
    counts = [scatter_counts(r, root, size, outs[r], parts if r == root else None) for r in range(size)]
    assert agreed(counts) == (outs == parts)
    mine = counts[root]
    assert mine.keeps_own == (outs[root] == parts[root])
    assert mine.splits[root] == (0 if mine.keeps_own else parts[root])
    assert all(c.splits == [0] * size for r, c in enumerate(counts) if r != root)


@given(st.integers(1, 5), st.data())
def test_a_gather_agrees_exactly_when_the_roots_outputs_fit_each_ranks_input(size, data):
    root, ins, outs = draw_sizes(size, data)
    counts = [gather_counts(r, root, size, ins[r], outs if r == root else None) for r in range(size)]
    assert agreed(counts) == (outs == ins)


@given(st.integers(1, 4), st.data())
def test_all_to_all_single_expects_its_output_split_sizes_or_an_even_share(size, data):
    sent = [data.draw(st.lists(st.integers(0, 3), min_size=size, max_size=size)) for _ in range(size)]
    receipts = []
    for r in range(size):
        arriving = [s[r] for s in sent]
        given_sizes = data.draw(st.sampled_from([arriving, [], [*arriving[:-1], arriving[-1] + 1]]))
        rows = sum(given_sizes) if given_sizes else sum(arriving)
        got = single_receipts(size, (rows, 2), (sum(sent[r]), 2), given_sizes)
        if not given_sizes and rows % size:
            assert isinstance(got, str) and "do not split evenly" in got
            return
        receipts.append(got)
    splits = sent
    fits = all(list(receipts[r]) == [s[r] for s in splits] for r in range(size))
    assert (unmet_receipts("x", "", splits, receipts, range(size)) == "") == fits


def test_all_to_all_single_refuses_what_no_rank_could_send_into():
    assert "at least one dimension" in single_receipts(2, (), (4,), [])
    assert "hold 3 elements, the input's 2" in single_receipts(2, (2, 3), (2, 2), [])
    assert "must hold one count >= 0 per rank" in single_receipts(2, (3,), (4,), [1, 1, 1])
    assert "summing to the output's 3 rows" in single_receipts(2, (3,), (4,), [1, 1])
    assert single_receipts(2, (3, 1), (4, 1), [2, 1]) == [2, 1]
