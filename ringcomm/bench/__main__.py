"""Command line of ``python -m ringcomm.bench``; see the package docstring and ``--help``.

Examples::

    python -m ringcomm.bench allreduce --np 2 4 --sizes 4K 64K 1M 16M 64M --repeats 3
    python -m ringcomm.bench allgather --np 2 --sizes 4K 1M
    python -m ringcomm.bench broadcast --np 4
    python -m ringcomm.bench latency --np 2 4
    python -m ringcomm.bench crosshost --rates 1gbit 10gbit --sizes 1M 16M 64M
    python -m ringcomm.bench cluster -H node1:1,node2:1 --sizes 16M 64M
    python -m ringcomm.bench ceiling
    python -m ringcomm.bench training --np 2
    python -m ringcomm.bench backend --np 2 4 --ops scatter all_to_all_single --sizes 4K 4M
    python -m ringcomm.bench resources --ops 1000 --bytes 64M --idle 10
    python -m ringcomm.bench coordination --ranks 64 256 1024 4096
    python -m ringcomm.bench all --json results.json --plot busbw.png
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import (_launch, _util, backend_ops, ceiling, cluster, collectives, coordination, crosshost, ddp, frameworks,
               latency, report, resources, training)

COLLECTIVE_OPS = ("allreduce", "allgather", "broadcast")
#: Moderate settings of ``all`` (well under 10 minutes on 2 cores).
ALL_SIZES = {"allreduce": ("4K", "64K", "1M", "16M", "64M"), "allgather": ("4K", "1M", "16M"),
             "broadcast": ("4K", "1M", "16M")}


def _size(text: str) -> int:
    try:
        return _util.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one subcommand per benchmark."""
    output = argparse.ArgumentParser(add_help=False)
    out = output.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write every raw number (and machine info) here "
                     "(default: OUT_DIR/<command>-<time>.json)")
    out.add_argument("--plot", metavar="PATH", help="draw bus bandwidth vs size here "
                     "(default: OUT_DIR/<command>-<time>.png; needs matplotlib)")
    out.add_argument("--no-plot", action="store_true", help="draw no plot")
    out.add_argument("--out-dir", default="bench-results", metavar="DIR",
                     help="where files not named by --json/--plot go, with a Markdown copy (default: bench-results)")
    out.add_argument("--job-timeout", type=float, default=300.0, metavar="S",
                     help="seconds one job may run before it is killed (default: 300)")
    ranks = argparse.ArgumentParser(add_help=False)
    ranks.add_argument_group("ranks").add_argument(
        "--rank-python", metavar="COMMAND",
        help="the command that starts each rank's Python, split as a shell splits it, e.g. "
             "'numactl --cpunodebind=0 python3' (default: this interpreter)")

    coll = argparse.ArgumentParser(add_help=False)
    g = coll.add_argument_group("collective")
    g.add_argument("--np", type=_positive, nargs="+", default=list(collectives.DEFAULT_NPS), metavar="N",
                   help="world sizes (default: 2 4)")
    g.add_argument("--sizes", type=_size, nargs="+", metavar="SIZE", default=None,
                   help="message sizes in bytes, K/M/G suffixes (default: 4K 64K 1M 16M 64M); "
                        "for allgather, the gathered total")
    g.add_argument("--iters", type=_positive, default=None,
                   help="timed iterations per size and job (default: 50 up to 1 MiB, 20 up to 16 MiB, else 10)")
    g.add_argument("--warmup", type=int, default=3, help="untimed iterations per size and job (default: 3)")
    g.add_argument("--repeats", type=_positive, default=3,
                   help="alternating rounds (one job per system each) per world size (default: 3)")
    g.add_argument("--systems", nargs="+", choices=("ringcomm", "gloo", "horovod", _launch.ENCRYPTED),
                   default=["ringcomm", "gloo", "horovod"],
                   help="systems to run (default: ringcomm, gloo, horovod; Horovod only if importable)")
    g.add_argument("--encrypt", action="store_true",
                   help=f"also run ringcomm with RINGCOMM_ENCRYPT=1 ({_launch.ENCRYPTED}), alternated with the "
                        "others; the table gains an encrypted/plain latency column")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: CUDA tensors, ringcomm through ringcomm_torch vs gloo (default: cpu)")

    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench",
                                     description="Benchmark ringcomm side by side with torch.distributed gloo.",
                                     epilog="A measuring tool: absolute numbers drift, compare ratios from one run.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for op in COLLECTIVE_OPS:
        sub.add_parser(op, parents=[coll, output, ranks], help=f"{op} latency and bus bandwidth, ringcomm vs gloo")

    lat = sub.add_parser("latency", parents=[output, ranks],
                         help="small allreduces back to back: p10/p50/p90/p99 vs gloo, MPI and a raw round trip")
    lat.add_argument("--np", type=_positive, nargs="+", default=[2, 4], metavar="N", help="world sizes (default: 2 4)")
    lat.add_argument("--bytes", type=_size, default=4096, help="message size (default: 4K)")
    lat.add_argument("--ops", type=_positive, default=1000, help="timed ops per job (default: 1000)")
    lat.add_argument("--warmup", type=int, default=100, help="untimed ops per job (default: 100)")
    lat.add_argument("--repeats", type=_positive, default=3, help="alternating rounds (default: 3)")
    lat.add_argument("--idle", type=float, default=2.0,
                     help="seconds each ringcomm/gloo rank then sleeps while its CPU is measured (default: 2)")
    lat.add_argument("--systems", nargs="+", choices=latency.SYSTEMS, default=list(latency.SYSTEMS),
                     help="systems to run (default: all; MPI only if mpi4py and mpirun are installed)")

    xh = sub.add_parser("crosshost", parents=[output],
                        help="allreduce across two network-namespace hosts over a shaped link, ringcomm vs gloo (root)")
    xh.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"], help="link rates, tc units (default: 1gbit 10gbit)")
    xh.add_argument("--sizes", type=_size, nargs="+", default=[1 << 20, 16 << 20, 64 << 20], metavar="SIZE",
                    help="allreduce sizes (default: 1M 16M 64M)")
    xh.add_argument("--ranks-per-host", type=_positive, default=2, help="ranks on each of the 2 hosts (default: 2)")
    xh.add_argument("--iters", type=_positive, default=5, help="timed ops per size and job (default: 5)")
    xh.add_argument("--warmup", type=int, default=2, help="untimed ops per size and job (default: 2)")
    xh.add_argument("--repeats", type=_positive, default=3, help="alternating rounds (default: 3)")
    xh.add_argument("--loop", action="store_true",
                    help="time ops back to back after one barrier, as a training loop runs them (default: a "
                         "barrier before each op)")
    xh.add_argument("--systems", nargs="+", choices=crosshost.SYSTEMS, default=["ringcomm", "gloo"],
                    help="systems to alternate (default: ringcomm gloo; ringcomm-flat: hierarchical allreduce off; ringcomm-ring: recursive doubling off; ringcomm-lane: the small-op lane across hosts on; ringcomm-zmq: every payload on ZeroMQ, no TCP streams; plain-ring: a ring allreduce in plain Python on the exchange's connections, the ceiling for an allreduce on these CPUs)")

    cl = sub.add_parser("cluster", parents=[output],
                        help="allreduce on your own hosts (-H, over ssh): ringcomm vs gloo vs a plain-socket exchange")
    cl.add_argument("-H", "--hosts", required=True, metavar="HOST:SLOTS,...",
                    help="the hosts and ranks on each, as the launcher's -H (e.g. node1:1,node2:1)")
    cl.add_argument("--sizes", type=_size, nargs="+", default=[16 << 20, 64 << 20], metavar="SIZE",
                    help="allreduce sizes (default: 16M 64M)")
    cl.add_argument("--iters", type=_positive, default=10, help="timed ops per size and job (default: 10)")
    cl.add_argument("--warmup", type=int, default=2, help="untimed ops per size and job (default: 2)")
    cl.add_argument("--repeats", type=_positive, default=3, help="alternating rounds (default: 3)")
    cl.add_argument("--systems", nargs="+", choices=cluster.CHOICES, default=list(cluster.SYSTEMS),
                    help="systems to alternate with the exchange (default: ringcomm gloo; plain-ring: a ring allreduce "
                         "in plain Python on the exchange's connections, the ceiling for an allreduce on these CPUs)")
    cl.add_argument("--ssh-command", help="the launcher's --ssh-command (default: ssh)")
    cl.add_argument("--ssh-port", type=_positive, help="the launcher's --ssh-port")
    cl.add_argument("--network-interface", help="the interface every rank binds (the launcher's --network-interface)")
    cl.add_argument("--python", default=sys.executable,
                    help="the Python every host runs, with ringcomm and torch installed (default: this one's path)")
    cl.add_argument("--loop", action="store_true", help="time ops back to back after one barrier")

    ceil = sub.add_parser("ceiling", parents=[output], help="ZeroMQ PUSH->PULL stream and NumPy copy throughput")
    ceil.add_argument("--repeats", type=_positive, default=3, help="runs per transport (default: 3)")
    ceil.add_argument("--count", type=_positive, default=100, help="timed messages per run (default: 100)")
    ceil.add_argument("--message-size", type=_size, default=16 << 20, help="message size (default: 16M)")

    train = sub.add_parser("training", parents=[output, ranks], help="small-CNN img/s: one process, DDP, ringcomm_torch")
    train.add_argument("--np", type=_positive, nargs="+", default=[2], metavar="N", help="world sizes (default: 2)")
    train.add_argument("--steps", type=_positive, default=30, help="timed steps per job (default: 30)")
    train.add_argument("--warmup", type=int, default=5, help="untimed steps per job (default: 5)")
    train.add_argument("--batch", type=_positive, default=32, help="images per rank and step (default: 32)")
    train.add_argument("--repeats", type=_positive, default=3, help="alternating rounds (default: 3)")
    train.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="cuda: resnet18 on the GPU, ringcomm_torch vs DDP on gloo and on ringcomm (default: cpu)")
    train.add_argument("--model", choices=("small", "resnet18", "exchange"), default="",
                       help="the model (default: small on the CPU, resnet18 with --device cuda; exchange: "
                            "resnet18's gradients with next to no compute, the GPU's regime on a CPU, against "
                            "DDP on gloo and on ringcomm)")
    train.add_argument("--setups", nargs="+", default=[], metavar="SETUP",
                       choices=[k for k in training.LABELS if k != "single"],
                       help="only these setups (default: every one the device runs): "
                            + ", ".join(k for k in training.LABELS if k != "single"))

    ddpp = sub.add_parser("ddp", parents=[output, ranks],
                          help='DDP img/s on torch.distributed backend "ringcomm" vs gloo (CNN and MLP)')
    ddpp.add_argument("--np", type=_positive, default=2, metavar="N", help="world size (default: 2)")
    ddpp.add_argument("--models", nargs="+", choices=ddp.MODELS, default=list(ddp.MODELS),
                      help="models (default: cnn mlp)")
    ddpp.add_argument("--steps", type=_positive, default=40, help="timed steps per job (default: 40)")
    ddpp.add_argument("--warmup", type=int, default=15, help="untimed steps per job (default: 15)")
    ddpp.add_argument("--batch", type=_positive, default=32, help="images per rank and step (default: 32)")
    ddpp.add_argument("--repeats", type=_positive, default=5, help="alternating rounds (default: 5)")
    ddpp.add_argument("--framework", choices=frameworks.FRAMEWORKS,
                      help="instead of the models: the framework's example (examples/FRAMEWORK_ringcomm.py) under "
                           "torchrun on each backend; --np, --batch and --repeats apply, --steps is per epoch")
    ddpp.add_argument("--epochs", type=_positive, default=4,
                      help="with --framework: epochs per job, the first untimed (default: 4)")

    bk = sub.add_parser("backend", parents=[output, ranks],
                        help='torch.distributed collectives op by op on backend "ringcomm" vs gloo (p50, p99, mean)')
    bk.add_argument("--np", type=_positive, nargs="+", default=[2], metavar="N", help="world sizes (default: 2)")
    bk.add_argument("--ops", nargs="+", choices=backend_ops.OPS, default=list(backend_ops.DEFAULT_OPS),
                    metavar="OP", help="ops (default: " + " ".join(backend_ops.DEFAULT_OPS) + "; also: "
                    + " ".join(op for op in backend_ops.OPS if op not in backend_ops.DEFAULT_OPS) + ")")
    bk.add_argument("--sizes", type=_size, nargs="+", default=None, metavar="SIZE",
                    help="bytes of float32 per rank (default: " + " ".join(backend_ops.DEFAULT_SIZES) + ")")
    bk.add_argument("--iters", type=_positive, default=200,
                    help="timed calls per op at 256K and below, fewer above (default: 200)")
    bk.add_argument("--warmup", type=int, default=20, help="untimed calls per op (default: 20)")
    bk.add_argument("--repeats", type=_positive, default=2, help="alternating rounds (default: 2)")

    res = sub.add_parser("resources", parents=[output, ranks],
                         help="RSS growth over many allreduces and CPU of an idle job, ringcomm vs gloo")
    res.add_argument("--np", type=_positive, default=2, metavar="N", help="world size (default: 2)")
    res.add_argument("--bytes", type=_size, default=64 << 20, help="allreduce size (default: 64M)")
    res.add_argument("--ops", type=_positive, default=1000, help="allreduces; RSS after 10, 100 and this many "
                     "(default: 1000)")
    res.add_argument("--idle", type=float, default=10.0, help="idle seconds measured afterwards (default: 10)")
    res.add_argument("--systems", nargs="+", choices=("ringcomm", "gloo"), default=["ringcomm", "gloo"],
                     help="systems to run (default: both)")

    coordp = sub.add_parser("coordination", parents=[output],
                            help="rank 0's negotiation work per request for simulated jobs of many ranks")
    coordp.add_argument("--ranks", type=_positive, nargs="+", default=[64, 256, 1024, 4096], metavar="N",
                        help="simulated job sizes (default: 64 256 1024 4096)")
    coordp.add_argument("--tensors", type=_positive, default=20, help="allreduces per step (default: 20)")
    coordp.add_argument("--ops", type=_positive, default=5, help="cached steps after the first (default: 5)")

    everything = sub.add_parser("all", parents=[output, ranks],
                                help="all collectives, the ceilings and training, with moderate defaults")
    everything.add_argument("--np", type=_positive, nargs="+", default=[2, 4], metavar="N",
                            help="world sizes of the collectives (default: 2 4); training uses the smallest")
    everything.add_argument("--repeats", type=_positive, default=2, help="alternating rounds everywhere (default: 2)")
    return parser


def _collective_config(op: str, args: argparse.Namespace) -> collectives.CollectiveConfig:
    sizes = args.sizes or [_util.parse_size(s) for s in collectives.DEFAULT_SIZES]
    systems = list(args.systems)
    if args.encrypt and _launch.ENCRYPTED not in systems:
        systems.insert(systems.index("ringcomm") + 1 if "ringcomm" in systems else 0, _launch.ENCRYPTED)
    return collectives.CollectiveConfig(op=op, nps=args.np, sizes=sizes, iters=args.iters, warmup=args.warmup,
                                        repeats=args.repeats, job_timeout=args.job_timeout, systems=systems,
                                        device=getattr(args, "device", "cpu"))


def run_command(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmarks ``args`` ask for; returns the results (without ``meta``)."""
    results: dict[str, Any] = {}
    if args.command in COLLECTIVE_OPS:
        results["collectives"] = {args.command: collectives.run(_collective_config(args.command, args))}
    elif args.command == "latency":
        results["latency"] = latency.run(latency.LatencyConfig(
            nps=args.np, nbytes=args.bytes, ops=args.ops, warmup=args.warmup, repeats=args.repeats, idle=args.idle,
            systems=args.systems, job_timeout=args.job_timeout))
    elif args.command == "crosshost":
        results["crosshost"] = crosshost.run(crosshost.CrossHostConfig(
            rates=args.rates, sizes=args.sizes, ranks_per_host=args.ranks_per_host, iters=args.iters,
            warmup=args.warmup, repeats=args.repeats, systems=args.systems, job_timeout=max(args.job_timeout, 600.0),
            loop=args.loop))
    elif args.command == "cluster":
        try:
            cluster.host_slots(args.hosts)
        except ValueError as exc:
            raise SystemExit(f"python -m ringcomm.bench cluster: {exc}") from None
        results["cluster"] = cluster.run(cluster.ClusterConfig(
            hosts=args.hosts, sizes=args.sizes, iters=args.iters, warmup=args.warmup, repeats=args.repeats,
            systems=args.systems, ssh_command=args.ssh_command, ssh_port=args.ssh_port,
            network_interface=args.network_interface, python=args.python, job_timeout=max(args.job_timeout, 600.0),
            loop=args.loop))
    elif args.command == "ceiling":
        results["ceiling"] = ceiling.run(ceiling.CeilingConfig(message_bytes=args.message_size, count=args.count,
                                                               repeats=args.repeats, job_timeout=args.job_timeout))
    elif args.command == "training":
        results["training"] = training.run(training.TrainingConfig(
            nps=args.np, batch=args.batch, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
            job_timeout=args.job_timeout, device=args.device, model=args.model, setups=args.setups))
    elif args.command == "ddp" and args.framework:
        results["frameworks"] = frameworks.run(frameworks.FrameworkConfig(
            framework=args.framework, np_=args.np, epochs=args.epochs, steps=args.steps, batch=args.batch,
            repeats=args.repeats, job_timeout=args.job_timeout))
    elif args.command == "ddp":
        results["ddp"] = ddp.run(ddp.DDPConfig(np_=args.np, models=args.models, batch=args.batch, steps=args.steps,
                                               warmup=args.warmup, repeats=args.repeats, job_timeout=args.job_timeout))
    elif args.command == "backend":
        results["backend"] = backend_ops.run(backend_ops.BackendConfig(
            nps=args.np, ops=args.ops, sizes=args.sizes or [_util.parse_size(s) for s in backend_ops.DEFAULT_SIZES],
            iters=args.iters, warmup=args.warmup, repeats=args.repeats, job_timeout=args.job_timeout))
    elif args.command == "resources":
        results["resources"] = resources.run(resources.ResourceConfig(
            np_=args.np, nbytes=args.bytes, ops=args.ops, idle=args.idle, systems=tuple(args.systems),
            job_timeout=max(args.job_timeout, 1200.0)))
    elif args.command == "coordination":
        results["coordination"] = coordination.run(args.ranks, args.tensors, args.ops)
    elif args.command == "all":
        results["collectives"] = {}
        for op in COLLECTIVE_OPS:
            results["collectives"][op] = collectives.run(collectives.CollectiveConfig(
                op=op, nps=args.np, sizes=[_util.parse_size(s) for s in ALL_SIZES[op]], repeats=args.repeats,
                job_timeout=args.job_timeout))
        results["ceiling"] = ceiling.run(ceiling.CeilingConfig(repeats=args.repeats, job_timeout=args.job_timeout))
        if _launch.torch_status() is None:  # else the collectives' notes say that torch is missing
            results["training"] = training.run(training.TrainingConfig(nps=[min(args.np)], repeats=args.repeats,
                                                                       job_timeout=args.job_timeout))
    return results


def _failures(results: dict[str, Any]) -> int:
    runs = [r for s in results.get("collectives", {}).values() for r in s["runs"]]
    runs += results.get("training", {}).get("runs", []) + results.get("ceiling", {}).get("zmq_runs", [])
    runs += results.get("resources", {}).get("runs", []) + results.get("latency", {}).get("runs", [])
    runs += results.get("crosshost", {}).get("runs", []) + results.get("cluster", {}).get("runs", []) + results.get("ddp", {}).get("runs", [])
    runs += results.get("frameworks", {}).get("runs", []) + results.get("backend", {}).get("runs", [])
    return sum(not r["ok"] for r in runs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0, or 1 if any job failed (the report still shows what worked)."""
    args = build_parser().parse_args(argv)
    if getattr(args, "rank_python", None):
        _launch.use_python(shlex.split(args.rank_python))
    no_torch = _launch.torch_status() if args.command in ("training", "ddp", "backend") else None
    if no_torch is not None:
        print(f"python -m ringcomm.bench {args.command} runs torch jobs, and {no_torch}", file=sys.stderr)
        return 2
    if getattr(args, "device", "cpu") == "cuda":
        why = _util.cuda_missing()
        if why is not None:
            print(f"python -m ringcomm.bench: {why}", file=sys.stderr)
            return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(args.out_dir, f"{args.command}-{stamp}")
    started = time.monotonic()
    try:
        results: dict[str, Any] = {"meta": _util.machine_info(), "command": ["python", "-m", "ringcomm.bench",
                                                            *(sys.argv[1:] if argv is None else argv)]}
        results.update(run_command(args))
    except KeyboardInterrupt:
        _util.log("interrupted; every job was stopped")
        return 130
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    text = report.markdown(results)
    sys.stdout.write(text)
    sys.stdout.flush()

    json_path = args.json or base + ".json"
    report.write_json(results, json_path)
    _util.log(f"raw numbers: {json_path}")
    if not args.json:
        with open(base + ".md", "w", encoding="utf-8") as f:
            f.write(text)
        _util.log(f"report: {base}.md")
    sections = list(results.get("collectives", {}).values())
    if sections and not args.no_plot:
        plot_path = args.plot or base + ".png"
        why = report.plot(sections, plot_path, report.short_machine_line(results["meta"]))
        _util.log(f"plot skipped: {why}" if why else f"plot: {plot_path}")
    _util.log(f"finished in {results['elapsed_s']:.0f} s")
    failed = _failures(results)
    if failed:
        _util.log(f"{failed} job(s) failed; their errors are in the JSON")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
