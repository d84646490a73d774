"""Settings that decide how an op's data is cut must be the same on every rank: init() says so at once."""

from __future__ import annotations


import pytest

from conftest import init_ranks_apart
from ringcomm.job.config import AGREED, Settings, agreed, check_agreed, segment_setting_unused
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


def test_a_segment_setting_the_ring_does_not_use_is_named_with_the_one_it_does() -> None:
    env = {"RINGCOMM_SEGMENT_BYTES": "1048576"}
    text = segment_setting_unused(env, one_per_host=True)
    assert text is not None and text.startswith("RINGCOMM_SEGMENT_BYTES=1048576 does not cut this job's ring")
    assert "Set RINGCOMM_STREAM_SEGMENT_BYTES=1048576 on every rank" in text
    assert segment_setting_unused(env, one_per_host=False) is None  # two ranks share a host: it cuts their ring
    assert segment_setting_unused({**env, "RINGCOMM_STREAM_SEGMENT_BYTES": "1048576"}, one_per_host=True) is None
    assert segment_setting_unused({}, one_per_host=True) is None


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_rank_0_warns_once_at_init_when_the_segment_setting_cuts_nothing() -> None:
    ranks = [{"RINGCOMM_HOSTNAME": f"host{r}", "RINGCOMM_SEGMENT_BYTES": "1048576"} for r in range(2)]
    outs = init_ranks_apart("segs001", ranks)
    for code, out in outs:
        assert code == 0 and "REFUSED" not in out, out
    assert "rank 0: RINGCOMM_SEGMENT_BYTES=1048576 does not cut this job's ring" in outs[0][1], outs[0][1]
    assert "RINGCOMM_SEGMENT_BYTES" not in outs[1][1], outs[1][1]
    shared = [{"RINGCOMM_HOSTNAME": "host0", "RINGCOMM_SEGMENT_BYTES": "1048576"} for r in range(2)]
    for code, out in init_ranks_apart("segs002", shared):
        assert code == 0 and "RINGCOMM_SEGMENT_BYTES" not in out, out
