"""Runs the whole bad-input catalogue in one job; every rank checks what it sees.

Usage: ringcomm-run -np N python bad_input_worker.py   (N >= 2)

For each case every rank checks the exception type, that the message names
what is wrong (and, where the user has a choice, how to fix it), and that the
next collective works.  Cross-rank cases (ranks disagree) must raise
``MismatchError`` on *every* rank.  Prints ``CASE <label> OK`` per case and
``CATALOGUE OK`` at the end; any failure is an uncaught exception (exit 1).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import numpy as np

import ringcomm as rc

R = int(os.environ["RINGCOMM_RANK"])
N = int(os.environ["RINGCOMM_SIZE"])
_after = 0


def works() -> None:
    """A collective right after the failure succeeds with the right result."""
    global _after
    _after += 1
    got = rc.allreduce(np.full(3, R + 1.0), op=rc.Sum, name=f"after.{_after}")
    assert got.tolist() == [N * (N + 1) / 2] * 3, got


def expect(label: str, call: Callable[[], object], exc: type[BaseException], *patterns: str) -> None:
    try:
        call()
    except exc as e:
        text, got = str(e), type(e).__name__
        for p in patterns:
            assert re.search(p, text), f"{label}: {p!r} not in {text!r}"
    else:
        raise AssertionError(f"{label}: no {exc.__name__} raised on rank {R}")
    works()
    print(f"CASE {label} OK: {got}: {text}", flush=True)


def mismatch(label: str, call: Callable[[], object], *patterns: str) -> None:
    """Ranks disagree: MismatchError on every rank, naming the ranks, the values and the fix."""
    expect(label, call, rc.MismatchError, *patterns, rf"\[raised on rank {R}\]")


def main() -> None:
    assert N >= 2
    rc.init()
    other = R != 0
    # -- ranks disagree --------------------------------------------------------------
    mismatch("shape", lambda: rc.allreduce(np.ones(2 + other), name="m.shape"),
             r"allreduce 'm\.shape': ranks disagree on shape: rank 0 has \(2,\)", r"ha(s|ve) \(3,\)",
             "Pass the same shape on every rank")
    mismatch("dtype", lambda: rc.allreduce(np.ones(2, np.float32 if other else np.float64), name="m.dtype"),
             "ranks disagree on dtype: rank 0 has 'float64'", "'float32'", "Pass the same dtype")
    mismatch("op", lambda: rc.allreduce(np.ones(2), op=rc.Max if other else rc.Sum, name="m.op"),
             "ranks disagree on reduce op: rank 0 has 'Sum'", "'Max'", "Pass the same reduce op")
    mismatch("root", lambda: rc.broadcast(np.ones(2), 1 if other else 0, name="m.root"),
             "broadcast 'm.root': ranks disagree on root_rank: rank 0 has 0", "ha(s|ve) 1", "Pass the same root_rank")
    mismatch("collective", lambda: (rc.allgather if other else rc.allreduce)(np.ones(2), name="m.kind"),
             "ranks disagree on the collective", "'allreduce'", "'allgather'", "same collective under one name")
    mismatch("allgather trailing dims", lambda: rc.allgather(np.ones((2, 3 + other)), name="m.trail"),
             r"allgather 'm\.trail': ranks disagree on the dimensions after the first: rank 0 has \(3,\)",
             r"\(4,\)", "Only dim 0 may differ")
    mismatch("alltoall trailing dims", lambda: rc.alltoall(np.ones((N, 1 + other)), name="m.a2a"),
             "alltoall 'm.a2a': ranks disagree on the dimensions after the first", "Only dim 0 may differ")
    # the last rank expects one row more from rank 0 than rank 0 sends it: every rank fails, on the
    # small-op lane (one row each) and past its bound (rows of 1 MiB) alike
    for cols in (1, 1 << 17):
        want = [1] * N
        want[0] += R == N - 1
        mismatch(f"alltoall received_splits {cols}", lambda c=cols, w=want: rc.alltoall(
            np.ones((N, c)), name=f"m.recv.{c}", received_splits=w, out=np.empty((sum(w), c))),
            rf"alltoall 'm\.recv\.{cols}': rank {N - 1} expects \[2(, 1)*\] rows from ranks \[0(, \d)*\], "
            rf"which send it \[1(, 1)*\]", "Each rank must send every rank the rows that rank expects")
    got, recv = rc.alltoall(np.arange(N, dtype=np.int64) + 10 * R, name="m.recv.ok", received_splits=[1] * N)
    assert got.tolist() == [10 * q + R for q in range(N)] and recv.tolist() == [1] * N, (got, recv)
    mismatch("reducescatter shape", lambda: rc.reducescatter(np.ones((N + other, 2)), name="m.rs"),
             "reducescatter 'm.rs': ranks disagree on shape", "Pass the same shape")

    # -- wrong on every rank, caught at the call -------------------------------------
    expect("root out of range", lambda: rc.broadcast(np.ones(2), N, name="b.root"), rc.InvalidInputError,
           f"broadcast 'b.root': root_rank={N} is out of range for a job of size {N}; use 0..{N - 1}")
    expect("negative root", lambda: rc.broadcast(np.ones(2), -1, name="b.neg"), rc.InvalidInputError,
           "root_rank=-1 is out of range", f"use 0..{N - 1}")
    expect("splits wrong length", lambda: rc.alltoall(np.ones(3), splits=[1, 2, 0, 0][: N - 1] or [3], name="s.len"),
           rc.InvalidInputError, f"alltoall 's.len': splits must have one entry per rank \\({N}\\)", "pass")
    neg = [-1] + [0] * (N - 2) + [4]
    expect("splits negative", lambda: rc.alltoall(np.ones(3), splits=neg, name="s.neg"), rc.InvalidInputError,
           "splits must be >= 0", re.escape(str(neg)))
    expect("splits not summing", lambda: rc.alltoall(np.ones(N + 1), splits=[1] * N, name="s.sum"),
           rc.InvalidInputError, f"splits sum to {N} but dim 0 of the array is {N + 1}; they must match")
    expect("splits float", lambda: rc.alltoall(np.ones(N), splits=np.ones(N), name="s.float"), rc.InvalidTypeError,
           "splits must be integers, got dtype float64", "astype")
    expect("received_splits wrong length", lambda: rc.alltoall(np.ones(N), name="s.recv", received_splits=[1]),
           rc.InvalidInputError, f"received_splits must have one entry per rank \\({N}\\)")
    expect("reducescatter 0-d", lambda: rc.reducescatter(np.array(1.0), name="rs.0d"), rc.InvalidInputError,
           "reducescatter 'rs.0d': needs an array with at least one dimension, got a 0-d array", "reshape")
    expect("non-contiguous", lambda: rc.allreduce(np.ones((4, 4))[:, ::2], name="nc"), rc.InvalidInputError,
           "not C-contiguous", r"np\.ascontiguousarray")
    expect("object dtype", lambda: rc.allreduce(np.array([object()]), name="obj"), rc.InvalidTypeError,
           "object arrays cannot be sent", "broadcast_object/allgather_object")
    expect("unsupported dtype", lambda: rc.allreduce(np.ones(2, np.complex64), name="cplx"), rc.InvalidTypeError,
           "'complex64' is not supported", "astype")
    expect("not an array", lambda: rc.allreduce("abc", name="str"), rc.InvalidTypeError,
           "expected a NumPy array", "np.asarray")

    # -- a duplicate in-flight name: made deterministic by holding the op open ---------
    # Ranks below N-1 submit 'dupA' and check the duplicate while rank N-1 has not submitted it
    # (it waits in 'go1'); then rank N-1 checks 'dupB' while the others wait in 'go2'.
    last = R == N - 1
    if not last:
        h_a = rc.allreduce_async(np.full(2, 1.0), op=rc.Sum, name="dupA")
        expect_dup("dupA")
        rc.allreduce(np.ones(1), name="go1")
        rc.allreduce(np.ones(1), name="go2")
        h_b = rc.allreduce_async(np.full(2, 1.0), op=rc.Sum, name="dupB")
    else:
        rc.allreduce(np.ones(1), name="go1")
        h_a = rc.allreduce_async(np.full(2, 1.0), op=rc.Sum, name="dupA")
        h_b = rc.allreduce_async(np.full(2, 1.0), op=rc.Sum, name="dupB")
        expect_dup("dupB")
        rc.allreduce(np.ones(1), name="go2")
    assert rc.synchronize(h_a).tolist() == [N, N] and rc.synchronize(h_b).tolist() == [N, N]
    works()
    print("CASE duplicate in-flight name OK", flush=True)

    # -- before init / after shutdown, and init from a bad environment ----------------------
    rc.shutdown()
    expect_uninit("after shutdown")
    for key, value, patterns in (
        ("RINGCOMM_SIZE", "0", ("world size from RINGCOMM_RANK/RINGCOMM_SIZE is 0; it must be >= 1", "-np")),
        ("RINGCOMM_RANK", str(N), (f"rank from RINGCOMM_RANK/RINGCOMM_SIZE is {N} but the world size is {N}",
                                   f"ranks must be 0..{N - 1}")),
    ):
        saved = os.environ[key]
        os.environ[key] = value
        try:
            rc.init()
        except rc.InvalidInputError as e:
            text = str(e)
            assert all(p in text for p in patterns), text
            assert not rc.is_initialized()
        else:
            raise AssertionError(f"init() accepted {key}={value}")
        finally:
            os.environ[key] = saved
        print(f"CASE init with {key}={value} OK: {text}", flush=True)
    rc.init()  # the environment is right again: the job starts anew
    works()
    rc.shutdown()
    print("CATALOGUE OK", flush=True)


def expect_dup(name: str) -> None:
    try:
        rc.allreduce_async(np.full(2, 1.0), op=rc.Sum, name=name)
    except rc.DuplicateNameError as e:
        assert f"'{name}' is already in flight on rank {R}" in str(e) and "synchronize" in str(e), str(e)
        assert isinstance(e, ValueError)
    else:
        raise AssertionError(f"duplicate in-flight name {name!r} accepted on rank {R}")


def expect_uninit(when: str) -> None:
    for call in (lambda: rc.allreduce(np.ones(1)), lambda: rc.barrier(), lambda: rc.rank()):
        try:
            call()
        except rc.NotInitializedError as e:
            assert "init() first" in str(e), str(e)
        else:
            raise AssertionError(f"a collective {when} did not raise NotInitializedError")
    print(f"CASE collective {when} OK", flush=True)


if __name__ == "__main__":
    expect_uninit("before init")
    main()
