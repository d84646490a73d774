"""ringcomm-run's horovodrun flags: what each sets for the workers, warns about or refuses.  Pure: no processes."""

from __future__ import annotations

import pytest

from ringcomm.launch import args as launch_args
from ringcomm.launch.args import parse_args

pytestmark = pytest.mark.pure

CMD = ["python", "train.py"]

# (flags, RINGCOMM_* variables they must set, a warning they must give (or None))
SETTINGS = [
    (["--fusion-threshold-mb", "32"], {"RINGCOMM_FUSION_THRESHOLD": str(32 * 1024 * 1024)}, None),
    (["--fusion-threshold-mb", "0"], {"RINGCOMM_FUSION_THRESHOLD": "0"}, None),
    (["--cycle-time-ms", "2.5"], {"RINGCOMM_CYCLE_TIME": "2.5"}, None),
    (["--cache-capacity", "0"], {"RINGCOMM_CACHE_CAPACITY": "0"}, None),
    (["--hierarchical-allreduce"], {"RINGCOMM_HIERARCHICAL_ALLREDUCE": "1"}, None),
    (["--no-hierarchical-allreduce"], {"RINGCOMM_HIERARCHICAL_ALLREDUCE": "0"}, None),
    (["--hierarchical-allgather"], {}, "--hierarchical-allgather"),
    (["--no-hierarchical-allgather"], {}, None),
    (["--autotune"], {}, "no autotuner"),
    (["--no-autotune"], {}, None),
    (["--autotune-log-file", "a.csv"], {}, "--autotune-log-file"),
    (["--autotune-warmup-samples", "3"], {}, "--autotune-warmup-samples"),
    (["--autotune-steps-per-sample", "10"], {}, "--autotune-steps-per-sample"),
    (["--autotune-bayes-opt-max-samples", "20"], {}, "--autotune-bayes-opt-max-samples"),
    (["--autotune-gaussian-process-noise", "0.8"], {}, "--autotune-gaussian-process-noise"),
    (["--timeline-filename", "t.json"], {"RINGCOMM_TIMELINE": "t.json"}, None),
    (["--timeline-filename", "t.json", "--timeline-mark-cycles"],
     {"RINGCOMM_TIMELINE": "t.json", "RINGCOMM_TIMELINE_MARK_CYCLES": "1"}, None),
    (["--timeline-mark-cycles"], {}, "needs --timeline-filename"),
    (["--timeline-filename", "t.json", "--no-timeline-mark-cycles"],
     {"RINGCOMM_TIMELINE": "t.json", "RINGCOMM_TIMELINE_MARK_CYCLES": "0"}, None),
    (["--no-stall-check"], {"RINGCOMM_STALL_CHECK_SECONDS": "inf", "RINGCOMM_STALL_SHUTDOWN_SECONDS": "0"}, None),
    (["--stall-check"], {}, None),
    (["--stall-check-warning-time-seconds", "5"], {"RINGCOMM_STALL_CHECK_SECONDS": "5.0"}, None),
    (["--stall-check-shutdown-time-seconds", "30"], {"RINGCOMM_STALL_SHUTDOWN_SECONDS": "30.0"}, None),
    (["--mpi-threads-disable"], {}, "does not use MPI"),
    (["--no-mpi-threads-disable"], {}, None),
    (["--tcp"], {}, None),
    (["--num-nccl-streams", "2"], {}, "does not use NCCL"),
    (["--thread-affinity", "3"], {}, "taskset"),
    (["--gloo-timeout-seconds", "45"], {"RINGCOMM_PEER_TIMEOUT": "45.0"}, None),
    (["--log-level", "TRACE"], {"RINGCOMM_LOG_LEVEL": "DEBUG"}, None),
    (["--log-level", "fatal"], {"RINGCOMM_LOG_LEVEL": "CRITICAL"}, None),
    (["--log-level", "INFO"], {"RINGCOMM_LOG_LEVEL": "INFO"}, None),
    (["--log-with-timestamp"], {}, None),
    (["--log-without-timestamp"], {}, "logging"),
    (["--log-hide-timestamp"], {}, "logging"),
    (["--no-log-hide-timestamp"], {}, None),
    (["--prefix-output-with-timestamp"], {}, None),
    (["-prefix-timestamp"], {}, None),
    (["--start-timeout", "90"], {"RINGCOMM_START_TIMEOUT": "90.0"}, None),
    (["--network-interface", "eth1"], {"RINGCOMM_NETWORK_INTERFACE": "eth1"}, None),
    (["--network-interfaces", "eth1,eth2"], {"RINGCOMM_NETWORK_INTERFACE": "eth1"}, "using eth1, not eth2"),
    (["--network-interface", "eth1", "--network-interface", "eth2"], {"RINGCOMM_NETWORK_INTERFACE": "eth1"},
     "using eth1"),
    (["--gloo"], {"RINGCOMM_CONTROLLER": "gloo", "RINGCOMM_CPU_OPERATIONS": "gloo"}, None),  # as horovodrun: gloo_enabled()
    (["--mpi"], {"RINGCOMM_CONTROLLER": "mpi", "RINGCOMM_CPU_OPERATIONS": "mpi"}, None),
    (["--jsrun"], {"RINGCOMM_CONTROLLER": "mpi", "RINGCOMM_CPU_OPERATIONS": "mpi"}, None),
    (["--disable-cache"], {}, None),
    (["--verbose"], {}, None),
    (["-p", "2222"], {}, None),
    (["--ssh-port", "2222"], {}, None),
    (["-i", "/k/id"], {}, None),
    (["--ssh-identity-file", "/k/id"], {}, None),
    (["--output-filename", "logs"], {}, None),
    (["-H", "localhost:4"], {}, None),
]


@pytest.mark.parametrize("flags, env, warning", SETTINGS, ids=[" ".join(f) for f, _, _ in SETTINGS])
def test_each_horovodrun_flag_sets_its_setting(flags, env, warning):
    args = parse_args(["-np", "2", *flags, *CMD])
    assert args.command == CMD
    assert args.settings_env == env
    if warning is None:
        assert args.notices == []
    else:
        assert any(warning in text for text in args.notices), args.notices


def test_usage_errors_carry_the_name_the_launcher_was_started_as(capsys):
    for prog in ("ringcomm-run", "horovodrun"):
        with pytest.raises(SystemExit) as exited:
            parse_args(["-np", "2", "--no-such-flag", *CMD], prog=prog)
        assert exited.value.code == 2
        assert f"{prog}: error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["-np", "2"], prog="horovodrun")
    assert "e.g. horovodrun -np 2 python train.py" in capsys.readouterr().err


def test_short_and_single_dash_forms():
    args = parse_args(["-np", "2", "-p", "2222", "-i", "/k/id", *CMD])
    assert (args.ssh_port, args.ssh_identity_file) == (2222, "/k/id")
    assert parse_args(["-np", "2", "-p2222", *CMD]).ssh_port == 2222
    args = parse_args(["--num-proc", "3", "--min-num-proc", "2", "--max-num-proc", "4",
                       "--host-discovery-script", "./d.sh", *CMD])
    assert (args.num_proc, args.min_np, args.max_np) == (3, 2, 4)


def test_every_horovodrun_flag_is_known():
    """The flags of horovodrun 0.28.1 (its parser's option strings), all accepted by ours."""
    horovodrun = """-v --version -np --num-proc -cb --check-build --disable-cache --start-timeout
    --network-interfaces --network-interface --output-filename --verbose --config-file -p --ssh-port -i
    --ssh-identity-file --fusion-threshold-mb --cycle-time-ms --cache-capacity --hierarchical-allreduce
    --no-hierarchical-allreduce --hierarchical-allgather --no-hierarchical-allgather --autotune --no-autotune
    --autotune-log-file --autotune-warmup-samples --autotune-steps-per-sample --autotune-bayes-opt-max-samples
    --autotune-gaussian-process-noise --min-np --min-num-proc --max-np --max-num-proc --slots-per-host
    --elastic-timeout --reset-limit --blacklist-cooldown-range --timeline-filename --timeline-mark-cycles
    --no-timeline-mark-cycles --no-stall-check --stall-check --stall-check-warning-time-seconds
    --stall-check-shutdown-time-seconds --mpi-threads-disable --no-mpi-threads-disable --mpi-args --tcp
    --binding-args --num-nccl-streams --thread-affinity --gloo-timeout-seconds --log-level --log-with-timestamp
    --log-without-timestamp -prefix-timestamp --prefix-output-with-timestamp --log-hide-timestamp
    --no-log-hide-timestamp -H --hosts -hostfile --hostfile --host-discovery-script --gloo --mpi --jsrun""".split()
    ours = set(launch_args.build_parser()._option_string_actions)
    # -v is --verbose here (ringcomm-run --version prints the version)
    assert sorted(set(horovodrun) - ours) == []


@pytest.mark.parametrize("flags, message", [
    (["--mpi-args=--map-by ppr:6:node"], "no mpirun"),
    (["--binding-args=--rankfile f"], "numactl"),
    (["--fusion-threshold-mb", "-1"], "must be a number >= 0"),
    (["--gloo-timeout-seconds", "0"], "must be > 0"),
    (["--autotune-gaussian-process-noise", "2"], "[0, 1]"),
    (["--log-level", "LOUD"], "invalid choice"),
    (["--gloo", "--mpi"], "not allowed with"),
])
def test_flags_that_cannot_work_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["-np", "2", *flags, *CMD])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_check_build_needs_no_np(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--check-build"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    try:
        import torch  # noqa: F401
        torch_mark = "[X]"
    except ImportError:
        torch_mark = "[ ]"
    assert "Available Frameworks:" in out and f"{torch_mark} PyTorch" in out and "Available Controllers:" in out


def test_np_is_still_required(capsys):
    with pytest.raises(SystemExit):
        parse_args(CMD)
    assert "-np/--num-proc" in capsys.readouterr().err


def test_output_flags_in_elastic_mode_warn():
    args = parse_args(["-np", "2", "--host-discovery-script", "./d.sh", "--output-filename", "logs", *CMD])
    assert any("--output-filename applies to static jobs" in n for n in args.notices)


def test_blacklist_cooldown_range_sets_the_cooldown():
    args = parse_args(["-np", "2", "--host-discovery-script", "./d.sh", "--blacklist-cooldown-range", "10", "100",
                       *CMD])
    assert args.blacklist_cooldown == 10.0
    assert any("starts at 10 s" in n for n in args.notices)


CONFIG = """
controller: gloo
params:
  fusion_threshold_mb: 16
  cycle_time_ms: 3
  cache_capacity: 256
  hierarchical_allreduce: true
autotune:
  enabled: false
timeline:
  filename: tl.json
  mark_cycles: true
stall_check:
  enabled: true
  warning_time_seconds: 20
  shutdown_time_seconds: 40
library_options:
  gloo_timeout_seconds: 50
logging:
  level: INFO
"""


def test_config_file_sets_what_the_flags_set(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    args = parse_args(["-np", "2", "--config-file", str(path), *CMD])
    assert args.use_gloo is True and args.notices == []
    assert args.settings_env == {
        "RINGCOMM_FUSION_THRESHOLD": str(16 << 20), "RINGCOMM_CYCLE_TIME": "3.0", "RINGCOMM_CACHE_CAPACITY": "256",
        "RINGCOMM_HIERARCHICAL_ALLREDUCE": "1", "RINGCOMM_TIMELINE": "tl.json", "RINGCOMM_TIMELINE_MARK_CYCLES": "1",
        "RINGCOMM_STALL_CHECK_SECONDS": "20.0", "RINGCOMM_STALL_SHUTDOWN_SECONDS": "40.0",
        "RINGCOMM_PEER_TIMEOUT": "50.0", "RINGCOMM_LOG_LEVEL": "INFO",
        "RINGCOMM_CONTROLLER": "gloo", "RINGCOMM_CPU_OPERATIONS": "gloo"}


@pytest.mark.parametrize("before", [True, False])
def test_command_line_wins_over_config_file_wherever_it_stands(tmp_path, before):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    flags = ["--fusion-threshold-mb", "1", "--no-stall-check", "--no-hierarchical-allreduce"]
    config = ["--config-file", str(path)]
    args = parse_args(["-np", "2", *(flags + config if before else config + flags), *CMD])
    env = args.settings_env
    assert env["RINGCOMM_FUSION_THRESHOLD"] == str(1 << 20)
    assert env["RINGCOMM_HIERARCHICAL_ALLREDUCE"] == "0"
    assert (env["RINGCOMM_STALL_CHECK_SECONDS"], env["RINGCOMM_STALL_SHUTDOWN_SECONDS"]) == ("inf", "0")
    assert env["RINGCOMM_CYCLE_TIME"] == "3.0"  # not on the command line: from the file


@pytest.mark.parametrize("text, message", [
    ("params:\n  fusion_threshold: 3\n", "unknown key params.fusion_threshold"),
    ("tuning:\n  x: 1\n", "unknown section 'tuning'"),
    ("controller: nccl\n", "use gloo or mpi"),
    ("params: [1, 2]\n", "must be a mapping"),
    ("params:\n  cycle_time_ms: fast\n", "--cycle-time-ms must be a number"),
    ("params: {\n", "not valid YAML"),
    ("autotune:\n  enabled: true\n", None),
])
def test_config_file_mistakes_are_named(tmp_path, text, message, capsys):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text(text)
    if message is None:
        assert any("no autotuner" in n for n in parse_args(["-np", "1", "--config-file", str(path), *CMD]).notices)
        return
    with pytest.raises(SystemExit):
        parse_args(["-np", "1", "--config-file", str(path), *CMD])
    assert message in capsys.readouterr().err


def test_config_file_without_pyyaml_names_the_install(tmp_path, monkeypatch, capsys):
    import sys

    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(SystemExit):
        parse_args(["-np", "1", "--config-file", str(path), *CMD])
    err = capsys.readouterr().err
    assert "pip install pyyaml" in err and "ringcomm[yaml]" in err


def test_output_layout_pads_ranks_to_the_last_ranks_width():
    from ringcomm.launch.launcher import output_paths

    assert output_paths("d", 1) == ["d/rank.0"]
    assert output_paths("d", 10)[0] == "d/rank.0" and output_paths("d", 10)[9] == "d/rank.9"
    assert output_paths("d", 11)[0] == "d/rank.00" and output_paths("d", 11)[10] == "d/rank.10"
    assert output_paths("d", 101)[7] == "d/rank.007"
