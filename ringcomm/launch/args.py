"""``ringcomm-run``'s command line: its own flags, horovodrun's, and ``--config-file``.

Every flag of Horovod's ``horovodrun`` parses.  A flag either sets the ringcomm
setting it means, through the ``RINGCOMM_*`` variables the workers get
(:func:`settings_env`), is accepted because ringcomm already does what it asks
(``--gloo``, ``--mpi``, ``--tcp``: ringcomm has one controller and one
transport), gives a warning when it changes nothing that could matter to the
results (``--autotune``, ``--num-nccl-streams``: :func:`notices`), or is refused
with the ringcomm way to get what it asks for (:func:`refusals`).

    ringcomm-run -np 4 --fusion-threshold-mb 32 --cycle-time-ms 2 python train.py
    -> every worker runs with RINGCOMM_FUSION_THRESHOLD=33554432 RINGCOMM_CYCLE_TIME=2.0

A flag given on the command line wins over the same setting in ``--config-file``,
wherever it stands, as in horovodrun.  Nothing here starts a process.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from ..job import hosts as _hosts
from ..errors import InvalidInputError

_PROG = "ringcomm-run"
#: horovodrun's log levels -> the ``ringcomm`` logger's.
LOG_LEVELS = {"TRACE": "DEBUG", "DEBUG": "DEBUG", "INFO": "INFO", "WARNING": "WARNING", "ERROR": "ERROR",
              "FATAL": "CRITICAL"}

#: --config-file: section -> {key: the flag's dest}; a key outside these is an error.
CONFIG_KEYS: dict[str, dict[str, str]] = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb", "cycle_time_ms": "cycle_time_ms",
               "cache_capacity": "cache_capacity", "hierarchical_allreduce": "hierarchical_allreduce",
               "hierarchical_allgather": "hierarchical_allgather"},
    "autotune": {"enabled": "autotune", "log_file": "autotune_log_file",
                 "warmup_samples": "autotune_warmup_samples", "steps_per_sample": "autotune_steps_per_sample",
                 "bayes_opt_max_samples": "autotune_bayes_opt_max_samples",
                 "gaussian_process_noise": "autotune_gaussian_process_noise"},
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {"enabled": "stall_check_enabled", "warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds"},
    "library_options": {"mpi_threads_disable": "mpi_threads_disable", "num_nccl_streams": "num_nccl_streams",
                        "ccl_bgt_affinity": "ccl_bgt_affinity", "gloo_timeout_seconds": "gloo_timeout_seconds"},
    "logging": {"level": "log_level", "with_timestamp": "log_with_timestamp"},
}
#: Settings that have no effect here, with why, for the warning (dest -> text).
_NO_EFFECT = {
    "autotune": "--autotune: ringcomm has no autotuner; set --fusion-threshold-mb and --cycle-time-ms "
                "(RINGCOMM_FUSION_THRESHOLD, RINGCOMM_CYCLE_TIME) yourself",
    "autotune_log_file": "--autotune-log-file: ringcomm has no autotuner",
    "autotune_warmup_samples": "--autotune-warmup-samples: ringcomm has no autotuner",
    "autotune_steps_per_sample": "--autotune-steps-per-sample: ringcomm has no autotuner",
    "autotune_bayes_opt_max_samples": "--autotune-bayes-opt-max-samples: ringcomm has no autotuner",
    "autotune_gaussian_process_noise": "--autotune-gaussian-process-noise: ringcomm has no autotuner",
    "hierarchical_allgather": "--hierarchical-allgather: ringcomm's allgather is one ring over all ranks "
                              "(the result is the same); --hierarchical-allreduce applies to allreduce",
    "mpi_threads_disable": "--mpi-threads-disable: ringcomm does not use MPI",
    "num_nccl_streams": "--num-nccl-streams: ringcomm does not use NCCL",
    "ccl_bgt_affinity": "ccl_bgt_affinity: ringcomm does not use oneCCL",
    "thread_affinity": "--thread-affinity: ringcomm does not pin its background thread; pin the whole worker "
                       "with e.g. 'ringcomm-run -np 2 taskset -c 0-7 python train.py'",
    "log_with_timestamp": "--log-with-timestamp/--log-without-timestamp: ringcomm's log records carry the "
                          "time when RINGCOMM_LOG_LEVEL adds its handler; configure the 'ringcomm' logger's "
                          "format with Python's logging instead",
}


# --------------------------------------------------------------------------- the parser


class _Append(argparse.Action):
    """``--network-interface(s)``: one or more names, repeated or comma-separated, kept in order."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items += [v for v in str(values).split(",") if v and v not in items]
        setattr(namespace, self.dest, items)


def build_parser(prog: str = _PROG) -> argparse.ArgumentParser:
    """The ``ringcomm-run`` argument parser: ringcomm's flags and horovodrun's.

    ``prog``: the name usage errors and ``--version`` carry (``horovodrun`` when started as that).
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description="Run COMMAND as N ringcomm workers on this machine or across hosts "
                    "(Horovod's horovodrun, for ringcomm; every horovodrun flag is accepted).",
        epilog="examples: ringcomm-run -np 4 python train.py --epochs 3; "
               "ringcomm-run -np 8 -H node1:4,node2:4 python train.py",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"{prog} (ringcomm) {__version__}")
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int, default=None, metavar="N",
                        help="number of worker processes to start (>= 1; required)")
    parser.add_argument("-cb", "--check-build", action="store_true",
                        help="print what this build of ringcomm supports and exit (horovodrun's --check-build)")
    parser.add_argument("--disable-cache", action="store_true",
                        help="accepted for horovodrun: ringcomm-run caches no host checks, so every run checks")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", default=None, metavar="HOST:N,...",
                       help="hosts and their slots, filled in order, e.g. -H node1:4,node2:4 "
                            "(default: every rank on this machine)")
    where.add_argument("-hostfile", "--hostfile", default=None, metavar="FILE",
                       help="hosts from FILE: one 'host slots=N' per line, '#' comments")
    parser.add_argument("--ssh-command", default="ssh", metavar="CMD",
                        help="program that runs a command on another host, called as CMD HOST 'COMMAND LINE' "
                             "(default: ssh); may hold options, e.g. 'ssh -o BatchMode=yes'")
    parser.add_argument("-p", "--ssh-port", type=int, default=None, metavar="PORT", help="passed to ssh as -p PORT")
    parser.add_argument("-i", "--ssh-identity-file", default=None, metavar="FILE", help="passed to ssh as -i FILE")
    parser.add_argument("--network-interface", "--network-interfaces", dest="network_interfaces", action=_Append,
                        default=None, metavar="NAME",
                        help="interface whose address ranks use to reach each other across hosts, on every "
                             "host (e.g. eth0; default: the one that routes to the other hosts); sets "
                             "RINGCOMM_NETWORK_INTERFACE.  Given several (repeated or comma-separated), the "
                             "first is used")
    parser.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                        help="seconds every rank has to reach the rendezvous (default: $RINGCOMM_START_TIMEOUT "
                             "or 60); sets RINGCOMM_START_TIMEOUT")
    parser.add_argument("--output-filename", default=None, metavar="DIR",
                        help="also write each rank's output to DIR/rank.<N>/stdout and DIR/rank.<N>/stderr "
                             "(N zero-padded to the width of the last rank), as horovodrun does")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print the job id, the rendezvous address and each worker's pid to stderr")
    parser.add_argument("--config-file", default=None, metavar="FILE",
                        help="horovodrun's YAML settings file (needs PyYAML: pip install 'ringcomm[yaml]'); "
                             "flags on the command line win over it")
    _add_tuning_arguments(parser)
    _add_library_arguments(parser)
    _add_elastic_arguments(parser)
    controller = parser.add_argument_group("controller (accepted for horovodrun; ringcomm has one controller)")
    which = controller.add_mutually_exclusive_group()
    which.add_argument("--gloo", dest="use_gloo", action="store_true",
                       help="accepted: ringcomm's own rendezvous and rank-0 coordination play Gloo's part")
    which.add_argument("--mpi", dest="use_mpi", action="store_true",
                       help="accepted: ringcomm starts its workers itself, without mpirun "
                            "(for a job started by mpirun, see the launching guide)")
    which.add_argument("--jsrun", dest="use_jsrun", action="store_true",
                       help="accepted: workers start as with --gloo; list the LSF hosts with -H or --hostfile")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program to run, with its arguments")
    return parser


def _add_tuning_arguments(parser: argparse.ArgumentParser) -> None:
    params = parser.add_argument_group("tunable parameters (horovodrun's; each sets a RINGCOMM_* setting)")
    params.add_argument("--fusion-threshold-mb", type=int, default=None, metavar="MB",
                        help="largest fused buffer in MiB (RINGCOMM_FUSION_THRESHOLD, in bytes; 0: no fusion)")
    params.add_argument("--cycle-time-ms", type=float, default=None, metavar="MS",
                        help="milliseconds to batch ready ops into one fused response (RINGCOMM_CYCLE_TIME)")
    params.add_argument("--cache-capacity", type=int, default=None, metavar="N",
                        help="entries of the response cache (RINGCOMM_CACHE_CAPACITY; 0 disables it)")
    for name, text in (("allreduce", "reduce within each host first, then across hosts "
                                     "(RINGCOMM_HIERARCHICAL_ALLREDUCE=1; --no-... sets 0)"),
                       ("allgather", "accepted with a warning: ringcomm's allgather is one ring")):
        both = params.add_mutually_exclusive_group()
        both.add_argument(f"--hierarchical-{name}", dest=f"hierarchical_{name}", action="store_const", const=True,
                          default=None, help=text)
        both.add_argument(f"--no-hierarchical-{name}", dest=f"hierarchical_{name}", action="store_const",
                          const=False, help=argparse.SUPPRESS)
    tune = parser.add_argument_group("autotune (accepted with a warning: ringcomm has no autotuner)")
    on = tune.add_mutually_exclusive_group()
    on.add_argument("--autotune", action="store_const", const=True, default=None, help="warns; see above")
    on.add_argument("--no-autotune", dest="autotune", action="store_const", const=False, help=argparse.SUPPRESS)
    tune.add_argument("--autotune-log-file", default=None, metavar="FILE", help=argparse.SUPPRESS)
    for flag, kind in (("warmup-samples", int), ("steps-per-sample", int), ("bayes-opt-max-samples", int),
                       ("gaussian-process-noise", float)):
        tune.add_argument(f"--autotune-{flag}", type=kind, default=None, help=argparse.SUPPRESS)
    timeline = parser.add_argument_group("timeline")
    timeline.add_argument("--timeline-filename", default=None, metavar="PATH",
                          help="write a Chrome-trace timeline of the collectives to PATH (RINGCOMM_TIMELINE)")
    marks = timeline.add_mutually_exclusive_group()
    marks.add_argument("--timeline-mark-cycles", action="store_const", const=True, default=None,
                       help="mark each coordination cycle on the timeline (RINGCOMM_TIMELINE_MARK_CYCLES; "
                            "with --timeline-filename)")
    marks.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles", action="store_const", const=False,
                       help=argparse.SUPPRESS)
    stall = parser.add_argument_group("stall check")
    check = stall.add_mutually_exclusive_group()
    check.add_argument("--no-stall-check", dest="stall_check_enabled", action="store_const", const=False,
                       default=None, help="no stall warnings or shutdowns (RINGCOMM_STALL_CHECK_SECONDS=inf)")
    check.add_argument("--stall-check", dest="stall_check_enabled", action="store_const", const=True,
                       help=argparse.SUPPRESS)
    stall.add_argument("--stall-check-warning-time-seconds", type=float, default=None, metavar="S",
                       help="warn about an op only some ranks submitted after S seconds "
                            "(RINGCOMM_STALL_CHECK_SECONDS; default 60)")
    stall.add_argument("--stall-check-shutdown-time-seconds", type=float, default=None, metavar="S",
                       help="fail such an op on every rank after S seconds (RINGCOMM_STALL_SHUTDOWN_SECONDS; "
                            "default 1800; 0: never)")


def _add_library_arguments(parser: argparse.ArgumentParser) -> None:
    lib = parser.add_argument_group("library and logging options (horovodrun's)")
    threads = lib.add_mutually_exclusive_group()
    threads.add_argument("--mpi-threads-disable", action="store_const", const=True, default=None,
                         help="accepted with a warning: ringcomm does not use MPI")
    threads.add_argument("--no-mpi-threads-disable", dest="mpi_threads_disable", action="store_const", const=False,
                         help=argparse.SUPPRESS)
    lib.add_argument("--mpi-args", default=None, metavar="ARGS",
                     help="refused: there is no mpirun; place ranks with -H/--hostfile")
    lib.add_argument("--binding-args", default=None, metavar="ARGS",
                     help="refused: there is no mpirun or jsrun; bind CPUs in the command (taskset, numactl)")
    lib.add_argument("--tcp", dest="tcp_flag", action="store_true",
                     help="accepted: ranks on different hosts always talk over TCP (on one host, over ipc and "
                          "shared memory)")
    lib.add_argument("--num-nccl-streams", type=int, default=None, metavar="N",
                     help="accepted with a warning: ringcomm does not use NCCL")
    lib.add_argument("--thread-affinity", type=int, default=None, metavar="CPU",
                     help="accepted with a warning: pin the worker with taskset instead")
    lib.add_argument("--gloo-timeout-seconds", type=float, default=None, metavar="S",
                     help="seconds to wait for a peer's data before declaring it lost (RINGCOMM_PEER_TIMEOUT)")
    lib.add_argument("--log-level", default=None, choices=sorted(LOG_LEVELS, key=list(LOG_LEVELS).index),
                     type=str.upper, help="level of the workers' 'ringcomm' logger (RINGCOMM_LOG_LEVEL; TRACE "
                                          "is DEBUG, FATAL is CRITICAL)")
    stamp = lib.add_mutually_exclusive_group()
    stamp.add_argument("--log-with-timestamp", "--no-log-hide-timestamp", dest="log_with_timestamp",
                       action="store_const", const=True, default=None, help=argparse.SUPPRESS)
    stamp.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_with_timestamp",
                       action="store_const", const=False, help="accepted with a warning (see the launcher guide)")
    lib.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                     help="start each relayed line of output with the time it arrived")


def _add_elastic_arguments(parser: argparse.ArgumentParser) -> None:
    """Elastic mode (``--host-discovery-script``): see :mod:`ringcomm.launch.elastic_driver`."""
    group = parser.add_argument_group("elastic training (with --host-discovery-script)")
    group.add_argument("--host-discovery-script", default=None, metavar="SCRIPT",
                       help="run elastically: SCRIPT prints the available hosts as host:slots lines; polled "
                            "every second; workers come and go as it changes")
    group.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, default=None, metavar="N",
                       help="fewest workers to run with (default: -np)")
    group.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, default=None, metavar="N",
                       help="most workers to run with (default: every discovered slot)")
    group.add_argument("--slots-per-host", type=int, default=1, metavar="N",
                       help="slots of a discovered host printed without :slots (default: 1)")
    group.add_argument("--elastic-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="how long to wait for --min-np workers before failing (default: 600)")
    group.add_argument("--reset-limit", type=int, default=None, metavar="N",
                       help="fail after the job re-formed N times (default: 100; 0: fail at the first loss)")
    group.add_argument("--blacklist-failures", type=int, default=1, metavar="N",
                       help="blacklist a host once N of its workers failed (default: 1, as Horovod)")
    group.add_argument("--blacklist-cooldown", type=float, default=60.0, metavar="SECONDS",
                       help="a blacklisted host gets no new workers for this long, doubled each time (default: 60)")
    group.add_argument("--blacklist-cooldown-range", type=float, nargs=2, default=None, metavar=("MIN", "MAX"),
                       help="horovodrun's form: the cooldown starts at MIN seconds (as --blacklist-cooldown)")


# --------------------------------------------------------------------------- config file and settings


def load_config_file(path: str) -> dict[str, Any]:
    """Read horovodrun's YAML ``--config-file``; raises InvalidInputError when it cannot."""
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise InvalidInputError(
            f"--config-file {path}: reading YAML needs PyYAML: pip install pyyaml (or pip install 'ringcomm[yaml]')"
        ) from None
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as exc:
        raise InvalidInputError(f"cannot read --config-file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise InvalidInputError(f"--config-file {path} is not valid YAML: {exc}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise InvalidInputError(f"--config-file {path}: expected a mapping of sections, got {type(config).__name__}")
    return config


def apply_config(args: argparse.Namespace, config: Mapping[str, Any], source: str = "--config-file") -> None:
    """Fill the settings of ``args`` the command line left unset (``None``) from horovodrun's config mapping."""
    known = ", ".join(["controller", *CONFIG_KEYS])
    for section, body in config.items():
        if section == "controller":
            if str(body).lower() not in ("gloo", "mpi"):
                raise InvalidInputError(f"{source}: controller: {body!r}; use gloo or mpi")
            if not (args.use_gloo or args.use_mpi or args.use_jsrun):
                setattr(args, f"use_{str(body).lower()}", True)
            continue
        if section not in CONFIG_KEYS:
            raise InvalidInputError(f"{source}: unknown section {section!r}; known sections: {known}")
        if body is None:
            continue
        if not isinstance(body, Mapping):
            raise InvalidInputError(f"{source}: section {section!r} must be a mapping, got {body!r}")
        for key, value in body.items():
            dest = CONFIG_KEYS[section].get(key)
            if dest is None:
                raise InvalidInputError(f"{source}: unknown key {section}.{key}; known keys of {section}: "
                                        f"{', '.join(CONFIG_KEYS[section])}")
            if getattr(args, dest, None) is None and value is not None:
                setattr(args, dest, value)


def _validate(args: argparse.Namespace) -> None:
    for dest in ("fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "stall_check_warning_time_seconds",
                 "stall_check_shutdown_time_seconds", "num_nccl_streams", "autotune_warmup_samples",
                 "autotune_steps_per_sample", "autotune_bayes_opt_max_samples"):
        value = getattr(args, dest, None)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
            raise InvalidInputError(f"--{dest.replace('_', '-')} must be a number >= 0, got {value!r}")
    if args.gloo_timeout_seconds is not None and not args.gloo_timeout_seconds > 0:
        raise InvalidInputError(f"--gloo-timeout-seconds must be > 0, got {args.gloo_timeout_seconds!r}")
    noise = args.autotune_gaussian_process_noise
    if noise is not None and not 0 <= noise <= 1:
        raise InvalidInputError(f"--autotune-gaussian-process-noise must be in [0, 1], got {noise!r}")
    if args.log_level is not None and str(args.log_level).upper() not in LOG_LEVELS:
        raise InvalidInputError(f"log level {args.log_level!r}: use one of {', '.join(LOG_LEVELS)}")


def _flag(value: object) -> str:
    return "1" if value else "0"


def settings_env(args: argparse.Namespace) -> dict[str, str]:
    """The ``RINGCOMM_*`` variables the flags (and config file) in ``args`` set for every worker.

    They override the same variables in the launcher's environment, as horovodrun's flags do.
    """
    env: dict[str, str] = {}
    if args.fusion_threshold_mb is not None:
        env["RINGCOMM_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb) * 1024 * 1024)
    if args.cycle_time_ms is not None:
        env["RINGCOMM_CYCLE_TIME"] = repr(float(args.cycle_time_ms))
    if args.cache_capacity is not None:
        env["RINGCOMM_CACHE_CAPACITY"] = str(int(args.cache_capacity))
    if args.hierarchical_allreduce is not None:
        env["RINGCOMM_HIERARCHICAL_ALLREDUCE"] = _flag(args.hierarchical_allreduce)
    if args.timeline_filename:
        env["RINGCOMM_TIMELINE"] = str(args.timeline_filename)
        if args.timeline_mark_cycles is not None:
            env["RINGCOMM_TIMELINE_MARK_CYCLES"] = _flag(args.timeline_mark_cycles)
    if args.stall_check_warning_time_seconds is not None:
        env["RINGCOMM_STALL_CHECK_SECONDS"] = repr(float(args.stall_check_warning_time_seconds))
    if args.stall_check_shutdown_time_seconds is not None:
        env["RINGCOMM_STALL_SHUTDOWN_SECONDS"] = repr(float(args.stall_check_shutdown_time_seconds))
    if args.stall_check_enabled is False:
        env["RINGCOMM_STALL_CHECK_SECONDS"] = "inf"
        env["RINGCOMM_STALL_SHUTDOWN_SECONDS"] = "0"
    if args.gloo_timeout_seconds is not None:
        env["RINGCOMM_PEER_TIMEOUT"] = repr(float(args.gloo_timeout_seconds))
    if args.log_level is not None:
        env["RINGCOMM_LOG_LEVEL"] = LOG_LEVELS[str(args.log_level).upper()]
    if args.start_timeout is not None:
        env["RINGCOMM_START_TIMEOUT"] = repr(float(args.start_timeout))
    if args.network_interfaces:
        env["RINGCOMM_NETWORK_INTERFACE"] = args.network_interfaces[0]
    # as horovodrun's --gloo (HOROVOD_CONTROLLER and HOROVOD_CPU_OPERATIONS=gloo) and --mpi / --jsrun (MPI):
    # what gloo_enabled() and mpi_enabled() answer in the workers
    controller = "gloo" if args.use_gloo else "mpi" if args.use_mpi or args.use_jsrun else None
    if controller is not None:
        env["RINGCOMM_CONTROLLER"] = env["RINGCOMM_CPU_OPERATIONS"] = controller
    return env


def notices(args: argparse.Namespace) -> list[str]:
    """Warnings for settings in ``args`` that are accepted but change nothing here."""
    out = [text for dest, text in _NO_EFFECT.items()
           if dest != "log_with_timestamp" and getattr(args, dest, None) not in (None, False)]
    if args.log_with_timestamp is False:  # with timestamps is what ringcomm's log handler does
        out.append(_NO_EFFECT["log_with_timestamp"])
    if args.timeline_mark_cycles and not args.timeline_filename:
        out.append("--timeline-mark-cycles needs --timeline-filename (as in horovodrun): no timeline is written")
    if args.network_interfaces and len(args.network_interfaces) > 1:
        out.append(f"--network-interface: ringcomm uses one interface; using {args.network_interfaces[0]}, "
                   f"not {', '.join(args.network_interfaces[1:])}")
    if is_elastic(args):
        for flag, given in (("--output-filename", args.output_filename),
                            ("--prefix-output-with-timestamp", args.prefix_output_with_timestamp)):
            if given:
                out.append(f"{flag} applies to static jobs: in elastic mode (--host-discovery-script) the "
                           "workers' output is relayed to the terminal only")
    if args.blacklist_cooldown_range is not None:
        low, high = args.blacklist_cooldown_range
        out.append(f"--blacklist-cooldown-range {low:g} {high:g}: a blacklisted host's cooldown starts at {low:g} s "
                   "and doubles each time it is blacklisted again (--blacklist-cooldown)")
    return out


def refusals(args: argparse.Namespace) -> list[str]:
    """Errors for flags in ``args`` that ask for something ringcomm-run cannot do, each with the way to do it."""
    out = []
    if args.mpi_args is not None:
        out.append(f"--mpi-args {args.mpi_args!r}: ringcomm-run starts the workers itself, there is no mpirun to "
                   "pass them to; place ranks with -H/--hostfile, set environment variables before ringcomm-run")
    if args.binding_args is not None:
        out.append(f"--binding-args {args.binding_args!r}: there is no mpirun or jsrun to bind processes; bind in "
                   "the command, e.g. ringcomm-run -np 2 numactl --cpunodebind=0 python train.py")
    return out


def check_build_text() -> str:
    """What this build of ringcomm supports, laid out as horovodrun's ``--check-build``."""
    from .. import __version__

    try:
        import torch  # noqa: F401
        has_torch = True
    except ImportError:
        has_torch = False

    def box(on: bool) -> str:
        return "X" if on else " "

    return "\n".join([
        f"ringcomm v{__version__}:",
        "",
        "Available Frameworks:",
        "    [ ] TensorFlow",
        f"    [{box(has_torch)}] PyTorch (ringcomm_torch)",
        "    [ ] MXNet",
        "    [X] NumPy (ringcomm)",
        "",
        "Available Controllers:",
        "    [X] ringcomm (rank-0 coordination; --gloo and --mpi select it too)",
        "    [ ] MPI",
        "    [ ] Gloo",
        "",
        "Available Tensor Operations:",
        "    [ ] NCCL",
        "    [ ] DDL",
        "    [ ] CCL",
        "    [ ] MPI",
        "    [ ] Gloo",
        "    [X] ringcomm (ZeroMQ rings, shared memory on one host)",
    ])


# --------------------------------------------------------------------------- parse


def parse_args(argv: Sequence[str] | None = None, prog: str = _PROG) -> argparse.Namespace:
    """Parse and validate ``argv``; exits with status 2 and a message that says what to pass.

    ``--check-build`` prints :func:`check_build_text` and exits 0.  The result carries
    ``settings_env`` (the ``RINGCOMM_*`` variables for the workers) and ``notices`` (warnings).
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.check_build:
        print(check_build_text())
        parser.exit(0)
    if args.num_proc is None:
        parser.error("the following arguments are required: -np/--num-proc")
    if args.num_proc < 1:
        parser.error(f"-np must be at least 1 (the number of worker processes, e.g. -np 4), got {args.num_proc}")
    if args.start_timeout is not None and not args.start_timeout > 0:
        parser.error(f"--start-timeout must be > 0 seconds, got {args.start_timeout}")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        parser.error(f"--ssh-port must be 1..65535, got {args.ssh_port}")
    try:
        if args.config_file is not None:
            apply_config(args, load_config_file(args.config_file), f"--config-file {args.config_file}")
        _validate(args)
        refused = refusals(args)
        if refused:
            raise InvalidInputError("; ".join(refused))
        args.placements = plan_hosts(args.hosts, args.hostfile, args.num_proc)
    except InvalidInputError as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.error(f"cannot read --hostfile {args.hostfile}: {exc.strerror or exc}")
    args.network_interface = args.network_interfaces[0] if args.network_interfaces else None
    if args.blacklist_cooldown_range is not None:
        args.blacklist_cooldown = args.blacklist_cooldown_range[0]
    _check_elastic_arguments(parser, args)
    # -H/--hostfile were read above (plan_hosts): reading them again cannot fail
    args.fixed_hosts = fixed_elastic_hosts(args) if is_elastic(args) and not args.host_discovery_script else None
    if not args.command:
        parser.error(f"no command given: put the program after the options, e.g. {prog} -np 2 python train.py")
    args.settings_env = settings_env(args)
    args.prog = prog  # the command the user typed: the launcher's messages start with it
    args.notices = notices(args)
    return args


def _elastic_flags(args: argparse.Namespace) -> list[str]:
    return [flag for flag, value in (("--min-np", args.min_np), ("--max-np", args.max_np),
                                     ("--reset-limit", args.reset_limit)) if value is not None]


def is_elastic(args: argparse.Namespace) -> bool:
    """Elastic mode: a discovery script, or (horovodrun's fault tolerance without scaling) fixed hosts from
    -H/--hostfile with --min-np, --max-np or --reset-limit."""
    if getattr(args, "host_discovery_script", None) is not None:
        return True
    fixed = getattr(args, "hosts", None) is not None or getattr(args, "hostfile", None) is not None
    return fixed and bool(_elastic_flags(args))


def fixed_elastic_hosts(args: argparse.Namespace) -> dict[str, int]:
    """``{host: slots}`` of -H/--hostfile, for an elastic job without a discovery script."""
    if args.hosts is not None:
        listed = _hosts.parse_hosts(args.hosts)
    else:
        with open(args.hostfile, encoding="utf-8") as f:
            listed = _hosts.parse_hostfile(f.read(), args.hostfile)
    out: dict[str, int] = {}
    for host in listed:
        out[host.name] = out.get(host.name, 0) + host.slots
    return out


def _check_elastic_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.host_discovery_script is None:
        given = _elastic_flags(args)
        if given and args.hosts is None and args.hostfile is None:
            parser.error(f"{', '.join(given)} need --host-discovery-script or -H/--hostfile (elastic mode)")
        if not given:
            return
    elif args.hosts is not None or args.hostfile is not None:
        parser.error("-H/--hostfile and --host-discovery-script exclude each other: in elastic mode the script "
                     "names the hosts")
    min_np = args.min_np if args.min_np is not None else args.num_proc
    if min_np < 1:
        parser.error(f"--min-np must be at least 1, got {min_np}")
    if min_np > args.num_proc:
        parser.error(f"--min-np {min_np} is larger than -np {args.num_proc}")
    if args.max_np is not None and args.max_np < args.num_proc:
        parser.error(f"--max-np {args.max_np} is smaller than -np {args.num_proc}")
    if args.slots_per_host < 1:
        parser.error(f"--slots-per-host must be at least 1, got {args.slots_per_host}")
    if not args.elastic_timeout > 0:
        parser.error(f"--elastic-timeout must be > 0 seconds, got {args.elastic_timeout}")
    if args.reset_limit is not None and args.reset_limit < 0:
        parser.error(f"--reset-limit must be >= 0, got {args.reset_limit}")
    if args.blacklist_failures < 1 or args.blacklist_cooldown < 0:
        parser.error("--blacklist-failures must be >= 1 and --blacklist-cooldown >= 0")


def plan_hosts(hosts: str | None, hostfile: str | None, num_proc: int) -> list[_hosts.Placement] | None:
    """Where each rank runs, from ``-H`` or ``--hostfile``; ``None`` without either (all on this machine)."""
    if hosts is not None:
        return _hosts.assign(_hosts.parse_hosts(hosts), num_proc)
    if hostfile is not None:
        with open(hostfile, encoding="utf-8") as f:
            return _hosts.assign(_hosts.parse_hostfile(f.read(), hostfile), num_proc)
    return None
