"""ringcomm-run with horovodrun's flags, on real jobs: settings reach the workers, output lands in files."""

from __future__ import annotations

import json
import re

import pytest

from _launcher_helpers import run_launcher, worker

pytestmark = pytest.mark.multiprocess

SETTINGS_DUMP = """
import json, os
from ringcomm.job.config import Settings
s = Settings.from_env()
print(json.dumps({"rank": os.environ["RINGCOMM_RANK"], "fusion": s.fusion_threshold, "cycle": s.cycle_time,
                  "stall": s.stall_check_seconds, "peer": s.peer_timeout, "timeline": s.timeline}))
"""


def _settings(stdout: str) -> dict[str, dict]:
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"\[(\d+)\]<stdout>:(\{.*)", line)
        if m:
            found[m.group(1)] = json.loads(m.group(2))
    return found


@pytest.mark.timeout(60)
def test_tuning_flags_reach_every_workers_settings():
    result, _ = run_launcher("-np", "2", "--fusion-threshold-mb", "8", "--cycle-time-ms", "4",
                             "--no-stall-check", "--gloo-timeout-seconds", "12", "--gloo", "--tcp",
                             *worker(SETTINGS_DUMP), timeout=50)
    assert result.returncode == 0, result.stderr
    seen = _settings(result.stdout)
    assert set(seen) == {"0", "1"}
    for s in seen.values():
        assert (s["fusion"], s["cycle"], s["stall"], s["peer"]) == (8 << 20, 4.0, float("inf"), 12.0)


@pytest.mark.timeout(60)
def test_flags_win_over_the_launchers_environment_and_over_the_config_file(tmp_path):
    pytest.importorskip("yaml")
    config = tmp_path / "hvd.yaml"
    config.write_text("params:\n  fusion_threshold_mb: 2\n  cycle_time_ms: 7\n")
    result, _ = run_launcher("-np", "1", "--config-file", str(config), "--cycle-time-ms", "1",
                             *worker(SETTINGS_DUMP), timeout=50, RINGCOMM_FUSION_THRESHOLD="999")
    assert result.returncode == 0, result.stderr
    assert (_settings(result.stdout)["0"]["fusion"], _settings(result.stdout)["0"]["cycle"]) == (2 << 20, 1.0)


@pytest.mark.timeout(60)
def test_output_filename_writes_horovodruns_layout(tmp_path):
    code = "import os, sys; r = os.environ['RINGCOMM_RANK']; print('out', r); print('err', r, file=sys.stderr)"
    out = tmp_path / "logs"
    result, _ = run_launcher("-np", "3", "--output-filename", str(out), *worker(code), timeout=50)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["rank.0", "rank.1", "rank.2"]
    for rank in range(3):
        assert (out / f"rank.{rank}" / "stdout").read_text() == f"[{rank}]<stdout>:out {rank}\n"
        assert (out / f"rank.{rank}" / "stderr").read_text() == f"[{rank}]<stderr>:err {rank}\n"
    assert "[1]<stdout>:out 1" in result.stdout  # still on the terminal too


@pytest.mark.timeout(60)
def test_prefix_output_with_timestamp_and_warnings(tmp_path):
    result, _ = run_launcher("-np", "1", "--prefix-output-with-timestamp", "--autotune", *worker("print('hi')"),
                             timeout=50)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[0\]<stdout>:hi$", result.stdout, re.M), result.stdout
    assert "warning: --autotune: ringcomm has no autotuner" in result.stderr


@pytest.mark.timeout(60)
def test_refused_flag_names_the_way_to_do_it():
    result, _ = run_launcher("-np", "2", "--mpi-args=--map-by ppr:6:node", *worker("pass"), timeout=50)
    assert result.returncode == 2
    assert "no mpirun" in result.stderr and "-H/--hostfile" in result.stderr


ENABLED = """
import ringcomm_torch as hvd
before = hvd.gloo_enabled()
hvd.init()
print("ENABLED", hvd.rank(), before, hvd.gloo_enabled(), hvd.mpi_enabled(), hvd.gloo_built(), hvd.mpi_built())
hvd.shutdown()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("flag, gloo, mpi", [("--gloo", True, False), ("--mpi", False, True), (None, False, False)])
def test_gloo_enabled_and_mpi_enabled_answer_as_horovod_does_under_the_controller_flag(flag, gloo, mpi):
    """Horovod enables Gloo at init() under horovodrun --gloo (HOROVOD_CONTROLLER=gloo), MPI under --mpi;
    neither library is built into ringcomm."""
    pytest.importorskip("torch")
    result, _ = run_launcher("-np", "2", *([flag] if flag else []), *worker(ENABLED), timeout=80)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:ENABLED {rank} False {gloo} {mpi} False False" in result.stdout, result.stdout
