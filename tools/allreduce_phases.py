"""Where one CUDA allreduce's time goes, per phase, under ``ringcomm-run``:

    ringcomm-run -np 2 python tools/allreduce_phases.py [--sizes 4K 1M] [--ops 100]

Each op, after a barrier and a device synchronize on every rank: ``call`` is
``hvd.allreduce_async`` returning (the caller's thread queues work and submits the agreement),
``sync`` is ``hvd.synchronize`` returning (the host side of the op is done and the result's
copy is queued), ``device`` is ``torch.cuda.synchronize()`` returning after that (what the
GPU still had to do).  A ``device`` time far above the GPU work of the op means the GPU waited,
for instance for another process's event.  Rank 0 prints the median and p90 of each, in
microseconds, with the settings that choose the path (``RINGCOMM_DEVICE_IPC``,
``RINGCOMM_DEVICE_IPC_MIN_BYTES``, ``RINGCOMM_DEVICE_IPC_WAIT``).

Without a GPU it runs the same calls on the fake device (``ringcomm_torch.device.FakeOps`` with
its model of IPC), which times the host side alone.

``--profile N`` then runs N more ops (call and synchronize, no barrier) under a profiler on rank 0
and prints, per op, the functions that cost the most: with yappi installed, on every thread (the
caller, the stager, the return threads, the engine and the lane) by CPU time, which counts the
CUDA runtime calls torch makes from each function as that function's own; without it, cProfile
on the calling thread alone, by wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import os
import pstats
import statistics
import threading
import time
from collections.abc import Callable

import torch

import ringcomm_torch as hvd
from ringcomm_torch import device, device_arena


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["4K", "1M", "64M"])
    parser.add_argument("--ops", type=int, default=100)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile N more ops on rank 0 and print the costliest functions per op")
    args = parser.parse_args()
    hvd.init()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    fake = None if cuda else device.FakeOps(ipc=True)
    settle = torch.cuda.synchronize if cuda else (lambda: None)
    knobs = " ".join(f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("RINGCOMM_DEVICE_IPC"))
    with device.override(fake) if fake is not None else contextlib.nullcontext():
        for size in args.sizes:
            n = parse_size(size) // 4
            x = torch.ones(n, device="cuda") if cuda else torch.ones(n)
            arena = device_arena.arena_for(x, hvd.Sum, hvd.global_process_set)
            if arena is not None:  # shared before timing, so every timed op takes one path
                arena.start()
                deadline = time.monotonic() + 60
                while not all(hvd.allgather_object(arena.state in ("ready", "off"))):
                    assert time.monotonic() < deadline, arena.state
                    time.sleep(0.01)
            path = "arena" if arena is not None and all(hvd.allgather_object(arena.state == "ready")) else "pinned"
            for _ in range(10):
                hvd.allreduce(x, op=hvd.Sum, name=f"phases.warm.{size}")
            settle()
            call, sync, dev = [], [], []
            for _ in range(args.ops):
                hvd.barrier()
                settle()
                t0 = time.perf_counter()
                h = hvd.allreduce_async(x, op=hvd.Sum, name=f"phases.{size}")
                t1 = time.perf_counter()
                out = hvd.synchronize(h)
                t2 = time.perf_counter()
                settle()
                t3 = time.perf_counter()
                call.append(t1 - t0)
                sync.append(t2 - t1)
                dev.append(t3 - t2)
            assert float(out.reshape(-1)[0]) == hvd.size(), float(out.reshape(-1)[0])
            if hvd.rank() == 0:
                def us(xs: list[float]) -> str:
                    xs = sorted(xs)
                    return f"{statistics.median(xs) * 1e6:8.1f} / {xs[int(0.9 * (len(xs) - 1))] * 1e6:8.1f}"
                print(f"phases np={hvd.size()} {size:>4} {path:6s} {'cuda' if cuda else 'fake'} "
                      f"call {us(call)}  sync {us(sync)}  device {us(dev)}  (us, p50 / p90) {knobs}", flush=True)
            if args.profile:
                profiled(functools.partial(allreduce, x, f"phases.{size}"), args.profile, hvd.rank() == 0, settle,
                         f"np={hvd.size()} {size} {path} {'cuda' if cuda else 'fake'}")
    hvd.shutdown()


def allreduce(x: torch.Tensor, name: str) -> object:
    return hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum, name=name))


def profiled(op: Callable[[], object], ops: int, here: bool, settle: Callable[[], None], label: str,
             top: int = 15) -> None:
    """Run ``op`` ``ops`` times (every rank), profiled where ``here``; print its costliest functions per op."""
    hvd.barrier()
    settle()
    if not here:
        for _ in range(ops):
            op()
        settle()
        hvd.barrier()
        return
    try:
        import yappi  # type: ignore[import-untyped]
    except ImportError:
        yappi = None
    if yappi is not None:
        yappi.clear_stats()
        yappi.set_clock_type("cpu")
        yappi.start()
        for _ in range(ops):
            op()
        settle()
        yappi.stop()
        names = {th.ident: th.name for th in threading.enumerate()}
        print(f"profile {label}: yappi, CPU us per op over {ops} ops, per thread, by own time "
              "(ttot: with callees)", flush=True)
        for t in sorted(yappi.get_thread_stats(), key=lambda t: -t.ttot):
            if t.ttot / ops < 5e-6:
                continue
            print(f"  thread {names.get(t.tid, t.name)}: {t.ttot / ops * 1e6:8.1f}", flush=True)
            stats = yappi.get_func_stats(filter={"ctx_id": t.id})
            stats.sort("tsub")
            for f in list(stats)[:top]:
                where = f"{os.path.basename(f.module)}:{f.lineno}" if f.lineno else f.module
                print(f"    own {f.tsub / ops * 1e6:7.1f}  ttot {f.ttot / ops * 1e6:7.1f}  calls/op "
                      f"{f.ncall / ops:5.1f}  {f.name} ({where})", flush=True)
    else:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(ops):
            op()
        settle()
        prof.disable()
        print(f"profile {label}: cProfile (no yappi here), the calling thread alone, wall us per op over {ops} "
              "ops, by own time (ttot: with callees)", flush=True)
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, callers)
        for (file, line, func), (_cc, nc, tt, ct, _callers) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
            where = f"{os.path.basename(file)}:{line}" if line else file
            print(f"    own {tt / ops * 1e6:7.1f}  ttot {ct / ops * 1e6:7.1f}  calls/op {nc / ops:5.1f}  {func} ({where})",
                  flush=True)
    hvd.barrier()


if __name__ == "__main__":
    main()
