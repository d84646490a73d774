"""Conformance job: Horovod's collective semantics (values, scaling, gradients, errors, join).

Run by ``python -m ringcomm.launch.launcher -np N python conformance_collectives.py``; every check
compares against a reference computed here the way Horovod computes on CPU
(bit for bit where Horovod demands exact equality).  Prints ``CONFORMANCE OK
rank=R`` when every check passed; raises on the first failure.
"""

from __future__ import annotations

import itertools
import os
import warnings

import torch

import ringcomm_torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
INTS = (torch.int32, torch.int64)
FLOATS = (torch.float32, torch.float64, torch.float16)
FACTOR = 0.1915194503788923  # a factor whose scaling rounds differently in half and single precision


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), \
        f"rank {R}: {what}: got {a.flatten()[:6].tolist()}... {a.dtype} {tuple(a.shape)}, " \
        f"expected {b.flatten()[:6].tolist()}... {b.dtype} {tuple(b.shape)}"


def ranks_agree(t: torch.Tensor, what: str) -> None:
    """Every rank holds the same bits (the result a job must agree on)."""
    got = hvd.allgather_object(t.double().tolist() if t.dtype == torch.float16 else t.tolist())
    assert all(g == got[0] for g in got), f"rank {R}: {what}: ranks hold different results"


def seeded(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 1234) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.empty(shape).random_(-100, 100).to(dtype)


def scale_cpu(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Scale as Horovod does on CPU: ints in float64 (truncated), half in float32 (rounded once)."""
    work = torch.float64 if t.dtype in INTS else torch.float32 if t.dtype == torch.float16 else t.dtype
    return (t.to(work) * torch.tensor(factor, dtype=torch.float64).to(work)).to(t.dtype)


def summed(t: torch.Tensor, n: int) -> torch.Tensor:
    acc = t.clone()
    for _ in range(n - 1):
        acc = acc + t
    return acc


def check_init_and_sizes() -> None:
    assert hvd.is_initialized()
    assert int(os.environ.get("HOROVOD_RANK", R)) == R and int(os.environ.get("HOROVOD_SIZE", N)) == N
    assert 0 <= hvd.local_rank() < hvd.local_size() <= N


def check_allreduce_sum_average_inplace_async() -> None:
    for dtype, dim in itertools.product(INTS + FLOATS, (1, 2, 3)):
        t = seeded((17,) * dim, dtype)
        same(hvd.allreduce(t, op=hvd.Sum), summed(t, N), f"allreduce Sum {dtype}")
        if dtype != torch.float16:
            same(hvd.allreduce(t, op=hvd.Average), scale_cpu(summed(t, N), 1.0 / N), f"Average {dtype}")
        inplace = t.clone()
        hvd.allreduce_(inplace, op=hvd.Sum)
        same(inplace, summed(t, N), f"allreduce_ {dtype}")
    handles, seen_pending = [], False
    for dtype, dim in itertools.product(INTS + FLOATS, (1, 2, 3)):
        t = seeded((17,) * dim, dtype)
        h = hvd.allreduce_async(t, op=hvd.Sum)
        seen_pending |= not hvd.poll(h)
        handles.append((h, summed(t, N)))
    assert seen_pending, "allreduce_async: poll() was True at once for every op: not asynchronous"
    for h, want in handles:
        same(hvd.synchronize(h), want, "allreduce_async fused")


def check_scaling_bit_exact() -> None:
    for dtype, dim in itertools.product(INTS + FLOATS, (1, 2, 3)):
        t = seeded((17,) * dim, dtype)
        pre = hvd.allreduce(t, op=hvd.Sum, prescale_factor=FACTOR)
        same(pre, summed(scale_cpu(t, FACTOR), N), f"allreduce prescale {dtype}")
        post = hvd.allreduce(t, op=hvd.Sum, postscale_factor=FACTOR)
        same(post, scale_cpu(summed(t, N), FACTOR), f"allreduce postscale {dtype}")
        ranks_agree(pre, f"allreduce prescale {dtype}")
        group = hvd.grouped_allreduce([t, t * 1], op=hvd.Sum, prescale_factor=FACTOR)
        for g in group:
            same(g, summed(scale_cpu(t, FACTOR), N), f"grouped_allreduce prescale {dtype}")


def _rows(n: int) -> list[int]:
    return [n // N + (1 if i < n % N else 0) for i in range(N)]


def check_reducescatter_scaling_identical_ranks() -> None:
    for dtype, shape in itertools.product(INTS + FLOATS, ((7 * N, 3), (5,), (4 * N + 1, 2, 2))):
        t = seeded(shape, dtype)
        start = sum(_rows(shape[0])[:R])
        mine = slice(start, start + _rows(shape[0])[R])
        for op in (hvd.Sum, hvd.Average):
            avg = 1.0 / N if op == hvd.Average else 1.0
            pre = hvd.reducescatter(t, op=op, prescale_factor=FACTOR)
            want = summed(scale_cpu(t, FACTOR), N)
            same(pre, (scale_cpu(want, avg) if avg != 1.0 else want)[mine], f"reducescatter prescale {op} {dtype}")
            post = hvd.reducescatter(t, op=op, postscale_factor=FACTOR)
            same(post, scale_cpu(summed(t, N), FACTOR * avg)[mine], f"reducescatter postscale {op} {dtype}")
            whole = hvd.allgather(post)
            ranks_agree(whole, f"reducescatter postscale {op} {dtype}")
            grouped = hvd.grouped_reducescatter([t, t.clone()], op=op, postscale_factor=FACTOR)
            for g in grouped:
                same(g, post, f"grouped_reducescatter postscale {op} {dtype}")


def check_gradients() -> None:
    for dtype, dim in itertools.product((torch.float32, torch.float64), (1, 2, 3)):
        shape = (17,) * dim
        x = seeded(shape, dtype).requires_grad_()
        hvd.allreduce(x, op=hvd.Sum).backward(torch.ones(shape, dtype=dtype))
        same(x.grad, torch.full(shape, float(N), dtype=dtype), "allreduce Sum grad")
        x = seeded(shape, dtype).requires_grad_()
        hvd.allreduce(x, op=hvd.Average).backward(torch.ones(shape, dtype=dtype))
        same(x.grad, torch.ones(shape, dtype=dtype), "allreduce Average grad")
        xs = [seeded(shape, dtype, s).requires_grad_() for s in range(3)]
        for y in hvd.grouped_allreduce(xs, op=hvd.Sum):
            y.backward(torch.ones(shape, dtype=dtype))
        for xi in xs:
            same(xi.grad, torch.full(shape, float(N), dtype=dtype), "grouped_allreduce Sum grad")
        sizes = [3, 2, 7, 4, 6, 8, 10][:N]
        x = torch.full((sizes[R],) + shape[1:], float(R), dtype=dtype, requires_grad=True)
        dy = torch.cat([torch.full((s,) + shape[1:], float(r), dtype=dtype) for r, s in enumerate(sizes)])
        hvd.allgather(x).backward(dy)  # Horovod 0.28: the output gradient averaged over ranks, own block
        same(x.grad, torch.full(x.shape, float(R), dtype=dtype), "allgather grad")
        for root in range(N):
            x = torch.full(shape, float(R), dtype=dtype, requires_grad=True)
            hvd.broadcast(x, root).backward(torch.ones(shape, dtype=dtype))
            # Horovod 0.28: the output gradient averaged over ranks, kept on the root only
            same(x.grad, torch.full(shape, float(R == root), dtype=dtype), "broadcast grad")
        x = _alltoall_input(dim, dtype).requires_grad_()
        out, received = hvd.alltoall(x, torch.tensor([R + 1] * N, dtype=torch.int32))  # 0.28: with its splits
        same(received, torch.tensor([r + 1 for r in range(N)], dtype=torch.int32), "alltoall received splits")
        out.backward(torch.ones(out.shape, dtype=dtype))
        same(x.grad, torch.ones(x.shape, dtype=dtype), "alltoall grad")
        rows = (2 * N,) + shape[1:]
        for op, factor in ((hvd.Sum, float(N)), (hvd.Average, 1.0)):
            x = torch.ones(rows, dtype=dtype, requires_grad=True)
            y = hvd.reducescatter(x, op=op)
            y.backward(torch.ones(y.shape, dtype=dtype))
            same(x.grad, torch.full(rows, factor, dtype=dtype), f"reducescatter {op} grad")
            xs = [torch.ones(rows, dtype=dtype, requires_grad=True) for _ in range(2)]
            for y in hvd.grouped_reducescatter(xs, op=op):
                y.backward(torch.ones(y.shape, dtype=dtype))
            for xi in xs:
                same(xi.grad, torch.full(rows, factor, dtype=dtype), f"grouped_reducescatter {op} grad")


def _alltoall_input(dim: int, dtype: torch.dtype) -> torch.Tensor:
    t = torch.tensor([float(i) for i in range(N) for _ in range(R + 1)])
    for _ in range(dim - 1):
        t = torch.cat((t.unsqueeze(1), t.unsqueeze(1)), dim=1) if t.dim() == 1 else torch.cat((t, t), dim=1)
    return t.to(dtype)


def check_allgather_broadcast_alltoall_values() -> None:
    all_types = (torch.uint8, torch.int8, torch.int16) + INTS + FLOATS
    for dtype, dim in itertools.product(all_types, (1, 2, 3)):
        sizes = [17, 32, 81, 12, 15, 23, 22][:N]
        t = torch.full((sizes[R],) + (17,) * (dim - 1), R, dtype=dtype)
        got = hvd.allgather(t)
        same(got, torch.cat([torch.full((s,) + (17,) * (dim - 1), r, dtype=dtype) for r, s in enumerate(sizes)]),
             f"allgather variable {dtype}")
        for root in range(N):
            src = torch.full((17,) * dim, R, dtype=dtype)
            out = hvd.broadcast(src, root)
            same(out, torch.full((17,) * dim, root, dtype=dtype), f"broadcast {dtype}")
            same(src, torch.full((17,) * dim, R, dtype=dtype), "broadcast leaves its input")
            hvd.broadcast_(src, root)
            same(src, torch.full((17,) * dim, root, dtype=dtype), f"broadcast_ {dtype}")
        x = _alltoall_input(dim, dtype)
        out, _ = hvd.alltoall(x, torch.tensor([R + 1] * N, dtype=torch.int32))
        assert out.min() == R and out.max() == R and out.numel() == N * (N + 1) // 2 * 2 ** (dim - 1)
        out = hvd.alltoall(x)  # equal split: every rank's block of rows
        assert out.min() == R and out.max() == R


def _raises(kinds: tuple[type, ...], fn, what: str) -> None:
    try:
        fn()
    except kinds:
        return
    raise AssertionError(f"rank {R}: {what}: no {', '.join(k.__name__ for k in kinds)} raised")


def check_errors() -> None:
    _raises((RuntimeError,), lambda: hvd.allreduce(torch.zeros((17 + R,) * 3)), "allreduce shape mismatch")
    shape = (17, 23 * 57) if R == 0 else (17, 23, 57)
    _raises((RuntimeError,), lambda: hvd.allreduce(torch.zeros(shape)), "allreduce rank mismatch")
    wrong_type = torch.zeros(17, dtype=torch.int32 if R % 2 == 0 else torch.float32)
    _raises((RuntimeError,), lambda: hvd.allreduce(wrong_type), "allreduce dtype mismatch")
    _raises((RuntimeError,), lambda: hvd.allgather(torch.zeros(17, 10 * (R + 1), 17)), "allgather shape mismatch")
    _raises((RuntimeError,), lambda: hvd.allgather(wrong_type), "allgather dtype mismatch")
    _raises((RuntimeError,), lambda: hvd.broadcast(torch.zeros(17, 10 * (R + 1)), 0), "broadcast shape mismatch")
    _raises((RuntimeError,), lambda: hvd.broadcast(wrong_type, 0), "broadcast dtype mismatch")
    _raises((RuntimeError,), lambda: hvd.broadcast(torch.zeros(17), R), "broadcast root mismatch")
    _raises((RuntimeError,), lambda: hvd.alltoall(wrong_type[:N]), "alltoall dtype mismatch")
    _raises((RuntimeError,), lambda: hvd.alltoall(torch.ones(2 * N, 10 * (R + 1))), "alltoall shape mismatch")
    _raises((ValueError,), lambda: hvd.alltoall(torch.empty(N + 1)), "alltoall uneven equal split")
    _raises((ValueError,), lambda: hvd.alltoall(torch.empty(N - 1), torch.ones(N, dtype=torch.int32)),
            "alltoall splits over the length")
    _raises((ValueError,), lambda: hvd.alltoall(torch.empty(N), torch.empty(N, dtype=torch.float32)),
            "alltoall float splits tensor")
    _raises((ValueError,), lambda: hvd.alltoall(torch.empty(N), [1.0] * N), "alltoall float splits list")
    for start in (lambda: hvd.allreduce_async(torch.zeros(17), name="dup"),
                  lambda: hvd.allgather_async(torch.zeros(17), name="dup"),
                  lambda: hvd.broadcast_async(torch.zeros(17), root_rank=0, name="dup")):
        # Only rank 0 starts the op at first, so it cannot complete (and leave
        # the name free) before the second call: the others join after a barrier.
        if R == 0:
            first = start()
            _raises((ValueError,), start, "a second op under a name in flight")
        hvd.barrier()
        if R != 0:
            first = start()
        hvd.synchronize(first)
        hvd.barrier()


def check_join() -> None:
    for dtype, dim, first, cached in itertools.product(INTS + (torch.float32, torch.float64), (1, 2, 3),
                                                       (0, N - 1), (False, True)):
        a, b = seeded((5,) * dim, dtype), seeded((17,) * dim, dtype, 99)
        if cached:
            hvd.synchronize(hvd.allreduce_async(a, name="join.a", op=hvd.Average))
            hvd.synchronize(hvd.allreduce_async(b, name="join.b", op=hvd.Average))
        if R == first:
            hvd.join()
            continue
        ha = hvd.allreduce_async(a, name="join.a", op=hvd.Average)
        hb = hvd.allreduce_async(b, name="join.b", op=hvd.Average)
        got_a, got_b = hvd.synchronize(ha), hvd.synchronize(hb)
        hvd.join()
        # Horovod: the joined rank adds zeros; Average multiplies the sum by 1/size (the whole set's)
        same(got_a, scale_cpu(summed(a, N - 1), 1.0 / N), f"join Average {dtype}")
        same(got_b, scale_cpu(summed(b, N - 1), 1.0 / N), f"join Average {dtype}")
    if R == 0:
        hvd.join()
    else:
        _raises((RuntimeError,), lambda: hvd.allgather(torch.zeros(17)), "allgather with a joined rank")
        hvd.join()
    if R == 0:
        hvd.join()
    else:
        _raises((RuntimeError,), lambda: hvd.broadcast(torch.zeros(17), 1), "broadcast with a joined rank")
        hvd.join()


def check_reinit() -> None:
    rank, size = hvd.rank(), hvd.size()
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()
    assert (hvd.rank(), hvd.size()) == (rank, size)


if __name__ == "__main__":
    warnings.simplefilter("ignore", DeprecationWarning)
    for check in (check_init_and_sizes, check_allreduce_sum_average_inplace_async, check_scaling_bit_exact,
                  check_reducescatter_scaling_identical_ranks, check_gradients,
                  check_allgather_broadcast_alltoall_values, check_errors, check_join, check_reinit):
        check()
        hvd.barrier()
    print(f"CONFORMANCE OK rank={R}", flush=True)
    hvd.shutdown()
