"""The futex barrier of the shared-memory allreduce: pure arithmetic, then ranks as threads.

Every test here uses an anonymous shared mapping (threads of one process stand in
for ranks); the multi-process jobs of ``test_shm_allreduce.py`` use the real
region through the engine.
"""

from __future__ import annotations

import mmap
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.shm import barrier as shm_barrier
from ringcomm.errors import PeerLostError
from ringcomm.shm.barrier import ShmBarrier, reached

needs_futex = pytest.mark.skipif(not shm_barrier.available(), reason="futex barrier: Linux on x86-64 only")


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**31 - 1))
def test_reached_is_modular_comparison(number: int, ahead: int) -> None:
    value = (number + ahead) % 2**32
    assert reached(value, number)  # at or up to 2**31 - 1 past it
    if ahead:
        assert not reached(number, value)  # behind it


def test_header_is_page_rounded_and_holds_every_counter() -> None:
    for size in (1, 2, 64, 65, 200):
        head = shm_barrier.header_bytes(size)
        assert head % 4096 == 0 and head >= size * shm_barrier.STRIDE


def mapping(size: int) -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(-1, shm_barrier.header_bytes(size))
    return m, np.frombuffer(m, np.uint8)


def run(size: int, fn) -> list:
    results: list = [None] * size
    errors: list[BaseException] = []

    def target(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank is stuck at a barrier"
    if errors:
        raise errors[0]
    return results


@needs_futex
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3, 5])
def test_no_rank_passes_a_barrier_before_every_rank_reached_it(size: int) -> None:
    """Each rank records the phase of every rank right after each barrier: nobody may be behind."""
    _m, header = mapping(size)
    bars = [ShmBarrier(header, r, size, peer_timeout=10) for r in range(size)]
    phase = [0] * size
    rounds = 300

    def fn(r: int) -> list[int]:
        behind = []
        for k in range(1, rounds + 1):
            phase[r] = k
            if r == k % size:
                time.sleep(0.0005)  # a late rank, a different one each round
            bars[r].wait(k)
            behind.append(min(phase))
        return behind

    for behind in run(size, fn):
        assert behind == list(range(1, rounds + 1))


@needs_futex
@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_is_reported_by_watch_then_timeout() -> None:
    _m, header = mapping(2)
    waiter = ShmBarrier(header, 0, 2, peer_timeout=0.5)
    polled: list[int] = []
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="rank 1 did not reach shared-memory barrier 1"):
        waiter.wait(1, polled.append)
    assert 0.5 <= time.monotonic() - start < 5
    assert polled and set(polled) == {1}  # asked about the awaited rank while it slept

    class Gone(Exception):
        pass

    def watch(j: int) -> None:
        raise Gone(f"rank {j} is gone")

    late = ShmBarrier(header, 0, 2, peer_timeout=30)
    start = time.monotonic()
    with pytest.raises(Gone, match="rank 1 is gone"):
        late.wait(2, watch)  # the data plane knows the peer died: no need to wait for the timeout
    assert time.monotonic() - start < 2


def test_rejects_a_header_too_small_or_misaligned() -> None:
    _m, header = mapping(4)
    with pytest.raises(ValueError):
        ShmBarrier(header[: 3 * shm_barrier.STRIDE], 0, 4, 1.0)
    with pytest.raises(ValueError):
        ShmBarrier(header[8:], 0, 2, 1.0)
