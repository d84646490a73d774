"""Host staging and results of the torch layer in one process: what is copied, what is shared,
how values convert, and the huge-page advice on new large tensors (ringcomm_torch/host_memory.py)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

torch = pytest.importorskip("torch")

from ringcomm_torch import host_memory  # noqa: E402
from ringcomm_torch.tensors import empty_result, stage  # noqa: E402

BIG = 8 << 20  # bytes: above host_memory.HUGE_PAGE_MIN_BYTES


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping that holds ``addr`` (Linux /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.fixture
def huge_pages_advisable() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("huge-page advice is Linux only")
    probe = torch.empty(BIG, dtype=torch.uint8)
    if not host_memory.advise_huge_pages(probe.data_ptr(), BIG):
        pytest.skip("this kernel refuses madvise(MADV_HUGEPAGE) (built without transparent huge pages)")


@given(st.integers(0, 1 << 40), st.integers(0, 1 << 24), st.sampled_from([4096, 16384, 65536]))
def test_page_range_is_the_whole_pages_inside_the_block(addr, nbytes, page):
    start, length = host_memory.page_range(addr, nbytes, page)
    assert start % page == 0 and length % page == 0 and length >= 0
    if length:
        assert addr <= start and start + length <= addr + nbytes
    assert length + 2 * page > nbytes  # no whole page of the block left out


def test_small_blocks_are_not_advised():
    t = torch.empty(1000)
    assert host_memory.advise_huge_pages(t.data_ptr(), t.numel() * 4) is False


def test_a_large_result_is_advised_for_huge_pages(huge_pages_advisable):
    like = torch.ones(BIG // 4)
    out = empty_result(like)
    assert out.shape == like.shape and out.dtype == like.dtype and out.is_contiguous()
    assert out.data_ptr() != like.data_ptr()
    assert "hg" in vm_flags(out.data_ptr() + BIG // 2)


def test_a_large_staging_copy_is_advised_and_a_contiguous_tensor_is_not_copied(huge_pages_advisable):
    t = torch.arange(BIG // 4, dtype=torch.float32)
    s = stage(t, reduce=True, what="test")
    assert s.direct and s.array.ctypes.data == t.data_ptr()  # the tensor's own memory
    nc = t.view(-1, 2).t()  # non-contiguous: one staging copy
    s = stage(nc, reduce=True, what="test")
    assert not s.direct and s.array.ctypes.data != t.data_ptr()
    assert np.array_equal(s.array, nc.contiguous().numpy())
    assert "hg" in vm_flags(s.array.ctypes.data + BIG // 2)


def test_bfloat16_stages_as_float32_for_reductions_and_as_its_bits_for_data_movement():
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0)).bfloat16()
    for t in (x, x.t()):
        s = stage(t, reduce=True, what="test")
        assert s.array.dtype == np.float32 and not s.direct
        assert np.array_equal(s.array, t.float().contiguous().numpy())
        s = stage(t, reduce=False, what="test")
        assert s.array.dtype == np.int16 and s.direct == t.is_contiguous()
        assert np.array_equal(s.array, t.contiguous().view(torch.int16).numpy())


def test_write_back_rounds_float32_to_bfloat16_as_a_cast_does():
    vals = torch.randn(50, 4, generator=torch.Generator().manual_seed(1)) * 1000
    for target in (torch.empty(50, 4, dtype=torch.bfloat16), torch.empty(4, 50, dtype=torch.bfloat16).t()):
        s = stage(torch.zeros(50, 4, dtype=torch.bfloat16), reduce=True, what="test")
        s.write_back(target, vals.numpy())
        assert torch.equal(target.view(torch.int16), vals.to(torch.bfloat16).view(torch.int16))
    bits = stage(torch.zeros(8, dtype=torch.bfloat16), reduce=False, what="test")
    src = torch.randn(8).bfloat16()
    out = torch.empty(8, dtype=torch.bfloat16)
    bits.write_back(out, src.view(torch.int16).numpy())
    assert torch.equal(out.view(torch.int16), src.view(torch.int16))


def test_out_of_place_results_of_the_collectives_are_new_advised_memory(huge_pages_advisable):
    import ringcomm_torch as hvd

    hvd.init()
    try:
        x = torch.arange(BIG // 4, dtype=torch.float32)
        results = {"allreduce": hvd.allreduce(x), "broadcast": hvd.broadcast(x, 0),
                   "grouped_allreduce": hvd.grouped_allreduce([x, x[:3]])[0]}
        for what, out in results.items():
            assert torch.equal(out, x), what
            assert out.data_ptr() != x.data_ptr(), what
            assert "hg" in vm_flags(out.data_ptr() + BIG // 2), what
        y = x.clone()
        assert hvd.allreduce_(y) is y and hvd.broadcast_(y, 0) is y and torch.equal(y, x)
    finally:
        hvd.shutdown()


# --------------------------------------------------------------------------- reused large blocks

MiB = 1 << 20


@pytest.mark.pure
@given(st.integers(0, 64), st.lists(st.tuples(st.booleans(), st.sampled_from([2, 4, 8, 16]), st.floats(0, 100)),
                                    max_size=60))
def test_the_plan_keeps_at_most_its_limit_and_hands_each_unused_block_out_once(limit_mib, steps):
    plan = host_memory.BlockPlan(limit_mib * MiB, idle=30.0)
    unused: dict[int, int] = {}  # key -> size, as the plan should see it
    in_use: dict[int, int] = {}
    keys = iter(range(10**6))
    now = 0.0
    for give, size_mib, dt in steps:
        now += dt
        size = size_mib * MiB
        if give and in_use:
            key = next(iter(in_use))
            unused[key] = in_use.pop(key)
            for gone in plan.give(key, unused[key], now):
                assert gone in unused
                del unused[gone]
        else:
            key = plan.take(size, now)
            if key is None:
                key = next(keys)
            else:
                assert unused.pop(key) == size  # only an unused block, of exactly that size
            in_use[key] = size
        assert plan.unused_bytes == sum(unused.values()) <= plan.limit
    assert plan.expire(now + 31.0) == list(unused)  # idle long enough: every one goes
    assert plan.unused_bytes == 0


@pytest.mark.pure
def test_the_plan_drops_the_oldest_first_and_what_idled_too_long():
    plan = host_memory.BlockPlan(8 * MiB, idle=60.0)
    assert plan.give(1, 4 * MiB, now=0) == [] and plan.give(2, 4 * MiB, now=1) == []
    assert plan.give(3, 4 * MiB, now=2) == [1]  # over 8 MiB: the oldest goes
    assert plan.give(4, 16 * MiB, now=3) == [2, 3, 4]  # larger than the limit by itself
    assert plan.give(5, 2 * MiB, now=10) == [] and plan.expire(69.9) == [] and plan.expire(70.0) == [5]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_gone_tensors_block_serves_the_next_request_and_a_live_ones_never_does():
    cache = host_memory.HostCache()
    a = cache.empty((BIG // 4,), torch.float32, 1 << 30)
    b = cache.empty((BIG // 4,), torch.float32, 1 << 30)
    a_ptr = a.data_ptr()
    a.fill_(1.0)
    b.fill_(2.0)
    view = a[10:20]  # shares a's memory: the block stays in use while it lives
    del a
    c = cache.empty((BIG // 4,), torch.float32, 1 << 30)
    assert c.data_ptr() not in (a_ptr, b.data_ptr()) and (cache.made, cache.reused) == (3, 0)
    assert torch.equal(view, torch.ones(10))
    del view
    d = cache.empty((2, BIG // 8), torch.int32, 1 << 30)  # the same bytes, another shape and dtype
    assert d.data_ptr() == a_ptr and d.shape == (2, BIG // 8) and d.dtype == torch.int32 and d.is_contiguous()
    assert cache.reused == 1 and torch.equal(b, torch.full((BIG // 4,), 2.0))
    e = cache.empty((BIG // 2,), torch.bfloat16, 1 << 30)  # bfloat16, which NumPy has no dtype for
    assert e.dtype == torch.bfloat16 and e.numel() == BIG // 2


def test_the_limit_and_the_idle_time_free_unused_blocks():
    clock = FakeClock()
    cache = host_memory.HostCache(clock)
    small = cache.empty((1000,), torch.float32, 1 << 30)  # below the size worth keeping: torch's own
    assert cache.made == 0 and small.numel() == 1000
    t = cache.empty((BIG,), torch.uint8, 1 << 30)
    del t
    cache.trim(1 << 30)
    assert cache.unused_bytes == BIG
    clock.now = host_memory.IDLE_SECONDS + 1
    cache.trim(1 << 30)
    assert cache.unused_bytes == 0  # idle for a minute: freed
    t = cache.empty((BIG,), torch.uint8, 1 << 30)
    del t
    cache.trim(0)  # RINGCOMM_HOST_CACHE_BYTES=0: nothing kept
    assert cache.unused_bytes == 0
    made = cache.made
    over = cache.empty((BIG,), torch.uint8, BIG // 2)  # larger than the limit: not from the cache
    assert cache.made == made and over.numel() == BIG


def test_a_block_given_back_in_another_thread_is_reused():
    import threading

    cache = host_memory.HostCache()
    t = cache.empty((BIG,), torch.uint8, 1 << 30)
    ptr = t.data_ptr()
    box = [t]
    del t
    worker = threading.Thread(target=box.clear)  # the last reference dies in another thread
    worker.start()
    worker.join()
    assert cache.empty((BIG,), torch.uint8, 1 << 30).data_ptr() == ptr


def test_repeated_out_of_place_results_reuse_one_block_and_the_setting_turns_it_off(monkeypatch):
    import ringcomm_torch as hvd

    hvd.init()
    try:
        x = torch.arange(BIG // 4, dtype=torch.float32)
        ptrs = []
        for _ in range(3):
            out = hvd.allreduce(x, op=hvd.Sum)
            assert torch.equal(out, x)
            ptrs.append(out.data_ptr())
            del out
        assert len(set(ptrs)) == 1  # each step's result in the block the last one left
        b = hvd.broadcast(x, 0)
        assert torch.equal(b, x) and b.data_ptr() == ptrs[0]
        del b
        g = hvd.allgather(x)  # the gathered rows are written straight into the block too
        assert torch.equal(g, x) and g.data_ptr() == ptrs[0]
    finally:
        hvd.shutdown()
    monkeypatch.setenv("RINGCOMM_HOST_CACHE_BYTES", "0")
    host_memory.CACHE.trim(0)
    hvd.init()
    try:
        made = host_memory.CACHE.made
        for _ in range(2):
            assert torch.equal(hvd.allreduce(x, op=hvd.Sum), x)
        assert host_memory.CACHE.made == made
    finally:
        hvd.shutdown()
