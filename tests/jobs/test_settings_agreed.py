"""Settings that decide how an op's data is cut must be the same on every rank: init() says so at once."""

from __future__ import annotations


import pytest

from conftest import init_ranks_apart
from ringcomm.job.config import AGREED, Settings, agreed, check_agreed
from ringcomm.errors import InvalidInputError


def table(*values: dict[str, int]) -> list[dict]:
    return [{"rank": r, "agreed": v} for r, v in enumerate(values)]


def test_the_same_values_pass_and_the_first_difference_is_named() -> None:
    base = agreed(Settings())
    assert set(base) == set(AGREED)
    check_agreed(table(base, dict(base), dict(base)), 0)
    other = {**base, "hierarchical_piece_bytes": 1 << 20}
    with pytest.raises(InvalidInputError) as err:
        check_agreed(table(base, other, base), 2)
    text = str(err.value)
    assert text.startswith("rank 2: the ranks disagree on RINGCOMM_HIERARCHICAL_PIECE_BYTES")
    assert f"ranks [0, 2] have {8 << 20}; ranks [1] have {1 << 20}" in text
    assert "to the same value on every rank" in text


def test_a_rank_that_published_nothing_counts_as_different() -> None:
    base = agreed(Settings())
    with pytest.raises(InvalidInputError, match="RINGCOMM_SEGMENT_BYTES"):
        check_agreed([{"rank": 0, "agreed": base}, {"rank": 1}], 0)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_ranks_with_different_piece_sizes_fail_at_init_on_every_rank() -> None:
    ranks = [{"RINGCOMM_HIERARCHICAL_PIECE_BYTES": str((r + 1) << 20)} for r in range(2)]
    for r, (code, out) in enumerate(init_ranks_apart("agree001", ranks)):
        assert code == 0, out
        assert (f"REFUSED rank {r}: the ranks disagree on RINGCOMM_HIERARCHICAL_PIECE_BYTES (ranks [0] have 1048576; "
                "ranks [1] have 2097152)" in out), out
