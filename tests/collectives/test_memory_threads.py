"""Copies and sums split over threads (``ringcomm/collectives/memory_threads.py``): where to cut
and who takes which range (pure, hypothesis), and the runner itself."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.collectives.memory_threads import MemoryThreads, chunks, plan
from ringcomm.job.config import MAX_AUTO_MEMORY_THREADS, Settings
from ringcomm.job.cores import available_cores, cores_from

pytestmark = pytest.mark.pure


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1000), st.integers(0, 5000), st.integers(1, 9), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 10_000))
def test_chunks_cover_the_range_in_order_within_the_bounds(lo: int, n: int, threads: int, itemsize: int,
                                                           min_bytes: int) -> None:
    cs = chunks(lo, lo + n, threads, itemsize, min_bytes)
    if n == 0:
        assert cs == []
        return
    assert cs[0][0] == lo and cs[-1][1] == lo + n
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(cs))
    assert 1 <= len(cs) <= threads
    lengths = [b - a for a, b in cs]
    assert min(lengths) >= 1 and max(lengths) - min(lengths) <= 1  # balanced
    if len(cs) > 1:
        assert min(lengths) * itemsize >= min_bytes  # no range too small to be worth a thread
    if n >= threads * -(-min_bytes // itemsize):
        assert len(cs) == threads  # every thread gets work when there is enough of it


@pytest.mark.timeout(30)
def test_calls_run_at_once_on_distinct_threads() -> None:
    """Three calls that each wait for the other two: one after another they would never return."""
    work = MemoryThreads(3)
    meet = threading.Barrier(3, timeout=10)
    seen: list[str] = []
    try:
        work.run([lambda: (meet.wait(), seen.append(threading.current_thread().name))] * 3)
    finally:
        work.close()
    assert len(set(seen)) == 3 and threading.current_thread().name in seen


@pytest.mark.timeout(30)
def test_an_error_is_raised_once_every_call_has_finished() -> None:
    work = MemoryThreads(3)
    done = threading.Event()
    slow_finished: list[bool] = []

    def fails() -> None:
        raise ValueError("range 0 failed")

    def slow() -> None:
        done.wait(0.2)
        slow_finished.append(True)

    try:
        with pytest.raises(ValueError, match="range 0 failed"):
            work.run([fails, slow, slow])
        assert slow_finished == [True, True]
    finally:
        work.close()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=5), st.integers(1, 6), st.sampled_from([1, 4, 8]),
       st.integers(1, 4000))
def test_plan_deals_every_element_of_every_job_once(sizes: list[int], threads: int, itemsize: int,
                                                    min_bytes: int) -> None:
    dealt = plan(sizes, threads, itemsize, min_bytes)
    assert len(dealt) <= threads and all(dealt)
    covered: dict[int, list[tuple[int, int]]] = {}
    for work in dealt:
        for job, a, b in work:
            covered.setdefault(job, []).append((a, b))
    for job, n in enumerate(sizes):
        assert sorted(covered.get(job, [])) == chunks(0, n, threads, itemsize, min_bytes)
    ranges = sum(len(work) for work in dealt)
    assert max(map(len, dealt), default=0) - min(map(len, dealt), default=0) <= 1  # ranges dealt in turn
    assert ranges == sum(len(chunks(0, n, threads, itemsize, min_bytes)) for n in sizes)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_spread_applies_each_body_to_every_element_once(threads: int) -> None:
    src = np.arange(1000, dtype=np.float32)
    dst, other = np.zeros_like(src), np.zeros(300, np.float32)
    work = MemoryThreads(threads)
    try:
        work.spread([(src.size, lambda a, b: np.add(dst[a:b], src[a:b], out=dst[a:b])),
                     (other.size, lambda a, b: np.add(other[a:b], 1, out=other[a:b]))], 4, min_bytes=64)
    finally:
        work.close()
    np.testing.assert_array_equal(dst, src)
    np.testing.assert_array_equal(other, np.ones(300, np.float32))


@given(st.integers(1, 512), st.integers(1, 64))
def test_threads_by_cores_stay_within_one_and_the_cap_and_leave_each_rank_half_its_cores(cores: int, ranks: int
                                                                                           ) -> None:
    t = Settings().shm_allreduce_threads_for(ranks, cores)
    assert 1 <= t <= MAX_AUTO_MEMORY_THREADS
    assert t == 1 or t * ranks * 2 <= cores  # more than one only where the host has the cores
    assert Settings().shm_allreduce_threads_for(ranks, cores * 2) >= t  # more cores never fewer threads
    assert Settings(shm_allreduce_threads=7).shm_allreduce_threads_for(ranks, cores) == 7  # a setting wins


def test_threads_by_cores_on_the_measured_hosts() -> None:
    by_cores = Settings().shm_allreduce_threads_for
    assert (by_cores(2, 16), by_cores(4, 16), by_cores(2, 2), by_cores(2, 4), by_cores(8, 16)) == (4, 2, 1, 1, 1)


@given(st.integers(1, 256), st.integers(1, 10**7), st.integers(1, 10**6))
def test_cores_are_the_affinity_capped_by_the_cgroup_quota(affinity: int, quota: int, period: int) -> None:
    assert cores_from(affinity, None) == affinity
    assert cores_from(affinity, f"max {period}\n") == affinity
    assert cores_from(affinity, f"{quota} {period}\n") == max(1, min(affinity, quota // period))
    assert cores_from(affinity, "garbage") == affinity


def test_available_cores_reads_a_quota_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # cgroup v2
    assert available_cores(str(tmp_path)) == 1
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # no quota: the affinity
    assert available_cores(str(v1)) == available_cores(str(tmp_path / "absent")) >= 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert available_cores(str(v1)) == 1
