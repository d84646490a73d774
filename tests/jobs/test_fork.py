"""A process forked after init() gets a clear error from collectives instead of waiting forever."""

from __future__ import annotations

import pytest

from conftest import WORKERS, launch


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [1, 2])
def test_a_child_forked_after_init_is_refused_and_the_parent_goes_on(np_: int) -> None:
    proc = launch(np_, [str(WORKERS / "fork_worker.py")], timeout=80)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for r in range(np_):
        assert f"CHILD OK {r}" in proc.stdout, out[-3000:]
    assert proc.stdout.count("FORK OK") == np_, out[-3000:]
