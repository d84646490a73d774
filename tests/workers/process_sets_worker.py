"""Process sets in a real job (np 3 or 4): every check runs in this one job, each rank checks its own results.

Phase 1: static sets (init(process_sets=[even, odd])) — every collective on a
subset against NumPy, non-member errors, mismatch in a set, overlapping sets
with async ops in different orders, concurrent disjoint sets where one set
stalls (rank 0 logs a per-set stall warning) while the other keeps running.
Phase 2: after shutdown, init(process_sets="dynamic") — sets added and removed
repeatedly.  Prints "PHASE <name> OK" after each part.
"""

from __future__ import annotations

import os
import time

import numpy as np

import ringcomm as rc


def data(seed: int, rank: int, shape, dtype: str = "float64") -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    if dtype.startswith("float"):
        return rng.uniform(-2, 2, shape).astype(dtype)
    return rng.integers(-5, 5, shape).astype(dtype)


def eq(got: np.ndarray, exp: np.ndarray, what: str) -> None:
    assert got.shape == exp.shape and got.dtype == exp.dtype, f"{what}: {got.shape} {got.dtype} vs {exp.shape} {exp.dtype}"
    np.testing.assert_allclose(got, exp, rtol=1e-6, atol=1e-6, err_msg=what)


def raises(exc_type: type, fn, *needles: str) -> str:
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        for needle in needles:
            assert needle in text, f"{needle!r} not in {text!r}"
        return text
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def every_collective(ps: rc.ProcessSet, seed: int) -> None:
    """Every collective on ``ps`` (this rank is a member) against the NumPy reference over its ranks."""
    r = rc.rank()
    ranks = ps.ranks
    me = ps.rank()
    k = ps.size()
    assert k == len(ranks) and me == ranks.index(r) and ps.included()
    # allreduce: small (reduced at rank 0) and large (the set's ring), several ops and dtypes
    for i, (shape, op, dtype) in enumerate([((5,), rc.Sum, "float64"), ((3, 2), rc.Average, "float32"),
                                           ((70_000,), rc.Max, "float64"), ((40_000,), rc.Sum, "int32"),
                                           ((50_000,), rc.Average, "float64"),
                                           ((), rc.Min, "int64")]):
        ins = {q: data(seed + i, q, shape, dtype) for q in ranks}
        ref = {rc.Sum: np.sum, rc.Max: np.max, rc.Min: np.min}.get(op)
        stacked = np.stack([ins[q] for q in ranks])
        exp = (stacked.sum(0) / k).astype(dtype) if op == rc.Average else ref(stacked, axis=0).astype(dtype)
        eq(rc.allreduce(ins[r], op=op, process_set=ps), exp, f"allreduce {i} on {ps}")
    # async + grouped allreduce, with out=
    a, b = data(seed, r, (4,)), data(seed + 1, r, (2, 3))
    out = np.empty(4)
    h = rc.allreduce_async(a, op=rc.Sum, process_set=ps, out=out)
    g = rc.grouped_allreduce_async([a, b], op=rc.Sum, process_set=ps)
    assert rc.synchronize(h) is out
    eq(out, sum(data(seed, q, (4,)) for q in ranks), "allreduce_async")
    ga, gb = rc.synchronize(g)
    eq(gb, sum(data(seed + 1, q, (2, 3)) for q in ranks), "grouped_allreduce")
    assert rc.poll(g)
    # allgather: dim 0 differs per member; in the set's rank order
    mine = np.full((me + 1, 2), r, dtype=np.int16)
    exp = np.concatenate([np.full((j + 1, 2), q, dtype=np.int16) for j, q in enumerate(ranks)])
    eq(rc.allgather(mine, process_set=ps), exp, "allgather")
    g1, g2 = rc.grouped_allgather([mine, mine[:1] * 2], process_set=ps)
    eq(g1, exp, "grouped_allgather")
    eq(g2, np.array([[2 * q] * 2 for q in ranks], dtype=np.int16), "grouped_allgather 2")
    big = data(seed, r, (30_000,))
    eq(rc.allgather(big, process_set=ps), np.concatenate([data(seed, q, (30_000,)) for q in ranks]), "big allgather")
    # broadcast: every member as root, by its global rank
    for root in ranks:
        x = data(seed + root, r, (50_000,)) if root == ranks[0] else data(seed + root, r, (3,))
        eq(rc.broadcast(x, root_rank=root, process_set=ps), data(seed + root, root, x.shape), f"broadcast root {root}")
    # alltoall: splits indexed by rank within the set
    rng = np.random.default_rng(seed)
    splits = rng.integers(0, 3, (k, k))
    ins = {q: np.arange(int(splits[j].sum()), dtype=np.float32) + 100 * q for j, q in enumerate(ranks)}
    # (each member says what it expects from each member: checked against the others' splits)
    got, recv = rc.alltoall(ins[r], splits=splits[me], process_set=ps, received_splits=splits[:, me])
    offs = {q: np.concatenate([[0], np.cumsum(splits[j])]) for j, q in enumerate(ranks)}
    exp = np.concatenate([ins[q][offs[q][me]:offs[q][me + 1]] for q in ranks])
    eq(got, exp, "alltoall")
    np.testing.assert_array_equal(recv, splits[:, me])
    even_rows = np.arange(2 * k, dtype=np.float64).reshape(k, 2) * (r + 1)
    got, _ = rc.alltoall(even_rows, process_set=ps)
    eq(got, np.stack([even_rows[me] / (r + 1) * (q + 1) for q in ranks]), "alltoall default splits")
    # reducescatter: rows split over the set's members, lower set ranks get the extra rows
    rows = 2 * k + 1
    ins = {q: data(seed + 7, q, (rows, 3)) for q in ranks}
    full = sum(ins[q] for q in ranks)
    counts = [rows // k + (1 if j < rows % k else 0) for j in range(k)]
    start = sum(counts[:me])
    eq(rc.reducescatter(ins[r], op=rc.Sum, process_set=ps), full[start:start + counts[me]], "reducescatter")
    avg = rc.grouped_reducescatter([ins[r], ins[r]], process_set=ps)
    eq(avg[1], full[start:start + counts[me]] / k, "grouped_reducescatter average")
    # barrier, objects
    rc.barrier(process_set=ps)
    assert rc.allgather_object({"r": r}, process_set=ps) == [{"r": q} for q in ranks]
    assert rc.broadcast_object(("from", r), root_rank=ranks[-1], process_set=ps) == ("from", ranks[-1])
    raises(ValueError, lambda: rc.broadcast(np.zeros(1), root_rank=next(q for q in range(rc.size()) if q not in ranks),
                                            process_set=ps), "is not in process set")


def phase_static() -> None:
    n = int(os.environ["RINGCOMM_SIZE"])  # the sets are made before init(), as in Horovod
    even = rc.ProcessSet(range(0, n, 2))
    odd = rc.ProcessSet(range(1, n, 2))
    rc.init(process_sets=[even, odd])
    r = rc.rank()
    assert (even.process_set_id, odd.process_set_id) == (1, 2), (even, odd)
    assert rc.global_process_set.ranks == list(range(n)) and rc.process_set_ids() == [0, 1, 2]
    mine, other = (even, odd) if r % 2 == 0 else (odd, even)
    assert other.rank() == -1 and not other.included()
    every_collective(mine, seed=10 + mine.process_set_id)
    print("PHASE subset OK", flush=True)

    # a collective on a set this rank is not in: a clear error at the call, naming the set and its ranks
    raises(ValueError, lambda: rc.allreduce(np.ones(2), process_set=other),
           f"rank {r} is not in process set {other.process_set_id} (ranks {other.ranks})")
    raises(ValueError, lambda: rc.barrier(process_set=rc.ProcessSet([0])), "not a registered process set")
    raises(ValueError, lambda: rc.add_process_set([0]), "process_sets='dynamic'")

    # a mismatch inside a set: every member gets the error naming the set; the next op works
    if mine.size() > 1:
        raises(rc.MismatchError, lambda: rc.allreduce(np.ones(2 + r), name="bad", process_set=mine),
               f"in process set {mine.process_set_id} (ranks {mine.ranks})", "disagree on shape")
    eq(rc.allreduce(np.ones(2), op=rc.Sum, name="bad", process_set=mine), np.full(2, float(mine.size())), "after")
    print("PHASE errors OK", flush=True)

    # a name used on the global set and on a subset at once: two different ops
    h1 = rc.allreduce_async(np.ones(3), op=rc.Sum, name="same")
    h2 = rc.allreduce_async(np.ones(3) * 2, op=rc.Sum, name="same", process_set=mine)
    eq(rc.synchronize(h2), np.full(3, 2.0 * mine.size()), "same name, set")
    eq(rc.synchronize(h1), np.full(3, float(n)), "same name, global")
    rc.shutdown()
    print("PHASE static OK", flush=True)


def phase_overlap_and_concurrency() -> None:
    rc.init(process_sets="dynamic")
    n, r = rc.size(), rc.rank()
    # overlapping sets that share ranks 1 and 2: async ops submitted in different orders per rank
    left = rc.add_process_set(list(range(n - 1)))
    right = rc.add_process_set(list(range(1, n)))
    for rep in range(3):
        handles = []
        order = [left, right, rc.global_process_set] if r % 2 else [rc.global_process_set, right, left]
        for ps in order:
            if ps.included():
                for j in range(4):
                    x = np.full(20_000 if j == 0 else 7, float(r + j))
                    handles.append((ps, j, x.size, rc.allreduce_async(x, op=rc.Sum, name=f"o{rep}.{j}", process_set=ps)))
        for ps, j, size, h in handles:
            eq(rc.synchronize(h), np.full(size, float(sum(q + j for q in ps.ranks))), f"overlap {ps} {j}")
    print("PHASE overlap OK", flush=True)
    assert rc.remove_process_set(left) and rc.remove_process_set(right)

    # disjoint sets A = {0, 1} and B = {2, .., n-1}: a slow member holds up its own set only.
    # Round 1: rank 1 (in A) is late, B's loop must finish before A's first op; round 2 the reverse.
    a = rc.add_process_set([0, 1])
    b = rc.add_process_set(list(range(2, n)))
    slow = 2.5
    for late_rank, late_set, other in ((1, a, b), (n - 1, b, a)):
        t0 = time.monotonic()
        mine = a if a.included() else b
        if mine is late_set:
            if r == late_rank:
                time.sleep(slow)
            name = "lonely" if late_set is a else "lonely2"
            got = rc.allreduce(np.ones(4), op=rc.Sum, name=name, process_set=mine)
            eq(got, np.full(4, float(mine.size())), "after the slow rank")
            for i in range(10):
                eq(rc.allreduce(np.full(3, float(i)), op=rc.Sum, process_set=mine), np.full(3, float(i * mine.size())), "loop")
        else:
            for i in range(30):
                eq(rc.allreduce(np.full(1000, float(i + r)), op=rc.Sum, process_set=mine),
                   np.full(1000, float(sum(i + q for q in mine.ranks))), "loop")
        # one clock for every rank of this host (CLOCK_MONOTONIC): when the slow rank woke, when each finished
        times = rc.allgather_object((r, t0, time.monotonic()))
        woke = next(t for q, t, _ in times if q == late_rank) + slow
        late_time = min(end for q, _, end in times if q in late_set.ranks) - woke
        other_time = max(end for q, _, end in times if q in other.ranks) - woke
        assert late_time >= 0, times  # every rank of the late set waited for the slow one
        assert other_time < 0, f"set {other.ranks} waited for set {late_set.ranks}: {times}"
        print(f"PHASE concurrent OK ({other.ranks} done {-other_time:.2f} s before rank {late_rank} woke, "
              f"{late_set.ranks} {late_time:.2f} s after)", flush=True)
    for ps in (a, b):
        assert rc.remove_process_set(ps)
    rc.shutdown()


def phase_dynamic() -> None:
    rc.init(process_sets="dynamic")
    n, r = rc.size(), rc.rank()
    seen_ids = []
    for rep in range(4):
        ranks = [q for q in range(n) if (q + rep) % 2 == 0] if rep % 2 else [0, n - 1]
        ps = rc.add_process_set(rc.ProcessSet(ranks) if rep % 2 else ranks)
        seen_ids.append(ps.process_set_id)
        assert ps.ranks == ranks and rc.process_set_ids() == [0, ps.process_set_id]
        raises(ValueError, lambda ranks=ranks: rc.add_process_set(list(ranks)), "already exists")
        if ps.included():
            eq(rc.allreduce(np.full(2, float(r)), op=rc.Sum, process_set=ps), np.full(2, float(sum(ranks))), "dyn")
            assert rc.allgather_object(r, process_set=ps) == ranks
        else:
            raises(ValueError, lambda ps=ps: rc.allreduce(np.ones(1), process_set=ps), "is not in process set")
        rc.barrier()
        stale = rc.ProcessSet(ranks)
        stale.process_set_id = ps.process_set_id
        assert rc.remove_process_set(ps) is True
        assert ps.process_set_id is None and ps.ranks is None and ps.size() is None
        raises(ValueError, lambda stale=stale: rc.allreduce(np.ones(1), process_set=stale), "not a registered process set")
        raises(ValueError, lambda ps=ps: rc.remove_process_set(ps), "not a registered process set")
    assert seen_ids == sorted(set(seen_ids)), seen_ids  # ids are never reused
    assert rc.remove_process_set(rc.global_process_set) is False
    # the global set still works after all that
    eq(rc.allreduce(np.ones(2), op=rc.Sum), np.full(2, float(n)), "global after")
    rc.shutdown()
    print("PHASE dynamic OK", flush=True)


if __name__ == "__main__":
    phase_static()
    phase_overlap_and_concurrency()
    phase_dynamic()
    print("ALL OK", flush=True)
