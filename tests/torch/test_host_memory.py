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
