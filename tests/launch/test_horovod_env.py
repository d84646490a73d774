"""Horovod's HOROVOD_* settings take effect (RINGCOMM_* wins when both are set); the meaningless ones warn."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import launch
from ringcomm.job import horovod_env
from ringcomm.job.config import Settings


def test_each_horovod_setting_sets_its_ringcomm_setting() -> None:
    s = Settings.from_env({
        "HOROVOD_FUSION_THRESHOLD": "33554432", "HOROVOD_CYCLE_TIME": "3.5", "HOROVOD_CACHE_CAPACITY": "7",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "11", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "22",
        "HOROVOD_TIMELINE": "/tmp/t.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_LOG_LEVEL": "trace",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_DYNAMIC_PROCESS_SETS": "1", "HOROVOD_START_TIMEOUT": "45",
    })
    assert (s.fusion_threshold, s.cycle_time, s.cache_capacity) == (33554432, 3.5, 7)
    assert (s.stall_check_seconds, s.stall_shutdown_seconds) == (11, 22)
    assert (s.timeline, s.timeline_mark_cycles, s.log_level) == ("/tmp/t.json", True, "DEBUG")
    assert (s.hierarchical_allreduce, s.dynamic_process_sets, s.start_timeout) == (1, True, 45)


def test_horovods_controller_names_are_read_and_checked() -> None:
    s = Settings.from_env({"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "MPI"})
    assert (s.controller, s.cpu_operations) == ("gloo", "MPI")
    assert Settings.from_env({"HOROVOD_CONTROLLER": "gloo", "RINGCOMM_CONTROLLER": "mpi"}).controller == "mpi"
    with pytest.raises(ValueError, match=r"RINGCOMM_CONTROLLER='nccl' \(or its HOROVOD_\* name\): use gloo, mpi"):
        Settings.from_env({"HOROVOD_CONTROLLER": "nccl"})
    assert horovod_env.without_meaning({"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}) == []


def test_ringcomm_names_win_and_special_values() -> None:
    s = Settings.from_env({"HOROVOD_FUSION_THRESHOLD": "1", "RINGCOMM_FUSION_THRESHOLD": "2"})
    assert s.fusion_threshold == 2
    assert Settings.from_env({"HOROVOD_TIMELINE": "DYNAMIC"}).timeline == ""  # started by start_timeline()
    off = Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"})
    assert math.isinf(off.stall_check_seconds) and off.stall_shutdown_seconds == 0
    assert Settings.from_env({"HOROVOD_LOG_LEVEL": "fatal"}).log_level == "CRITICAL"


def test_which_horovod_variables_warn() -> None:
    env = {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_AUTOTUNE": "1", "HOROVOD_RANK": "0",
           "HOROVOD_FUSION_THRESHOLD": "1", "HOROVOD_TIMELINE": "x", "PATH": "/bin"}
    assert horovod_env.without_meaning(env) == ["HOROVOD_AUTOTUNE", "HOROVOD_GPU_OPERATIONS"]


@given(st.dictionaries(st.sampled_from(sorted(horovod_env.SAME)), st.sampled_from(["0", "1", "2"]), max_size=4))
def test_translation_never_overrides_a_ringcomm_name(env: dict[str, str]) -> None:
    mine = {v: "9" for v in horovod_env.SAME.values()}
    assert horovod_env.translate({**env, **mine}) == {}


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_horovod_job_file_takes_effect(tmp_path) -> None:
    timeline = tmp_path / "timeline.json"
    code = ("import numpy as np, ringcomm as rc; rc.init();"
            "ps = rc.add_process_set([0, 1]);"
            "ps.included() and print('SET', ps.process_set_id,"
            " rc.allreduce(np.ones(2), op=rc.Sum, process_set=ps).tolist())")
    proc = launch(3, ["-c", code], timeout=80, HOROVOD_DYNAMIC_PROCESS_SETS="1", HOROVOD_TIMELINE=str(timeline),
                  HOROVOD_GPU_OPERATIONS="NCCL")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "[0]<stdout>:SET 1 [2.0, 2.0]" in proc.stdout
    assert "HOROVOD_GPU_OPERATIONS is set but has no meaning in ringcomm" in proc.stderr
    events = json.loads(timeline.read_text())  # written at rank 0, as HOROVOD_TIMELINE asks
    assert any(e.get("args", {}).get("name") == "add_process_set.noname.0" for e in events)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_workers_see_the_variables_horovodrun_sets() -> None:
    code = ("import os; print('HVD', *(os.environ[k] for k in ('HOROVOD_RANK', 'HOROVOD_SIZE', "
            "'HOROVOD_LOCAL_RANK', 'HOROVOD_LOCAL_SIZE', 'HOROVOD_CROSS_RANK', 'HOROVOD_CROSS_SIZE')))")
    proc = launch(2, ["-c", code], timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "[0]<stdout>:HVD 0 2 0 2 0 1" in proc.stdout and "[1]<stdout>:HVD 1 2 1 2 0 1" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_integer_sums_wrap_around_as_in_horovod() -> None:
    code = ("import numpy as np, ringcomm as rc; rc.init();"
            "print('SUM', rc.allreduce(np.array([100, 1], dtype=np.int8), op=rc.Sum, name='i8').tolist(),"
            " rc.allreduce(np.array([100, 1], dtype=np.int8), op=rc.Sum, name='i8big',"
            " out=None).dtype)")
    proc = launch(2, ["-c", code], timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "[0]<stdout>:SUM [-56, 2] int8" in proc.stdout and "[1]<stdout>:SUM [-56, 2] int8" in proc.stdout
