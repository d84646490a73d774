"""How a rank waits for rank 0 to name the small-op lane (``shm_lane.accept``), with no job around it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ringcomm.errors import HorovodInternalError
from ringcomm.lane import shm_lane
from ringcomm.shm.reclaim import process_alive, process_visible


def _table(tmp_path, root_pid: int) -> list[dict]:
    missing = str(tmp_path / "ringcomm-test-0-lane")  # never made: rank 0 did not get that far
    return [{"host": "vm", "lane": [missing, 4096], "pid": root_pid}, {"host": "vm", "lane": True, "pid": os.getpid()}]


def _zombie() -> subprocess.Popen:
    """A child that has ended and that nobody has collected yet."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(500):
        if process_visible(proc.pid) and not process_alive(proc.pid):
            return proc
        time.sleep(0.01)
    raise AssertionError("the child did not end")


def test_a_rank_0_that_ended_before_naming_the_lane_is_not_waited_for_even_as_a_zombie(tmp_path):
    proc = _zombie()
    try:
        started = time.monotonic()
        assert shm_lane.accept(None, _table(tmp_path, proc.pid), 1, 8, wait_seconds=5.0) is None
        assert time.monotonic() - started < 2.0
    finally:
        proc.wait()


def test_a_live_rank_0_that_never_names_the_lane_is_waited_for_until_the_deadline(tmp_path):
    started = time.monotonic()
    with pytest.raises(HorovodInternalError, match="rank 1: rank 0 did not make the small-op lane .* within 0.3 s"):
        shm_lane.accept(None, _table(tmp_path, os.getpid()), 1, 8, wait_seconds=0.3)
    assert time.monotonic() - started >= 0.3
