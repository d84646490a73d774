"""Logging as a library's: the application's configuration wins; RINGCOMM_LOG_LEVEL configures only ringcomm's logger."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import ringcomm as rc
from ringcomm.job import logsetup
from ringcomm.job.config import Settings
from conftest import job_env, launch


@pytest.fixture
def ringcomm_logger():
    """The ``ringcomm`` logger, restored afterwards (level and handlers)."""
    logger = logging.getLogger("ringcomm")
    level, handlers = logger.level, list(logger.handlers)
    if rc.is_initialized():
        rc.shutdown()
    yield logger
    if rc.is_initialized():
        rc.shutdown()
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_import_puts_a_null_handler_on_the_ringcomm_logger_and_sets_no_level() -> None:
    out = subprocess.run([sys.executable, "-c", "import logging, ringcomm; lg = logging.getLogger('ringcomm'); "
                          "print([type(h).__mro__[1].__name__ for h in lg.handlers], lg.level, "
                          "logging.getLogger().handlers, logging.getLogger().level)"],
                         capture_output=True, text=True, timeout=60, env=job_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['NullHandler']", "0", "[]", "30"]


def test_init_keeps_the_applications_debug_level_and_handlers(ringcomm_logger, monkeypatch, caplog) -> None:
    monkeypatch.delenv("RINGCOMM_LOG_LEVEL", raising=False)
    ringcomm_logger.setLevel(logging.DEBUG)
    root = logging.getLogger()
    before = (root.level, list(root.handlers), list(ringcomm_logger.handlers))
    with caplog.at_level(logging.DEBUG, logger="ringcomm"):
        rc.init()
        assert ringcomm_logger.level == logging.DEBUG  # was reset to WARNING by init() before
        assert (root.level, list(root.handlers), list(ringcomm_logger.handlers)) == before
        rc.shutdown()
    story = [r.getMessage() for r in caplog.records if r.name.startswith("ringcomm")]
    assert any("settings other than the defaults" in m for m in story), story
    assert any("rank 0 of 1 (topology: single)" in m for m in story), story


def test_an_empty_log_level_means_unset(ringcomm_logger, monkeypatch) -> None:
    assert Settings.from_env({"RINGCOMM_LOG_LEVEL": ""}).log_level == ""
    monkeypatch.setenv("RINGCOMM_LOG_LEVEL", "")
    ringcomm_logger.setLevel(logging.ERROR)
    rc.init()
    assert ringcomm_logger.level == logging.ERROR
    with pytest.raises(ValueError, match="RINGCOMM_LOG_LEVEL='loud'"):
        Settings.from_env({"RINGCOMM_LOG_LEVEL": "loud"})


def test_log_level_sets_only_the_ringcomm_logger(ringcomm_logger, monkeypatch) -> None:
    monkeypatch.setenv("RINGCOMM_LOG_LEVEL", "info")
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    rc.init()
    assert ringcomm_logger.level == logging.INFO
    assert (root.level, list(root.handlers)) == before


_SCRIPT = """
import logging, os, sys
if sys.argv[1] == "app":
    logging.basicConfig(format="APP %(name)s %(message)s")
import ringcomm as rc
rc.init()
logging.getLogger("ringcomm.engine").warning("a warning")
logging.getLogger("ringcomm.engine").debug("a debug line")
rc.shutdown(); rc.init()  # a second init() adds no second handler
logging.getLogger("ringcomm.engine").warning("second warning")
"""


@pytest.mark.parametrize("app_logging", ["none", "app"])
@pytest.mark.parametrize("level", ["", "DEBUG"])
def test_records_are_shown_once_by_whoever_should_show_them(app_logging: str, level: str) -> None:
    """No logging configured: ringcomm's warnings still reach stderr (a stall warning is never lost);
    the application's handler: shown there, once; RINGCOMM_LOG_LEVEL=DEBUG: debug lines too."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT, app_logging], capture_output=True, text=True, timeout=60,
                         env=job_env(RINGCOMM_LOG_LEVEL=level))
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len([ln for ln in lines if ln.endswith("a warning")]) == 1, out.stderr
    assert len([ln for ln in lines if ln.endswith("second warning")]) == 1, out.stderr
    assert any(ln.endswith("a debug line") for ln in lines) == (level == "DEBUG"), out.stderr
    if app_logging == "app":
        assert "APP ringcomm.engine a warning" in lines, out.stderr


def test_apply_level_adds_no_handler_where_one_shows_the_records(ringcomm_logger) -> None:
    mine = logging.StreamHandler(sys.stderr)
    ringcomm_logger.addHandler(mine)
    logsetup.apply_level("DEBUG")
    assert [h for h in ringcomm_logger.handlers if not isinstance(h, logsetup.LibraryNullHandler)] == [mine]


_JOB = """
import numpy as np, ringcomm as rc
rc.init()
rc.allreduce(np.ones(1), name="lane")                       # 8 B: the small-op lane (up to 16 B here)
rc.allreduce(np.ones(4), name="small")
rc.allreduce(np.ones(1 << 19), name="large")                # 4 MiB: the shared-memory region
rc.allgather(np.ones(1 << 17), name="gathered")             # 1 MiB per rank: the ring
rc.broadcast(np.ones(8), root_rank=1, name="b")
rc.shutdown()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_debug_tells_the_story_of_init_and_of_each_path() -> None:
    proc = launch(2, ["-c", _JOB], timeout=80, RINGCOMM_LOG_LEVEL="DEBUG", RINGCOMM_SHM_LANE_BYTES="16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    for expected in [
        "rank 1 of 2 (topology: ringcomm-run",                 # where the rank's place came from
        "rendezvous tcp://",                                    # where the ranks meet
        "rank 1: data plane: same-host peers [0] over ipc sockets with shared-memory slots",
        "rank 1: control plane: connected to rank 0 over ipc",
        "rank 0: control plane: serving the other ranks on",
        "allreduces up to 16384 B go through rank 0",           # the thresholds chosen for 2 ranks
        "one shared-memory region from 1048576 B",
        "allreduce ('small',): 32 B in 1 op(s), process set 0: reduced at rank 0 (small)",
        "allreduce ('large',): 4194304 B in 1 op(s), process set 0: shared memory",
        "ops of the global set up to 16 B (broadcasts, allgathers and alltoalls up to 48 B, an alltoall's head "
        "included) whose ops in flight every rank has submitted alike go through the small-op lane",
        "allreduce 'lane': 8 B, process set 0: small-op lane",
        "allgather ('gathered',): 2097152 B, process set 0: ring",
        "broadcast ('b',): 64 B from rank 1, process set 0: straight from the root",
        "placement: local rank 1 of 2",
    ]:
        assert expected in text, f"{expected!r} not in:\n{text}"
