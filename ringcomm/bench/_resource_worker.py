"""Resource-use worker: RSS across many allreduces, then CPU while idle, for ringcomm or gloo.

    python -m ringcomm.launch.launcher -np 2 python -m ringcomm.bench._resource_worker \\
        --system ringcomm --bytes 67108864 --ops 1000 --idle 10 --out /tmp/res.json

Every rank measures itself; rank 0 writes all ranks' figures to ``--out``:
``rss_mib`` (resident set after 10, 100 and ``--ops`` allreduces, from
``/proc/self/status``), and ``idle_cpu_percent`` (user+system CPU over
``--idle`` seconds of doing nothing after the allreduces, as a percentage of
one core), plus the process's thread and file-descriptor counts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._timing import start_watchdog


def rss_mib() -> float:
    """This process's resident set size in MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench._resource_worker", description=__doc__)
    parser.add_argument("--system", choices=("ringcomm", "gloo"), required=True)
    parser.add_argument("--bytes", type=int, default=64 << 20)
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=1800.0)
    args = parser.parse_args(argv)
    start_watchdog(args.deadline)
    buf = np.ones(args.bytes // 4, dtype=np.float32)
    if args.system == "ringcomm":
        import ringcomm as rc

        rc.init()
        rank = rc.rank()

        def allreduce() -> None:
            rc.allreduce(buf, op=rc.Sum, name="res.grad", out=buf)

        def gather(obj: Any) -> list[Any]:
            return rc.allgather_object(obj, name="res.gather")

        barrier: Callable[..., Any] = rc.barrier
        close: Callable[..., Any] = rc.shutdown
    else:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world_size, timeout=datetime.timedelta(seconds=args.deadline))
        rank = dist.get_rank()
        tensor = torch.from_numpy(buf)

        def allreduce() -> None:
            dist.all_reduce(tensor)

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out

        barrier, close = dist.barrier, dist.destroy_process_group
    rss: dict[int, float] = {}
    checkpoints = {10, 100, args.ops}
    t0 = time.perf_counter()
    for i in range(1, args.ops + 1):
        allreduce()
        buf.fill(1.0)  # keep the values finite
        if i in checkpoints:
            rss[i] = round(rss_mib(), 2)
    op_seconds = (time.perf_counter() - t0) / args.ops
    barrier()
    c0, w0 = _cpu_seconds(), time.monotonic()
    time.sleep(args.idle)
    idle = 100 * (_cpu_seconds() - c0) / (time.monotonic() - w0)
    mine = {"rank": rank, "rss_mib": rss, "op_seconds": op_seconds, "idle_cpu_percent": round(idle, 3),
            "threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}
    everyone = gather(mine)
    if rank == 0:
        with open(args.out + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"system": args.system, "bytes": args.bytes, "ops": args.ops, "idle_s": args.idle,
                       "ranks": everyone}, f)
        os.replace(args.out + ".tmp", args.out)
    barrier()
    close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
