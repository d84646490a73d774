"""Scenarios for the small-op lane (run under ringcomm-run; argv[1] names one, argv[2] is an output dir;
with LANE_TEST_HOSTS=N the ranks name N hosts, rank % N each, so the lane runs across hosts).

digests   a fixed list of small ops with seeded inputs; each rank writes the sha256 of every result
          (the test runs it with the lane on and off and compares)
sweep     rank 1 posts every op as an engine entry (a tiny lane limit); rank 0 leaves a fast op
          unwaited while it blocks on another op that rank 1 reaches only after the first
reorder   the ranks submit two async ops in opposite orders
mismatch  one name, different shapes: every rank gets the mismatch error, then goes on
join      ranks run different numbers of allreduces (9 more per rank), then join
timeline  rank 0 writes a timeline while small ops run
threads   four threads per rank run blocking small ops at once, each under its own names
stalljoin rank 0 gives up a lonely op on a stall (its lane goes off), then every rank joins and goes on
behind    every rank starts a large allreduce, then runs a small one while the large one is in flight
crossed   rank 0 starts a large op and blocks on a small one; rank 1 blocks on the small one first
          (run with a small lane limit, so the large op goes to the engine)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time

import numpy as np

import ringcomm as rc
from ringcomm.job.config import Settings
from ringcomm.errors import MismatchError

SCENARIO, OUT = sys.argv[1], sys.argv[2]
DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]


def init() -> None:
    rank = int(os.environ.get("RINGCOMM_RANK", "0"))
    hosts = int(os.environ.get("LANE_TEST_HOSTS", "1"))
    if hosts > 1:  # ranks that name different hosts: the lane runs over TCP between them
        os.environ["RINGCOMM_HOSTNAME"] = f"lanehost{rank % hosts}"
        os.environ.setdefault("RINGCOMM_NET_LANE_BYTES", "-1")  # on (off by default), unless the test says
    settings = Settings.from_env()
    if SCENARIO == "sweep" and rank == 1:
        settings = dataclasses.replace(settings, shm_lane_bytes=1, net_lane_bytes=1)
    rc.init(settings=settings)


def data(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 100, shape).astype(dtype)


def digests() -> None:
    r, n = rc.rank(), rc.size()
    out = {}
    i = 0
    for dtype in DTYPES:
        for op in (rc.Sum, rc.Min, rc.Max, rc.Product, rc.Average):
            if dtype == "bool" and op is rc.Average:
                continue
            for shape in ((), (7,), (3, 5), (2048,)):
                for pre, post in ((1.0, 1.0), (0.5, 3.0)):
                    x = data(1000 * r + i, shape, dtype)
                    y = rc.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
                    out[f"ar {dtype} {op.name} {shape} {pre}"] = hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest()
                    i += 1
        g = rc.grouped_allreduce([data(r + i, (5,), dtype), data(r + i + 1, (3, 2), dtype)], op=rc.Max)
        out[f"grouped {dtype}"] = hashlib.sha256(b"".join(a.tobytes() for a in g)).hexdigest()
        for root in range(n):
            b = rc.broadcast(data(r * 7 + root, (4, 3), dtype), root)
            out[f"bc {dtype} {root}"] = hashlib.sha256(b.tobytes()).hexdigest()
        a = rc.allgather(data(r + 3, (r + 1, 2), dtype))
        out[f"ag {dtype}"] = hashlib.sha256(a.tobytes()).hexdigest() + str(a.shape)
        # an alltoall split evenly, by splits every rank passes alike, and by splits that differ per rank
        for k, splits in enumerate((None, [(i + 1) % 3 for i in range(n)], [(i + r) % 3 for i in range(n)])):
            rows = 2 * n if splits is None else sum(splits)
            got, counts = rc.alltoall(data(70 * r + k, (rows, 3), dtype), splits)
            out[f"a2a {dtype} {k}"] = hashlib.sha256(got.tobytes()).hexdigest() + str(got.shape) + str(counts.tolist())
        if dtype != "bool":
            for op in (rc.Sum, rc.Average, rc.Max):
                for rows in (2 * n + 1, 1):  # the first ranks take a row more; fewer rows than ranks
                    s = rc.reducescatter(data(50 * r + rows, (rows, 3), dtype), op=op)
                    out[f"rs {dtype} {op.name} {rows}"] = hashlib.sha256(s.tobytes()).hexdigest() + str(s.shape)
        rc.barrier()
    out["object"] = repr(rc.allgather_object({"rank": r}))
    with open(os.path.join(OUT, f"rank{r}.json"), "w") as f:
        json.dump(out, f)


def sweep() -> None:
    r = rc.rank()
    small = np.full(256, r + 1.0, np.float32)
    large = np.ones(1 << 16, np.float32)
    if r == 0:
        h = rc.allreduce_async(small, op=rc.Sum, name="a")  # posted fast; rank 1's 'a' goes to the engine
        rc.allreduce(large, op=rc.Sum, name="b")  # rank 1 reaches 'b' only once 'a' is done there
        assert rc.synchronize(h)[0] == 3.0
    else:
        assert rc.allreduce(small, op=rc.Sum, name="a")[0] == 3.0
        rc.allreduce(large, op=rc.Sum, name="b")
    print("SWEEP OK", flush=True)


def reorder() -> None:
    r = rc.rank()
    x = np.full(8, r + 1.0)
    names = ["p", "q"] if r % 2 == 0 else ["q", "p"]
    handles = {name: rc.allreduce_async(x * (2 if name == "q" else 1), op=rc.Sum, name=name) for name in names}
    n = rc.size()
    total = n * (n + 1) / 2
    assert rc.synchronize(handles["p"])[0] == total and rc.synchronize(handles["q"])[0] == 2 * total
    print("REORDER OK", flush=True)


def mismatch() -> None:
    r = rc.rank()
    try:
        rc.allreduce(np.ones(4 + r, np.float32), name="bad")
    except MismatchError as exc:
        print(f"MISMATCH {exc}", flush=True)
    assert rc.allreduce(np.ones(3), op=rc.Sum)[0] == rc.size()
    print("MISMATCH OK", flush=True)


def join() -> None:
    r = rc.rank()
    out = {}
    for epoch in range(2):  # uneven data, then join, every epoch; the lane starts again after each join
        # each rank runs more ops after the one before it joined than the lane has slots: the joined
        # rank's slots must not hold the others back
        results = [rc.allreduce(np.full(4, float(r + 1)), op=rc.Sum, name=f"e{epoch}.s{i}")[0]
                   for i in range(3 + 9 * r)]
        last = rc.join()
        after = [rc.allreduce(np.full(2, float(r + i)), op=rc.Sum, name=f"e{epoch}.after{i}")[0] for i in range(5)]
        out[str(epoch)] = {"results": results, "last": last, "after": after}
    with open(os.path.join(OUT, f"rank{r}.json"), "w") as f:
        json.dump(out, f)
    print("JOIN OK", flush=True)


def timeline() -> None:
    r = rc.rank()
    if r == 0:
        rc.start_timeline(os.path.join(OUT, "timeline.json"))
    rc.barrier()
    for i in range(20):
        assert rc.allreduce(np.ones(16), op=rc.Sum, name=f"t{i}")[0] == rc.size()
    rc.barrier()
    if r == 0:
        rc.stop_timeline()
    print("TIMELINE OK", flush=True)


def threads() -> None:
    import threading

    r, n = rc.rank(), rc.size()
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(60):
                got = rc.allreduce(np.full(8, float(r + t + i)), op=rc.Sum, name=f"th{t}.{i}")
                assert got[0] == sum(q + t + i for q in range(n)), got
                if i % 20 == 0:
                    b = rc.broadcast(np.full(4, float(r)), 0, name=f"thb{t}.{i}")
                    assert b[0] == 0.0
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert not errors, errors
    print("THREADS OK", flush=True)


def stalljoin() -> None:
    r = rc.rank()
    if r == 0:
        try:
            rc.allreduce(np.ones(3), name="lonely")
        except rc.HorovodInternalError as exc:
            print(f"STALLED {type(exc).__name__}", flush=True)
    else:
        time.sleep(3.5)
    rc.join()
    for i in range(5):
        assert rc.allreduce(np.ones(2), op=rc.Sum, name=f"sj{i}")[0] == rc.size()
    print("STALLJOIN OK", flush=True)


def uneven() -> None:
    """Alltoalls whose ranks split differently (every other one a scatter: only rank 0 sends),
    checked against what each rank should get; then ranks whose rows differ in width fail one on
    every rank."""
    r, n = rc.rank(), rc.size()

    def splits_of(k: int, i: int) -> list[int]:  # rank k's splits for op i
        if i % 2:  # rank 0 sends j + 1 rows to rank j; the others send nothing
            return [j + 1 for j in range(n)] if k == 0 else [0] * n
        return [(k + j + i) % 3 for j in range(n)]

    def rows_of(k: int, i: int) -> np.ndarray:  # rank k's array for op i
        return np.arange(sum(splits_of(k, i)) * 2, dtype=np.float32).reshape(-1, 2) + 1000 * k

    for i in range(6):
        got, counts = rc.alltoall(rows_of(r, i), splits_of(r, i), name=f"u{i}")
        assert counts.tolist() == [splits_of(k, i)[r] for k in range(n)], (i, counts)
        want = [rows_of(k, i)[sum(splits_of(k, i)[:r]):sum(splits_of(k, i)[:r + 1])] for k in range(n)]
        assert np.array_equal(got, np.concatenate(want)), (i, got, want)
    try:
        rc.alltoall(np.zeros((n, 2 + r), np.float32), name="wide")
    except MismatchError as exc:
        print(f"UNEVEN {exc}", flush=True)
    assert rc.allreduce(np.ones(3), op=rc.Sum)[0] == n
    print("UNEVEN OK", flush=True)


def behind() -> None:
    r, n = rc.rank(), rc.size()
    big = np.ones(16 << 20, np.float32)  # 64 MiB: through the engine, in flight for a while
    in_flight = 0
    for i in range(5):
        rc.barrier()
        hx = rc.allreduce_async(big, op=rc.Sum, name=f"x{i}")
        time.sleep(0.005)  # every rank posts x first
        in_flight += not rc.poll(hx)
        assert rc.allreduce(np.full(4, r + 1.0), op=rc.Sum, name=f"y{i}")[0] == n * (n + 1) / 2
        assert rc.synchronize(hx)[0] == n
    print(f"BEHIND in flight {in_flight}", flush=True)


def crossed() -> None:
    r, n = rc.rank(), rc.size()
    big = np.ones(1 << 16, np.float32)
    for i in range(20):
        if r == 0:
            hx = rc.allreduce_async(big, op=rc.Sum, name=f"x{i}")
            assert rc.allreduce(np.ones(4), op=rc.Sum, name=f"y{i}")[0] == n
            assert rc.synchronize(hx)[0] == n
        else:
            time.sleep(0.002)  # rank 0's large op is posted first
            assert rc.allreduce(np.ones(4), op=rc.Sum, name=f"y{i}")[0] == n
            assert rc.allreduce(big, op=rc.Sum, name=f"x{i}")[0] == n
    print("CROSSED OK", flush=True)


init()
start = time.monotonic()
{"digests": digests, "sweep": sweep, "reorder": reorder, "mismatch": mismatch, "join": join,
 "timeline": timeline, "threads": threads,
 "stalljoin": stalljoin, "uneven": uneven, "behind": behind, "crossed": crossed}[SCENARIO]()
rc.shutdown()
