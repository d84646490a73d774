"""Worker for tests/torch/test_torch_jobs.py: every ringcomm_torch collective and its gradient at any size.

Run by ``python -m ringcomm.launch.launcher -np N python torch_collectives_worker.py``; prints
``WORKER OK rank=R`` on success, raises (non-zero exit) on the first failed check.
"""

from __future__ import annotations

import math
import sys

import torch

import ringcomm_torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()


def eq(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 0.0) -> None:
    ok = a.shape == b.shape and a.dtype == b.dtype and (
        torch.equal(a, b) if atol == 0 else torch.allclose(a.double(), b.double(), atol=atol))
    assert ok, f"rank {R}: {what}: got {a!r}, expected {b!r}"


def check_allreduce_values() -> None:
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                  torch.uint8, torch.int8, torch.int16):
        x = torch.full((3, 4), R + 1, dtype=dtype)
        total = N * (N + 1) // 2
        eq(hvd.allreduce(x, op=hvd.Sum), torch.full((3, 4), total, dtype=dtype), f"Sum {dtype}")
        eq(hvd.allreduce(x, op=hvd.Min), torch.ones(3, 4, dtype=dtype), f"Min {dtype}")
        eq(hvd.allreduce(x, op=hvd.Max), torch.full((3, 4), N, dtype=dtype), f"Max {dtype}")
        if dtype not in (torch.int8, torch.uint8) or math.factorial(N) < 100:
            eq(hvd.allreduce(x, op=hvd.Product), torch.full((3, 4), math.factorial(N), dtype=dtype),
               f"Product {dtype}")
        avg = (N + 1) / 2 if dtype.is_floating_point else int(total / N)
        eq(hvd.allreduce(x), torch.full((3, 4), avg, dtype=dtype), f"Average {dtype}")
    b = torch.tensor([R == 0, True, False])
    eq(hvd.allreduce(b, op=hvd.Max), torch.tensor([True, True, False]), "bool Max")
    eq(hvd.allreduce(b, op=hvd.Min), torch.tensor([N == 1, True, False]), "bool Min")
    x = torch.full((5,), float(R + 1))
    eq(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25),
       torch.full((5,), N * (N + 1) / 4), "scales")
    # in place, async, non-contiguous, grouped (mixed dtypes)
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y
    eq(y, torch.full((5,), N * (N + 1) / 2), "allreduce_")
    h = hvd.allreduce_async(x, name="async.x")
    eq(hvd.synchronize(h), torch.full((5,), (N + 1) / 2), "allreduce_async")
    nc = torch.full((4, 3), float(R)).t()
    hvd.allreduce_(nc, op=hvd.Sum)
    eq(nc.contiguous(), torch.full((3, 4), N * (N - 1) / 2), "non-contiguous allreduce_")
    group = [torch.full((2,), float(R)), torch.full((3,), R, dtype=torch.int64), torch.full((1,), float(R)).double()]
    out = hvd.grouped_allreduce(group, op=hvd.Sum)
    assert [t.dtype for t in out] == [torch.float32, torch.int64, torch.float64]
    assert all(int(t[0]) == N * (N - 1) // 2 for t in out)
    handles = [hvd.allreduce_async_(torch.full((i + 1,), float(R)), op=hvd.Sum, name=f"many.{i}") for i in range(20)]
    for i, h in enumerate(handles):
        eq(hvd.synchronize(h), torch.full((i + 1,), N * (N - 1) / 2), f"many.{i}")


def check_data_movement() -> None:
    x = torch.full((R + 1, 2), float(R))
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(N)])
    eq(hvd.allgather(x), expected, "allgather")
    eq(hvd.allgather(x.bfloat16()), expected.bfloat16(), "allgather bf16")
    ga = hvd.grouped_allgather([x, x[:1].long()])
    eq(ga[0], expected, "grouped_allgather[0]")
    eq(ga[1], torch.tensor([[r, r] for r in range(N)]), "grouped_allgather[1]")
    root = N - 1
    v = torch.arange(6.0) + 100 * R
    eq(hvd.broadcast(v, root), torch.arange(6.0) + 100 * root, "broadcast")
    w = v.clone()
    assert hvd.broadcast_(w, root) is w
    eq(w, torch.arange(6.0) + 100 * root, "broadcast_")
    bf = torch.randn(7, generator=torch.Generator().manual_seed(R)).bfloat16()
    root_bf = torch.randn(7, generator=torch.Generator().manual_seed(root)).bfloat16()
    eq(hvd.broadcast(bf, root).view(torch.int16), root_bf.view(torch.int16), "broadcast bf16 bits")
    # alltoall: rank R sends j+1 rows to rank j, row values 1000 R + 10 j + i
    splits = [j + 1 for j in range(N)]
    rows = torch.tensor([1000 * R + 10 * j + i for j in range(N) for i in range(j + 1)], dtype=torch.float32)
    out, recv = hvd.alltoall(rows, splits=splits)
    exp = torch.tensor([1000 * s + 10 * R + i for s in range(N) for i in range(R + 1)], dtype=torch.float32)
    eq(out, exp, "alltoall")
    assert recv.tolist() == [R + 1] * N and recv.dtype == torch.int32, recv
    even = torch.arange(2 * N) + 100 * R
    eq(hvd.alltoall(even), torch.tensor([100 * s + 2 * R + i for s in range(N) for i in range(2)]), "alltoall even")
    # reducescatter: uneven rows, lower ranks get the extra
    rows_n = 2 * N + 1
    x = torch.arange(rows_n * 2, dtype=torch.float32).reshape(rows_n, 2)
    sizes = [rows_n // N + (1 if r < rows_n % N else 0) for r in range(N)]
    start = sum(sizes[:R])
    eq(hvd.reducescatter(x, op=hvd.Sum), N * x[start:start + sizes[R]], "reducescatter")
    eq(hvd.reducescatter(x), x[start:start + sizes[R]], "reducescatter Average")
    gr = hvd.grouped_reducescatter([x, x.double()], op=hvd.Sum)
    eq(gr[1], N * x.double()[start:start + sizes[R]], "grouped_reducescatter")


def check_gradients() -> None:
    w = float(R + 1)
    x = torch.randn(3, 2, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * w).sum().backward()
    eq(x.grad, torch.full((3, 2), N * (N + 1) / 2), "allreduce Sum grad")
    x.grad = None
    (hvd.allreduce(x) * w).sum().backward()
    eq(x.grad, torch.full((3, 2), (N + 1) / 2), "allreduce Average grad", atol=1e-6)
    x.grad = None
    a, b = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)
    ((a + b) * w).sum().backward()
    eq(x.grad, torch.full((3, 2), 3 * N * (N + 1) / 2), "grouped_allreduce grad")

    # allgather: gradient = this rank's rows of the averaged output gradient
    g = torch.randn(R + 1, 2, requires_grad=True)
    y = hvd.allgather(g)
    pos = torch.arange(y.shape[0], dtype=torch.float32).unsqueeze(1) + 1
    (y * pos * w).sum().backward()
    off = sum(r + 1 for r in range(R))
    eq(g.grad, ((N + 1) / 2 * pos[off:off + R + 1]).expand(R + 1, 2), "allgather grad", atol=1e-5)
    g.grad = None
    ys = hvd.grouped_allgather([g, g * 3])
    ((ys[0] + ys[1]) * w).sum().backward()
    eq(g.grad, torch.full((R + 1, 2), 4 * (N + 1) / 2), "grouped_allgather grad", atol=1e-5)

    # broadcast: root gets the averaged gradient, the others zeros
    root = N - 1
    v = torch.randn(4, requires_grad=True)
    (hvd.broadcast(v, root) * w).sum().backward()
    eq(v.grad, torch.full((4,), (N + 1) / 2 if R == root else 0.0), "broadcast grad", atol=1e-6)

    # alltoall: the gradient goes back to the rank that sent each row
    splits = [j + 1 for j in range(N)]
    rows = torch.randn(sum(splits), 1, requires_grad=True)
    out, recv = hvd.alltoall(rows, splits=splits)
    wout = torch.tensor([[100.0 * R + i] for i in range(out.shape[0])])
    (out * wout).sum().backward()
    exp = torch.tensor([[100.0 * j + R * (j + 1) + i] for j in range(N) for i in range(j + 1)])
    eq(rows.grad, exp, "alltoall grad")
    even = torch.randn(2 * N, requires_grad=True)
    (hvd.alltoall(even) * w).sum().backward()
    eq(even.grad, torch.tensor([float(j + 1) for j in range(N) for _ in range(2)]), "alltoall even grad")

    # reducescatter: allgather of the gradient (x size for Sum, as Horovod)
    rows_n = 2 * N + 1
    sizes = [rows_n // N + (1 if r < rows_n % N else 0) for r in range(N)]
    owner = torch.tensor([[float(r + 1)] for r in range(N) for _ in range(sizes[r])])
    for op, mul in ((hvd.Sum, N), (hvd.Average, 1)):
        z = torch.randn(rows_n, 1, requires_grad=True)
        (hvd.reducescatter(z, op=op) * w).sum().backward()
        eq(z.grad, owner * mul, f"reducescatter grad {op}", atol=1e-6)
    z = torch.randn(rows_n, 1, requires_grad=True)
    (hvd.grouped_reducescatter([z], op=hvd.Sum)[0] * w).sum().backward()
    eq(z.grad, owner * N, "grouped_reducescatter grad")

    # fp16 compression through autograd
    c = torch.full((3,), float(R + 1), dtype=torch.float64, requires_grad=True)
    r = hvd.allreduce(c, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert r.dtype == torch.float64
    (r * w).sum().backward()
    eq(c.grad, torch.full((3,), N * (N + 1) / 2, dtype=torch.float64), "fp16 grad")


def check_objects_and_control() -> None:
    got = hvd.broadcast_object({"from": R, "list": [R] * 3} if R == 1 % N else None, root_rank=1 % N)
    assert got == {"from": 1 % N, "list": [1 % N] * 3}, got
    assert hvd.allgather_object(("r", R)) == [("r", r) for r in range(N)]
    hvd.barrier()
    # join: the last rank runs one more allreduce, to which the joined ranks contribute zeros
    if R == N - 1:
        eq(hvd.allreduce(torch.full((2,), 5.0), op=hvd.Sum, name="after_join"), torch.full((2,), 5.0), "join")
    assert hvd.join() == N - 1


def check_errors_name_the_ranks() -> None:
    for what, make in (("shape", lambda: torch.zeros(R + 1)),
                       ("dtype", lambda: torch.zeros(2, dtype=torch.float32 if R == 0 else torch.float64))):
        try:
            hvd.allreduce(make(), name=f"mismatch.{what}")
        except hvd.HorovodInternalError as exc:
            msg = str(exc)
            assert "rank 0" in msg and "rank 1" in msg, msg
            assert f"mismatch.{what}" in msg, msg
            if what == "shape":
                assert "(1,)" in msg and "(2,)" in msg, msg
        else:
            raise AssertionError(f"rank {R}: a {what} mismatch did not raise")
    # the job keeps working
    eq(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(N)), "after mismatch")
    try:
        hvd.broadcast(torch.zeros(2 + R), 0, name="mismatch.bcast")
    except hvd.HorovodInternalError:
        pass
    else:
        raise AssertionError("broadcast shape mismatch did not raise")
    eq(hvd.broadcast(torch.full((2,), float(R)), 0), torch.zeros(2), "after broadcast mismatch")


def check_compiled() -> None:
    """Collectives called inside a ``torch.compile``d function (TorchDynamo through AOTAutograd)
    run there as they do eagerly: the same values, and the same gradient through ``hvd.allreduce``."""

    def step(x: torch.Tensor) -> torch.Tensor:
        y = hvd.allreduce(x * 2, op=hvd.Sum)
        z = hvd.allgather(y[None])
        h = hvd.allreduce_async_(z.clone(), op=hvd.Max)
        b = hvd.broadcast(hvd.synchronize(h), N - 1)
        rows = hvd.alltoall(torch.arange(2.0 * N) + R)
        return b.sum() + rows.sum() + y.pow(2).sum()

    compiled = torch.compile(step, backend="aot_eager")
    for k in range(2):  # the second call runs what the first compiled
        x, xc = (torch.arange(4.0) + R + k).requires_grad_(), (torch.arange(4.0) + R + k).requires_grad_()
        want, got = step(x), compiled(xc)
        want.backward()
        got.backward()
        eq(got.detach(), want.detach(), f"compiled step {k}")
        assert x.grad is not None and xc.grad is not None
        eq(xc.grad, x.grad, f"compiled step {k}: gradient")


def run() -> None:
    """Every check of this module (raises on the first failure)."""
    check_allreduce_values()
    check_data_movement()
    check_gradients()
    if N > 1:
        check_errors_name_the_ranks()
    check_objects_and_control()
    if N == 2:  # once: torch.compile's start-up is the check's cost, and the ranks' number changes nothing in it
        check_compiled()


if __name__ == "__main__":
    run()
    print(f"WORKER OK rank={R}", flush=True)
    hvd.shutdown()
    sys.exit(0)
