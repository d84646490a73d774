"""Worker side of the collective benchmarks: the timing loop every backend shares.

A backend (ringcomm, gloo, Horovod) supplies a :class:`Backend`; the loop,
per size: checks the result of one op, runs the warmup iterations, then
times each iteration on every rank after a barrier, gathers the times to
rank 0 and keeps, per iteration, the slowest rank's time.  Rank 0 writes
the results as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import faulthandler
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

OPS = ("allreduce", "allgather", "broadcast")


class Backend(Protocol):
    """What a benchmarked system offers the timing loop."""

    name: str
    rank: int
    size: int

    def barrier(self) -> None: ...

    def prepare(self, op: str, count: int) -> tuple[Callable[[], None], Callable[[], None]]:
        """For ``op`` on ``count`` float32 elements per rank: ``(step, check)``.

        ``step()`` runs the op once (the timed part); ``check()`` fills the
        buffers with rank-dependent values, runs the op, raises if the result
        is wrong, then zeroes the buffers so repeated in-place sums stay finite.
        """
        ...

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); ``None`` elsewhere."""
        ...

    def close(self) -> None: ...


def elements_per_rank(op: str, nbytes: int, size: int) -> int:
    """float32 elements each rank contributes: allgather sizes are the gathered total."""
    count = max(1, nbytes // 4)
    return max(1, count // size) if op == "allgather" else count


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Arguments every collective worker takes."""
    parser.add_argument("--op", choices=OPS, required=True)
    parser.add_argument("--plan", required=True,
                        help="comma-separated BYTES:ITERS pairs, e.g. 4096:50,16777216:10")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the buffers are CUDA tensors (every rank on cuda:rank %% device count)")
    parser.add_argument("--out", required=True, help="rank 0 writes its JSON results here")
    parser.add_argument("--loop", action="store_true",
                        help="time ops back to back (no barrier between iterations), as a training loop runs them")
    parser.add_argument("--idle", type=float, default=0.0,
                        help="afterwards, sleep this many seconds and report the CPU each rank burned meanwhile")
    parser.add_argument("--deadline", type=float, default=600.0,
                        help="seconds after which the worker exits on its own (a safety net)")


def parse_plan(text: str) -> list[tuple[int, int]]:
    """``"4096:50,65536:20"`` -> ``[(4096, 50), (65536, 20)]``."""
    plan = []
    for item in text.split(","):
        nbytes, _, iters = item.partition(":")
        plan.append((int(nbytes), int(iters)))
    return plan


#: Seconds a worker's own deadline (``--deadline``) runs past its job's timeout: the bench stops the job
#: first, and the worker's deadline is the safety net behind it.
DEADLINE_MARGIN = 30.0
#: A worker still running this many seconds before its job's timeout prints every thread's stack, so
#: a job that hangs says where in its log, whose last lines the bench keeps.
STACKS_BEFORE_TIMEOUT = 3.0


def worker_deadline(job_timeout: float) -> float:
    """The ``--deadline`` to give a worker of a job that the bench stops after ``job_timeout`` seconds."""
    return job_timeout + DEADLINE_MARGIN


def print_stacks() -> None:
    """Every thread's stack on stderr, under one line that says why."""
    print("[bench worker] still running just before the job's timeout; every thread's stack follows",
          file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def exit_now(code: int) -> None:
    """End a worker whose results are written without tearing torch down: that costs a second of CPU,
    and DDP's reducer, freed at exit, joins gloo's threads, which can wait forever on a peer that has
    already gone (seen: a rank alive minutes after its job's last barrier)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def process_age() -> float:
    """Seconds since this process started (0 where /proc does not say): a worker's imports (torch's
    take seconds on a loaded machine) come out of its deadline too."""
    try:
        with open("/proc/self/stat", "rb") as f:
            started = int(f.read().rpartition(b")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime", "rb") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def start_watchdog(seconds: float) -> None:
    """Exit the process (status 124) after ``seconds``, or as soon as its parent is gone; print every
    thread's stack shortly before the job's own timeout (``seconds`` less :data:`DEADLINE_MARGIN`)."""
    parent = os.getppid()
    seconds -= process_age()  # the job's clock started when this process did, before its imports
    deadline = time.monotonic() + seconds
    stacks_at = seconds - DEADLINE_MARGIN - STACKS_BEFORE_TIMEOUT
    if stacks_at > 0:
        timer = threading.Timer(stacks_at, print_stacks)
        timer.daemon = True
        timer.start()

    def watch() -> None:
        while True:
            time.sleep(0.25)
            if time.monotonic() > deadline or os.getppid() != parent:
                os._exit(124)

    threading.Thread(target=watch, name="bench-watchdog", daemon=True).start()
    # The thread needs the GIL; a backend stuck in C++ holding it (seen: a gloo worker alive an hour
    # and a half after its deadline) would keep it from running.  faulthandler's timer is a C thread:
    # it prints every thread's stack and ends the process without the GIL.
    faulthandler.dump_traceback_later(seconds + 5.0, exit=True)


def run(backend: Backend, op: str, plan: Sequence[tuple[int, int]], warmup: int,
        loop: bool = False) -> list[dict[str, Any]] | None:
    """Time ``op`` for every ``(bytes, iters)`` in ``plan``; rank 0 gets the per-size results.

    ``loop``: one barrier before the timed iterations, none between them.
    """
    results: list[dict[str, Any]] = []
    for nbytes, iters in plan:
        count = elements_per_rank(op, nbytes, backend.size)
        step, check = backend.prepare(op, count)
        check()
        for _ in range(warmup):
            step()
        times: list[float] = []
        if loop:
            backend.barrier()
        cpu = resource.getrusage(resource.RUSAGE_SELF)  # microseconds (os.times counts 10 ms ticks)
        for _ in range(iters):
            if not loop:
                backend.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        gathered = backend.gather((times, after.ru_utime - cpu.ru_utime, after.ru_stime - cpu.ru_stime))
        if gathered is not None:
            per_rank = [t for t, _, _ in gathered]
            results.append({
                "bytes": nbytes,
                "elements_per_rank": count,
                "iters": iters,
                "times_s": [max(rank_times) for rank_times in zip(*per_rank)],
                "rank_median_s": [sorted(t)[len(t) // 2] for t in per_rank],
                # each rank's CPU (every thread of its process, user and system) over the timed ops
                # (with ``loop`` off it includes the barriers between them)
                "rank_cpu_s": [[user, system] for _, user, system in gathered],
            })
    return results if backend.rank == 0 else None


def idle_cpu_seconds(seconds: float) -> float:
    """CPU seconds (every thread of this process) burned while the caller sleeps ``seconds``."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(backend_factory: Callable[[argparse.Namespace], Backend], parser: argparse.ArgumentParser,
         argv: Sequence[str] | None = None) -> int:
    """Parse arguments, build the backend, run the loop, write rank 0's JSON; returns the exit status."""
    add_common_args(parser)
    args = parser.parse_args(argv)
    start_watchdog(args.deadline)
    started = time.perf_counter()
    backend = backend_factory(args)
    init_s = time.perf_counter() - started
    try:
        results = run(backend, args.op, parse_plan(args.plan), args.warmup, args.loop)
        idle_cpu = idle_cpu_seconds(args.idle) if args.idle > 0 else None
        if idle_cpu is not None:
            everyone = backend.gather(idle_cpu)
        if results is not None:
            payload = {"system": backend.name, "op": args.op, "np": backend.size, "warmup": args.warmup,
                       "init_s": init_s, "results": results}
            if idle_cpu is not None:
                payload["idle_s"] = args.idle
                payload["idle_cpu_s"] = everyone
            tmp = args.out + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(payload, f)
            os.replace(tmp, args.out)
    finally:
        backend.close()
    return 0
