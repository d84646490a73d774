"""A stall deadline in real jobs: an op only some ranks submitted fails on every rank, runs on none.

``workers/stall_late_worker.py``: the last rank submits a small allreduce and one of 16 MiB after
the deadline has passed.  With the small-op lane and without it, at 2 and 3 ranks: the ranks on
time are warned every check period and raise ``StallError`` at the deadline; the late rank's calls
raise the same error instead of returning a sum that holds the others' data; later ops work.
"""

from __future__ import annotations

import re

import pytest

from conftest import WORKERS, launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]
pytest.importorskip("torch", reason="the worker runs ringcomm_torch (pip install -e '.[torch]')")

WORKER = str(WORKERS / "stall_late_worker.py")
LANE_OFF = {"RINGCOMM_SHM_LANE_BYTES": "0", "RINGCOMM_NET_LANE_BYTES": "0"}


@pytest.mark.parametrize("lane", ["lane", "no lane"])
@pytest.mark.parametrize("np_", [2, 3])
def test_the_late_rank_gets_the_same_stall_error_and_later_ops_work(np_: int, lane: str) -> None:
    env = {} if lane == "lane" else LANE_OFF
    proc = launch(np_, [WORKER], timeout=180, preload=True, RINGCOMM_STALL_CHECK_SECONDS="1",
                  RINGCOMM_STALL_SHUTDOWN_SECONDS="2.5", STALL_LATE_SLEEP="5", **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    late = np_ - 1
    for what in ("small", "big"):
        errors = dict(re.findall(rf"^\[(\d+)\]<stdout>:{what} StallError (.*)$", proc.stdout, re.M))
        assert sorted(errors) == [str(r) for r in range(np_)], proc.stdout[-3000:]
        texts = {re.sub(r" \[raised on rank \d+\]$", "", text) for text in errors.values()}
        assert len(texts) == 1, texts  # the late rank gets the very error the others got
        (text,) = texts
        assert f"allreduce 'allreduce.stalled.{what}' was submitted by ranks {list(range(late))}" in text
        assert f"ranks [{late}] have not submitted it" in text and "RINGCOMM_STALL_SHUTDOWN_SECONDS=2.5" in text
        assert float(re.search(r"(\d+(?:\.\d+)?) s ago", text).group(1)) >= 2.5
    # the wait is warned about every check period, with the time waited so far (rank 0's service)
    warned = re.findall(r"stall: allreduce 'allreduce\.stalled\.big' was submitted by ranks \[[\d, ]+\] "
                        r"(\d+\.\d) s ago", proc.stderr)
    assert len(warned) >= 2 and float(warned[1]) > float(warned[0]), proc.stderr[-3000:]
    assert proc.stdout.count("AFTER OK") == np_
