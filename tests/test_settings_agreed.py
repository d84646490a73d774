"""Settings that decide how an op's data is cut must be the same on every rank: init() says so at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import job_env
from ringcomm.config import AGREED, Settings, agreed, check_agreed
from ringcomm.errors import InvalidInputError
from ringcomm.rendezvous import RendezvousServer


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
    secret = os.urandom(32)
    code = "import ringcomm as rc\ntry:\n    rc.init()\nexcept ValueError as e:\n    print('REFUSED', e)\n"
    with RendezvousServer(size=2, secret=secret) as server:
        procs = [subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=job_env(RINGCOMM_RANK=str(r), RINGCOMM_SIZE="2", RINGCOMM_RENDEZVOUS_ADDR=server.address,
                        RINGCOMM_SECRET=secret.hex(), RINGCOMM_JOB_ID="agree001",
                        RINGCOMM_HIERARCHICAL_PIECE_BYTES=str((r + 1) << 20)),
        ) for r in range(2)]
        try:
            outs = [p.communicate(timeout=40)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.wait()
    for r, out in enumerate(outs):
        assert procs[r].returncode == 0, out
        assert (f"REFUSED rank {r}: the ranks disagree on RINGCOMM_HIERARCHICAL_PIECE_BYTES (ranks [0] have 1048576; "
                "ranks [1] have 2097152)" in out), out
