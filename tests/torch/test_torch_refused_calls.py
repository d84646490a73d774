"""A tensor argument ringcomm_torch refuses on one rank (before the core sees it) fails the op on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

import ringcomm as rc  # noqa: E402
from conftest import launch  # noqa: E402
from ringcomm import runtime  # noqa: E402

TORCH_WORKERS = Path(__file__).resolve().parents[1] / "workers"


def test_refuse_call_does_nothing_before_init_or_with_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    refused: list[tuple[str, ...]] = []
    monkeypatch.setattr(runtime.Runtime, "refuse", lambda self, *args: refused.append(args))
    if rc.is_initialized():  # a job another module's tests started in this process (run in parallel, -n)
        rc.shutdown()
    assert not rc.is_initialized()
    rc.api.refuse_call("allreduce", None, None, "no job yet")  # returns quietly: the caller raises its own error
    rc.init()
    try:
        assert rc.size() == 1
        rc.api.refuse_call("allreduce", None, None, "one rank")
        rc.api.refuse_call("grouped_allgather", "g", None, "one rank", parts=3)
        assert not refused
        # the unnamed numbering was left alone: the next unnamed op is still the first
        assert runtime.current("test").auto_name("allreduce", None) == "allreduce.noname.0"
    finally:
        rc.shutdown()


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_", [2, 3])
def test_every_rank_fails_a_call_the_torch_layer_refuses_and_the_next_one_works(np_: int) -> None:
    # a misnumbered unnamed op would stall: fail it within seconds rather than let the job hang
    proc = launch(np_, [str(TORCH_WORKERS / "torch_refused_call_worker.py")], timeout=190, preload=True,
                  RINGCOMM_STALL_CHECK_SECONDS="5", RINGCOMM_STALL_SHUTDOWN_SECONDS="10", OMP_NUM_THREADS="1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert proc.stdout.count("TORCH REFUSALS OK") == np_, out[-6000:]
    # 12 cases unnamed and named, 3 of broadcast_parameters; at np 3, 4 in a process set of ranks 1 and 2
    assert proc.stdout.count("CASE ") == 27 * np_ + (4 * 2 if np_ >= 3 else 0), out[-6000:]
