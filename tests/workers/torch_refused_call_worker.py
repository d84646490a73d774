"""Worker for tests/torch/test_torch_refused_calls.py: one rank passes a tensor the torch layer cannot stage.

Usage: ringcomm-run -np N python torch_refused_call_worker.py   (N >= 2; rank 1 is the one in the wrong)

On rank 1 only, each case calls a collective with an argument ``ringcomm_torch`` refuses before it
reaches the core (an unsupported dtype, a sparse tensor, a non-tensor, bad alltoall splits...),
unnamed and named.  Rank 1 must raise its own InvalidTypeError/InvalidInputError, every other rank
MismatchError naming rank 1 and the reason, each within a few seconds; then an unnamed op of every
kind must give the right result on every rank (the automatic numbering is still in step).
Prints ``CASE <label> OK`` per case on every rank and ``TORCH REFUSALS OK`` at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import ringcomm as rc
import ringcomm_torch as hvd
from ringcomm.errors import InvalidSplitsError

torch.set_num_threads(1)
hvd.init(process_sets="dynamic")
R, N = hvd.rank(), hvd.size()
BAD = 1
TOTAL = N * (N + 1) / 2  # the Sum of rank + 1 over the ranks
SECONDS = 8.0  # a refusal answers in well under a second; a stall would take minutes


def after() -> None:
    """One unnamed op of every core kind, checked on every rank: they pair up only if every rank's
    automatic numbering (per kind) is still in step."""
    t = torch.full((2,), R + 1.0)
    assert hvd.allreduce(t, op=hvd.Sum).tolist() == [TOTAL] * 2
    a, b = hvd.grouped_allreduce([t, t.double() * 2], op=hvd.Sum)  # two dtypes: two core ops
    assert a.tolist() == [TOTAL] * 2 and b.tolist() == [2 * TOTAL] * 2 and b.dtype is torch.float64
    assert hvd.allgather(t[:1]).tolist() == [r + 1.0 for r in range(N)]
    g0, g1 = hvd.grouped_allgather([t[:1], t[:1] * 3])
    assert g0.tolist() == [r + 1.0 for r in range(N)] and g1.tolist() == [3.0 * (r + 1) for r in range(N)]
    assert hvd.broadcast(t, root_rank=N - 1).tolist() == [float(N)] * 2
    out, recv = hvd.alltoall(torch.full((N,), R + 1.0), splits=[1] * N)
    assert out.tolist() == [r + 1.0 for r in range(N)] and recv.tolist() == [1] * N
    assert hvd.reducescatter(torch.full((N,), R + 1.0), op=hvd.Sum).tolist() == [TOTAL]
    (rs,) = hvd.grouped_reducescatter([torch.full((N,), R + 1.0)], op=hvd.Sum)
    assert rs.tolist() == [TOTAL]


def case(label: str, good: Callable[[], Any], bad: Callable[[], Any], pattern: str,
         bad_error: type[Exception] = rc.InvalidTypeError, check: Callable[[], None] = after) -> None:
    start = time.monotonic()
    try:
        (bad if R == BAD else good)()
    except (rc.MismatchError, rc.InvalidInputError, rc.InvalidTypeError) as exc:
        took, text = time.monotonic() - start, str(exc)
        assert took < SECONDS, (label, R, took)
        assert pattern in text, (label, R, text)
        if R == BAD:
            assert isinstance(exc, bad_error) and not isinstance(exc, rc.MismatchError), (label, repr(exc))
            assert f"on rank {BAD}" in text, (label, text)  # its own error names it too
        else:
            assert isinstance(exc, rc.MismatchError), (label, R, repr(exc))
            assert f"rank {BAD} refused the call" in text, (label, R, text)
    else:
        raise AssertionError(f"{label}: rank {R}'s call did not fail")
    check()
    print(f"CASE {label} OK", flush=True)


def both(label: str, good: Callable[[str | None], Any], bad: Callable[[str | None], Any], pattern: str,
         bad_error: type[Exception] = rc.InvalidTypeError, check: Callable[[], None] = after) -> None:
    """The case unnamed, then named."""
    for name in (None, label.replace(" ", "_")):
        case(f"{label} ({'named' if name else 'unnamed'})", lambda nm=name: good(nm), lambda nm=name: bad(nm), pattern,
             bad_error, check)


x = torch.arange(2 * N, dtype=torch.float32).reshape(N, 2)
cx = x.to(torch.complex64)
sparse = x.to_sparse()

both("allreduce complex", lambda nm: hvd.allreduce(x, name=nm), lambda nm: hvd.allreduce(cx, name=nm),
     "complex64")
both("in-place allreduce uint16", lambda nm: hvd.allreduce_(x.clone(), name=nm),
     lambda nm: hvd.allreduce_(x.to(torch.uint16), name=nm), "uint16")
both("allgather sparse", lambda nm: hvd.allgather(x, name=nm), lambda nm: hvd.allgather(sparse, name=nm),
     "sparse_coo")
both("broadcast non-tensor", lambda nm: hvd.broadcast(x, 0, name=nm),
     lambda nm: hvd.broadcast(x.tolist(), 0, name=nm), "expected a torch.Tensor, got list")
both("alltoall float splits", lambda nm: hvd.alltoall(x, splits=[1] * N, name=nm),
     lambda nm: hvd.alltoall(x, splits=[0.5] * N, name=nm), "splits must hold integers", InvalidSplitsError)
both("reducescatter complex", lambda nm: hvd.reducescatter(x, name=nm),
     lambda nm: hvd.reducescatter(cx, name=nm), "complex64")
both("allreduce op and average", lambda nm: hvd.allreduce(x, name=nm, op=hvd.Sum),
     lambda nm: hvd.allreduce(x, name=nm, op=hvd.Sum, average=True), "provide only one", rc.InvalidInputError)
# a group of two dtypes is two core ops: the rank in the wrong refuses both (its complex tensor aside)
both("grouped_allreduce complex", lambda nm: hvd.grouped_allreduce([x, x.double()], name=nm),
     lambda nm: hvd.grouped_allreduce([x, cx, x.double()], name=nm), "complex64")
# a grouped allgather or reducescatter is one core op per tensor: each is refused
both("grouped_allgather uint16", lambda nm: hvd.grouped_allgather([x, x, x], name=nm),
     lambda nm: hvd.grouped_allgather([x, x.to(torch.uint16), x], name=nm), "uint16")
both("grouped_reducescatter sparse", lambda nm: hvd.grouped_reducescatter([x, x], name=nm),
     lambda nm: hvd.grouped_reducescatter([x, sparse], name=nm), "sparse_coo")
both("sparse_allreduce dense", lambda nm: hvd.sparse_allreduce_async(sparse, name=nm)(),
     lambda nm: hvd.sparse_allreduce_async(x, name=nm)(), "expected a sparse COO tensor")
both("sparse_allreduce complex values", lambda nm: hvd.sparse_allreduce_async(sparse, name=nm)(),
     lambda nm: hvd.sparse_allreduce_async(cx.to_sparse(), name=nm)(), "complex64")

# broadcast_parameters: a non-tensor entry refuses every entry's broadcast (named and unnamed)...
params = {"a": torch.zeros(2), "b": torch.zeros(3)}
case("broadcast_parameters non-tensor", lambda: hvd.broadcast_parameters(params, root_rank=0),
     lambda: hvd.broadcast_parameters({"a": torch.zeros(2), "b": 1.5}, root_rank=0), "entry 'b' is a float")
case("broadcast_parameters unnamed non-tensor", lambda: hvd.broadcast_parameters(list(params.values()), 0),
     lambda: hvd.broadcast_parameters([torch.zeros(2), 1.5], 0), "entry None is a float")
# ... an entry it cannot stage is refused alone, and the other entries still arrive everywhere
root = 0
mine = {"a": torch.full((2,), R + 1.0), "b": torch.full((3,), R + 1.0)}
if R == BAD:
    mine["b"] = mine["b"].to(torch.complex64)
case("broadcast_parameters complex entry", lambda: hvd.broadcast_parameters(mine, root_rank=root),
     lambda: hvd.broadcast_parameters(mine, root_rank=root), "complex64")
assert mine["a"].tolist() == [root + 1.0] * 2, mine["a"]

if N >= 3:  # a process set with the rank in the wrong but not rank 0: refused in that set
    ps = hvd.add_process_set([1, 2])
    def in_set() -> None:  # unnamed ops of the set: still in step
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps).tolist() == [2.0]
        (g,) = hvd.grouped_allgather([torch.full((1,), R + 0.0)], process_set=ps)
        assert g.tolist() == [1.0, 2.0]

    if ps.included():
        both("allreduce complex in a process set", lambda nm: hvd.allreduce(x, name=nm, process_set=ps),
             lambda nm: hvd.allreduce(cx, name=nm, process_set=ps), "complex64", check=in_set)
        both("grouped_allgather in a process set", lambda nm: hvd.grouped_allgather([x, x], nm, ps),
             lambda nm: hvd.grouped_allgather([x, sparse], nm, ps), "sparse_coo", check=in_set)
    after()  # the global set's numbering too
hvd.shutdown()
print("TORCH REFUSALS OK", flush=True)
