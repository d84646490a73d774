"""Worker for tests/torch/test_torch_jobs.py: large single tensors through the torch layer.

Values, at sizes that take the engine's large-message paths: Horovod's arithmetic (Average
multiplies by the float32 reciprocal of the size; prescale and postscale; half scaled in float32
and rounded once; integer averages truncated), out of place and in place, non-contiguous and
bfloat16 tensors, broadcast from the last rank, allgather, a mixed-dtype grouped allreduce and a
gradient.  Memory, without timing: an in-place op hands back the tensor's own storage, an
out-of-place result shares none with its input, and (argument ``rss``, which needs a writable
/proc/self/clear_refs) the peak resident memory of an op grows by at most one result: a second
full-size copy or a float64 temporary would break the bound.  Prints ``WORKER OK rank=R``.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any

import torch

import ringcomm_torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
ROOT = N - 1  # broadcasts come from the last rank, never rank 0 alone
ELEMS = 1 << 20  # 4 MiB of float32: the shared-memory allreduce and the pipelined broadcast
RSS_ELEMS = 10 << 20  # 40 MiB: above glibc's largest mmap threshold, so every result is new memory


def ints(rank: int, dtype: torch.dtype, high: int, n: int = ELEMS) -> torch.Tensor:
    """Rank ``rank``'s input: integers in [0, high) (sums exact in any order), as ``dtype``."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, high, (n,), generator=g).to(dtype)


def inputs(dtype: torch.dtype, high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input and the exact sum over the ranks, in float64."""
    xs = [ints(r, dtype, high) for r in range(N)]
    return xs[R], torch.stack([x.double() for x in xs]).sum(0)


def bits_eq(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    ok = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    assert ok, f"rank {R}: {what}: got {a!r} ({a.dtype}), expected {b!r} ({b.dtype})"


def inv(n: float) -> torch.Tensor:
    """``(float)(x)``: a factor as Horovod hands it to its float32 and half scaling."""
    return torch.tensor(n, dtype=torch.float32)


def check_allreduce_arithmetic() -> None:
    x, total = inputs(torch.float32, 1000)
    before = x.clone()
    y = hvd.allreduce(x)  # Average
    bits_eq(y, total.float() * inv(1.0 / N), "Average float32")
    bits_eq(x, before, "allreduce left its input alone")
    assert y.data_ptr() != x.data_ptr() and y.is_contiguous()
    bits_eq(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
            (total * 0.5).float() * inv(3.0), "Sum with prescale and postscale")
    bits_eq(hvd.allreduce(x, prescale_factor=2.0, postscale_factor=0.5),
            (total * 2).float() * inv(0.5 / N), "Average with prescale and postscale")
    y = x.clone()
    ptr = y.data_ptr()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and y.data_ptr() == ptr
    bits_eq(y, total.float(), "allreduce_ Sum")
    y = x.clone()
    ptr = y.data_ptr()
    assert hvd.synchronize(hvd.allreduce_async_(y)) is y and y.data_ptr() == ptr
    bits_eq(y, total.float() * inv(1.0 / N), "allreduce_async_ Average")
    nc = x.view(-1, 4).t()  # non-contiguous: staged once, reduced there, copied into the result
    out = hvd.allreduce(nc, op=hvd.Sum)
    bits_eq(out, total.float().view(-1, 4).t().contiguous(), "non-contiguous allreduce")
    assert out.is_contiguous()
    bits_eq(x, before, "non-contiguous allreduce left its input alone")

    h, total_h = inputs(torch.float16, 20)
    bits_eq(hvd.allreduce(h), (total_h.float() * inv(1.0 / N)).half(), "Average float16 (scaled in float32)")
    b, total_b = inputs(torch.bfloat16, 200)
    bits_eq(hvd.allreduce(b), (total_b.float() * inv(1.0 / N)).bfloat16(), "Average bfloat16 (reduced in float32)")
    bc = b.clone()
    assert hvd.allreduce_(bc, op=hvd.Sum) is bc
    bits_eq(bc, total_b.bfloat16(), "allreduce_ Sum bfloat16")
    i, total_i = inputs(torch.int32, 1 << 20)
    bits_eq(hvd.allreduce(i), (total_i * (1.0 / N)).to(torch.int32), "Average int32 (truncated)")
    bits_eq(hvd.allreduce(i.long(), op=hvd.Sum), total_i.long(), "Sum int64")
    u = ints(R, torch.uint8, 256)
    bits_eq(hvd.allreduce(u, op=hvd.Max), torch.stack([ints(r, torch.uint8, 256) for r in range(N)]).amax(0),
            "Max uint8")


def check_data_movement() -> None:
    x = ints(R, torch.float32, 1 << 20)
    root_x = ints(ROOT, torch.float32, 1 << 20)
    before = x.clone()
    y = hvd.broadcast(x, ROOT)
    bits_eq(y, root_x, "broadcast from the last rank")
    bits_eq(x, before, "broadcast left its input alone")
    assert y.data_ptr() != x.data_ptr()
    z = x.clone()
    ptr = z.data_ptr()
    assert hvd.broadcast_(z, ROOT) is z and z.data_ptr() == ptr
    bits_eq(z, root_x, "broadcast_ from the last rank")
    bf = (x / 7).bfloat16()
    bits_eq(hvd.broadcast(bf, ROOT).view(torch.int16), (root_x / 7).bfloat16().view(torch.int16),
            "broadcast bfloat16 bits")
    bits_eq(hvd.broadcast(x.long().view(-1, 8).t(), ROOT), root_x.long().view(-1, 8).t().contiguous(),
            "broadcast non-contiguous int64")
    rows = x[: (R + 1) * 1024].view(R + 1, 1024)
    expected = torch.cat([ints(r, torch.float32, 1 << 20)[: (r + 1) * 1024].view(r + 1, 1024) for r in range(N)])
    bits_eq(hvd.allgather(rows), expected, "allgather of uneven first dims")
    bits_eq(hvd.allgather(x), torch.cat([ints(r, torch.float32, 1 << 20) for r in range(N)]), "allgather")
    # megabytes of rows, as many on no two ranks: the result made ahead for as many rows as this
    # rank's on every rank does not fit, and the core makes its own
    tall = x.view(256, 4096)[: 128 + 64 * R]
    expected = torch.cat([ints(r, torch.float32, 1 << 20).view(256, 4096)[: 128 + 64 * r] for r in range(N)])
    bits_eq(hvd.allgather(tall), expected, "allgather of uneven first dims, megabytes each")


def check_grouped_and_gradients() -> None:
    f, total_f = inputs(torch.float32, 1000)
    i, total_i = inputs(torch.int64, 1000)
    group = [f, i, f[:5], f.view(-1, 4).t()]
    before = [t.clone() for t in group]
    out = hvd.grouped_allreduce(group, op=hvd.Sum)
    exp = [total_f.float(), total_i.long(), total_f.float()[:5], total_f.float().view(-1, 4).t().contiguous()]
    for k, (o, e, t, b) in enumerate(zip(out, exp, group, before)):
        bits_eq(o, e, f"grouped_allreduce[{k}]")
        bits_eq(t, b, f"grouped_allreduce left input {k} alone")
        assert o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), f"rank {R}: result {k} is the input"
    same = [t.clone() for t in group[:2]]
    assert all(a is b for a, b in zip(hvd.grouped_allreduce_(same, op=hvd.Sum), same))
    bits_eq(same[0], total_f.float(), "grouped_allreduce_[0]")
    g = f.clone().requires_grad_()
    y = hvd.allreduce(g, op=hvd.Sum)
    bits_eq(y.detach(), total_f.float(), "allreduce with autograd")
    y.sum().backward()
    assert g.grad is not None
    bits_eq(g.grad, torch.full_like(f, float(N)), "gradient of a Sum allreduce")


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def peak_growth(op: Callable[[], Any]) -> int:
    """Bytes the peak resident memory rose above the current while ``op()`` ran (its result dropped
    only afterwards).  The peak is reset through /proc/self/clear_refs first."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak resident memory := current
    start = status_kib("VmRSS")
    result = op()
    grown = (status_kib("VmHWM") - start) * 1024
    del result
    return grown


def check_peak_memory() -> None:
    """Each op twice (the first sets up the engine's buffers), the second measured: its peak growth
    against the bytes of the result it must make (none in place)."""
    x = torch.rand(RSS_ELEMS)
    t = x.nbytes
    ops: list[tuple[str, Callable[[], Any], int]] = [
        ("allreduce_", lambda: hvd.allreduce_(x, op=hvd.Sum), 0),
        ("broadcast_", lambda: hvd.broadcast_(x, ROOT), 0),
        ("allreduce", lambda: hvd.allreduce(x), t),
        ("allreduce Sum", lambda: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5), t),
        ("broadcast", lambda: hvd.broadcast(x, ROOT), t),
        ("allgather", lambda: hvd.allgather(x[: RSS_ELEMS // N]), t // N * N),
    ]
    for what, op, result_bytes in ops:
        peak_growth(op)
        grown = peak_growth(op)
        bound = result_bytes + t // 2  # one more full-size copy of the input would exceed it
        assert grown <= bound, (f"rank {R}: {what} of {t >> 20} MiB raised the peak resident memory by "
                                f"{grown / 2**20:.1f} MiB; its result takes {result_bytes / 2**20:.1f} MiB, "
                                f"the bound is {bound / 2**20:.1f} MiB: an extra copy or temporary")
        print(f"rank {R}: {what}: peak +{grown / 2**20:.1f} MiB (result {result_bytes / 2**20:.1f} MiB)", flush=True)


if __name__ == "__main__":
    check_allreduce_arithmetic()
    check_data_movement()
    check_grouped_and_gradients()
    if "rss" in sys.argv[1:]:
        check_peak_memory()
    print(f"WORKER OK rank={R}", flush=True)
    hvd.shutdown()
