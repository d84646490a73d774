"""The shared-memory allreduce (``ringcomm/collectives/shm_allreduce.py``).

Tier 1: the piece / range / slab arithmetic (pure, hypothesis).
Tier 2: the algorithm, one thread per rank, barriers over in-process queue links,
        the region in /dev/shm; results compared bitwise with a rank-order reference.
Tier 3: real jobs (np 3 and 4) through ringcomm-run with the shared-memory path forced on.
"""

from __future__ import annotations

import fcntl
import glob
import itertools
import os
import secrets

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import WORKERS, launch
from ringcomm.job import names
from ringcomm.shm import slots as shm, barrier as shm_barrier
from ringcomm.collectives import shm_allreduce
from ringcomm.job.config import Settings
from ringcomm.errors import InvalidInputError
from ringcomm.core.ops import ReduceOp, reduce_into, scale_inplace
from ringcomm.collectives.shm_allreduce import ShmAllreduce
from test_algorithms_inprocess import queue_links, run_ranks

needs_shm = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")

# -- tier 1: arithmetic ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 700))
def test_pieces_cover_the_buffer_in_order(n: int, piece: int) -> None:
    ps = shm_allreduce.pieces(n, piece)
    assert [a for a, _ in ps] == list(range(0, n, piece))
    assert all(0 < b - a <= piece for a, b in ps)
    assert (ps[-1][1] if ps else 0) == n
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(ps))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(2, 9))
def test_owner_ranges_partition_a_piece(m: int, size: int) -> None:
    rs = shm_allreduce.owner_ranges(m, size)
    assert len(rs) == size
    assert rs[0][0] == 0 and rs[-1][1] == m
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(rs))
    lengths = [b - a for a, b in rs]
    assert max(lengths) - min(lengths) <= 1  # balanced: no rank reduces more than one extra element


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 24), st.integers(2, 9), st.sampled_from([1, 2, 4, 8]))
def test_slabs_are_aligned_disjoint_and_inside_the_region(piece_bytes: int, size: int, itemsize: int) -> None:
    slab = shm_allreduce.slab_bytes_for(piece_bytes)
    assert slab >= piece_bytes and slab % shm_allreduce.ALIGN == 0 and slab - piece_bytes < shm_allreduce.ALIGN
    offs = sorted(shm_allreduce.slab_offset(s, j, size, slab) for s in (0, 1) for j in range(size + 1))
    head = shm_barrier.header_bytes(size)  # the barrier counters come first
    assert head >= size * shm_barrier.STRIDE and head % 4096 == 0
    assert offs == [head + k * slab for k in range(2 * (size + 1))]
    assert offs[-1] + slab == shm_allreduce.region_bytes(size, slab)
    assert all(o % itemsize == 0 for o in offs)
    assert (slab // itemsize) * itemsize <= slab  # a piece of slab // itemsize elements fits a slab


def test_usable_only_on_one_host_with_enough_ranks_and_a_threshold() -> None:
    ok = shm.available()
    assert shm_allreduce.usable(3, ["a"] * 3, 1, 3) is ok
    assert not shm_allreduce.usable(3, ["a", "a", "b"], 1, 3)
    assert not shm_allreduce.usable(3, ["a"] * 3, 0, 3)  # threshold 0: off
    assert not shm_allreduce.usable(2, ["a"] * 2, 1, 3)
    assert shm_allreduce.usable(2, ["a"] * 2, 1, 2) is ok


def test_settings_validate_the_knobs() -> None:
    s = Settings.from_env({"RINGCOMM_SHM_ALLREDUCE_MIN_BYTES": "0", "RINGCOMM_SHM_ALLREDUCE_PIECE_BYTES": "8192",
                           "RINGCOMM_SHM_ALLREDUCE_MIN_RANKS": "2"})
    assert (s.shm_allreduce_min_bytes, s.shm_allreduce_piece_bytes, s.shm_allreduce_min_ranks) == (0, 8192, 2)
    assert Settings().shm_allreduce_threads == 0  # by cores
    assert Settings.from_env({"RINGCOMM_SHM_ALLREDUCE_THREADS": "3"}).shm_allreduce_threads == 3
    for bad in ({"RINGCOMM_SHM_ALLREDUCE_PIECE_BYTES": "100"}, {"RINGCOMM_SHM_ALLREDUCE_MIN_BYTES": "-1"},
                {"RINGCOMM_SHM_ALLREDUCE_MIN_RANKS": "1"},
                {"RINGCOMM_SHM_ALLREDUCE_THREADS": "-1"}, {"RINGCOMM_SHM_ALLREDUCE_THREADS": "65"}):
        with pytest.raises(InvalidInputError):
            Settings.from_env(bad)


# -- tier 2: the algorithm over in-process links ---------------------------------------------

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]
OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]


def inputs_for(size: int, n: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return [rng.integers(0, 2, n).astype(bool) for _ in range(size)]
    if dtype.startswith("float"):
        return [rng.uniform(-2, 2, n).astype(dtype) for _ in range(size)]
    return [rng.integers(-3 if dtype != "uint8" else 0, 4, n).astype(dtype) for _ in range(size)]


def reference(inputs: list[np.ndarray], op: ReduceOp, post: float) -> np.ndarray:
    """What every rank must hold, bit for bit: the inputs folded in rank order, then scaled."""
    acc = inputs[0].copy()
    for x in inputs[1:]:
        reduce_into(op, acc, x)
    scale_inplace(acc, post)
    return acc


def new_job() -> str:
    return "t" + secrets.token_hex(4)


def leftovers(job: str) -> list[str]:
    return glob.glob(names.job_globs(job)[0])


@needs_shm
@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None)
@given(size=st.integers(2, 5), n=st.integers(0, 300), dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS),
       piece=st.sampled_from([1, 64, 100, 256, 4096]), separate=st.booleans(), ops_count=st.integers(1, 3),
       seed=st.integers(0, 2**16), futex=st.booleans(), threads=st.sampled_from([1, 3]))
def test_matches_rank_order_reference_bitwise(size, n, dtype, op, piece, separate, ops_count, seed, futex,
                                              threads) -> None:
    """Both barriers: the futex one (x86-64 Linux) and messages over the links (everywhere else);
    one thread per rank, or three, each copying and reducing its own range of every piece."""
    futex = futex and shm_barrier.available()
    if dtype == "bool" and op is ReduceOp.AVERAGE:
        op = ReduceOp.SUM
    post = 1.0 / size if op is ReduceOp.AVERAGE else (0.5 if seed % 3 == 0 else 1.0)
    job = new_job()
    links = queue_links(size)
    algs = [ShmAllreduce(job, 0, piece, futex=futex, threads=threads, thread_min_bytes=1) for _ in links]
    cases = [inputs_for(size, n + k, dtype, seed + k) for k in range(ops_count)]  # several ops: sets alternate

    def fn(link, r):
        outs = []
        for seq, ins in enumerate(cases):
            if separate:
                out = np.full(ins[r].size, 7, dtype)
                assert algs[r].allreduce(link, out, op, seq, post, src_buf=ins[r])
            else:
                out = ins[r].copy()
                assert algs[r].allreduce(link, out, op, seq, post)
            outs.append(out)
        return outs

    try:
        results = run_ranks(links, fn)
        assert not leftovers(job)  # unlinked as soon as every rank mapped it
    finally:
        for a in algs:
            a.close()
    for k, ins in enumerate(cases):
        expected = reference(ins, op, post)
        for r in range(size):
            assert results[r][k].dtype == np.dtype(dtype)
            assert results[r][k].tobytes() == expected.tobytes(), f"rank {r}, op {k}"
    if separate:  # the inputs are never written
        assert all(np.array_equal(a, b) for k, ins in enumerate(cases) for a, b in
                   zip(ins, inputs_for(size, n + k, dtype, seed + k)))
    assert not leftovers(job)


@needs_shm
@pytest.mark.timeout(60)
def test_many_rounds_alternate_sets_without_races() -> None:
    """100 pieces of 3 ranks with values that differ per piece: a rank copying out or reducing a
    set that a rank ahead of it had already overwritten with the piece after next would show up
    as a wrong sum."""
    size, piece, rounds = 3, 64, 100
    job = new_job()
    links = queue_links(size)
    algs = [ShmAllreduce(job, 0, piece) for _ in links]
    n = rounds * (piece // 8)
    ins = [np.arange(n, dtype=np.float64) * (r + 1) for r in range(size)]

    def fn(link, r):
        out = np.empty(n, np.float64)
        assert algs[r].allreduce(link, out, ReduceOp.SUM, 0, src_buf=ins[r])
        return out

    try:
        for out in run_ranks(links, fn):
            np.testing.assert_array_equal(out, np.arange(n, dtype=np.float64) * 6)
    finally:
        for a in algs:
            a.close()


@needs_shm
@pytest.mark.timeout(60)
def test_setup_failure_is_agreed_and_falls_back() -> None:
    """If rank 0 cannot create the region, every rank returns False, leaves its buffer alone and
    keeps returning False (the engine then runs the ring)."""
    job = new_job()
    squatter = shm_allreduce.region_path(job, 0)
    held = open(squatter, "wb")  # a live process's file under that name: held as its creator holds it
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        links = queue_links(3)
        algs = [ShmAllreduce(job, 0, 1024) for _ in links]

        def fn(link, r):
            buf = np.full(10, r, np.int32)
            first = algs[r].allreduce(link, buf, ReduceOp.SUM, 0)
            second = algs[r].allreduce(link, buf, ReduceOp.SUM, 1)
            return first, second, buf

        for r, (first, second, buf) in enumerate(run_ranks(links, fn)):
            assert (first, second) == (False, False)
            assert (buf == r).all()
            assert algs[r].broken and algs[r].region is None
    finally:
        held.close()
        os.unlink(squatter)


# -- tier 3: real jobs -----------------------------------------------------------------------


def shm_cases() -> list[dict]:
    cases: list[dict] = []
    seed = itertools.count(1)
    for dtype, op, n in [("float32", "sum", 0), ("float32", "sum", 1), ("float64", "average", 1237),
                         ("float16", "sum", 999), ("int64", "product", 777), ("int32", "min", 4099),
                         ("int8", "max", 513), ("uint8", "sum", 2051), ("int16", "average", 1001),
                         ("bool", "sum", 333), ("bool", "min", 1025), ("float32", "max", 70_001),
                         ("float32", "average", 300_000)]:
        cases.append({"dtype": dtype, "op": op, "n": n, "seed": next(seed)})
    cases.append({"dtype": "float32", "op": "sum", "n": 5000, "seed": next(seed), "prescale": 0.5, "postscale": 3.0})
    cases.append({"dtype": "int32", "op": "sum", "n": 3001, "seed": next(seed), "prescale": 2.0, "postscale": 0.5})
    cases.append({"dtype": "float64", "op": "sum", "n": 2500, "seed": next(seed), "fused": 3})
    return cases


@needs_shm
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, threads", [(3, 1), (4, 1), (3, 3)])
def test_jobs_reduce_through_shared_memory_bitwise_identically(tmp_path, world: int, threads: int) -> None:
    """With 3 threads per rank, pieces of 4 MiB and a 12 MB case, so that copies and sums are split."""
    import json

    path = tmp_path / "cases.json"
    cases = shm_cases()
    if threads > 1:
        cases.append({"dtype": "float32", "op": "average", "n": 3_000_000, "seed": 99})
    path.write_text(json.dumps(cases))
    proc = launch(world, [str(WORKERS / "shm_allreduce_worker.py"), str(path)], timeout=110,
                  RINGCOMM_SHM_ALLREDUCE_THREADS=str(threads),
                  RINGCOMM_SHM_ALLREDUCE_MIN_BYTES="1",
                  RINGCOMM_SHM_ALLREDUCE_PIECE_BYTES="1024" if threads == 1 else str(4 << 20),
                  RINGCOMM_SMALL_ALLREDUCE_BYTES="0",  # not reduced at rank 0: every case takes the shm path
                  RINGCOMM_SHM_LANE_BYTES="0")  # nor the small-op lane
    assert proc.returncode == 0, f"job failed (np={world}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for r in range(world):
        assert f"[{r}]<stdout>:SHM ALL OK" in proc.stdout


@needs_shm
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_threshold_zero_keeps_the_ring(tmp_path) -> None:
    import json

    path = tmp_path / "cases.json"
    path.write_text(json.dumps([{"dtype": "float32", "op": "sum", "n": 300_000, "seed": 1}]))
    proc = launch(3, [str(WORKERS / "shm_allreduce_worker.py"), str(path), "--expect-ring"], timeout=50,
                  RINGCOMM_SHM_ALLREDUCE_MIN_BYTES="0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(3):
        assert f"[{r}]<stdout>:SHM ALL OK" in proc.stdout



@needs_shm
def test_remote_cleanup_removes_the_region_with_rank_0() -> None:
    """On a remote host, rank 0's wrapper (``ringcomm.launch.rexec``) removes a region its rank left behind."""
    from ringcomm.launch import rexec

    job = new_job()
    path = shm_allreduce.region_path(job, 0)
    with open(path, "wb"):
        pass
    try:
        assert path not in rexec.remove_job_files(job, rank=1)
        assert os.path.exists(path)
        assert path in rexec.remove_job_files(job, rank=0)
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
