"""One rank passes bad arguments to a collective; every rank's call fails with that reason, then the job goes on.

Usage: ringcomm-run -np N python refused_call_worker.py   (N >= 2; rank 1 is the one in the wrong)

For each case the other ranks must raise MismatchError naming rank 1 and the problem within
10 s, rank 1 its own error, and the next collective must give the right result everywhere.
Prints ``CASE <label> OK`` per case on every rank and ``REFUSALS OK`` at the end.
"""

from __future__ import annotations

import threading
import time

import numpy as np

import ringcomm as rc

rc.init(process_sets="dynamic")
R, N = rc.rank(), rc.size()
BAD = 1
counter = 0


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def after() -> None:
    global counter
    counter += 1
    got = rc.allreduce(np.full(3, R + 1.0), op=rc.Sum, name=f"after.{counter}")
    assert got.tolist() == [N * (N + 1) / 2] * 3, got


def case(label: str, good, bad, pattern: str) -> None:
    start = time.monotonic()
    try:
        (bad if R == BAD else good)()
    except (rc.MismatchError, rc.InvalidInputError, rc.InvalidTypeError) as exc:
        took = time.monotonic() - start
        text = str(exc)
        assert took < 10, (label, took)
        assert pattern in text, (label, text)
        assert f"rank {BAD}" in text, (label, text)  # the refusing rank's own error names it too
        if R != BAD:
            assert isinstance(exc, rc.MismatchError) and f"rank {BAD}" in text, (label, text)
    else:
        raise AssertionError(f"{label}: rank {R}'s call did not fail")
    after()
    print(f"CASE {label} OK", flush=True)


x = np.arange(12.0).reshape(3, 4)
case("non-contiguous", lambda: rc.allreduce(x, name="nc"), lambda: rc.allreduce(x.T, name="nc"),
     "not C-contiguous")
case("unnamed non-contiguous", lambda: rc.allreduce(x), lambda: rc.allreduce(x.T), "not C-contiguous")
case("root out of range", lambda: rc.broadcast(np.ones(2), 0, name="root"),
     lambda: rc.broadcast(np.ones(2), N + 3, name="root"), "root_rank")
case("alltoall splits", lambda: rc.alltoall(np.ones(N), splits=[1] * N, name="a2a"),
     lambda: rc.alltoall(np.ones(N), splits=[N] + [0] * (N - 2), name="a2a"), "splits")
case("unpicklable broadcast_object", lambda: rc.broadcast_object(None, root_rank=BAD, name="obj"),
     lambda: rc.broadcast_object(Unpicklable(), root_rank=BAD, name="obj"), "pickle")
case("unpicklable allgather_object", lambda: rc.allgather_object(R, name="objs"),
     lambda: rc.allgather_object(Unpicklable(), name="objs"), "pickle")
case("object dtype", lambda: rc.allgather(np.ones(2), name="od"),
     lambda: rc.allgather(np.array([object()] * 2), name="od"), "object arrays")
FIRST = list(range(N - 1))  # a set of all ranks but the last (all ranks would be the global set)
case("add_process_set ranks", lambda: rc.add_process_set(FIRST), lambda: rc.add_process_set([0, N + 5]),
     "do not form a process set")
# the refused registration left no set behind anywhere: the same ranks register now, with one id everywhere
pair = rc.add_process_set(FIRST)
ids = rc.allgather_object(pair.process_set_id, name="pair.ids")
assert len(set(ids)) == 1 and rc.process_set_ids() == [0, ids[0]], (ids, rc.process_set_ids())
# a barrier on a set: a rank outside it is refused at once; its members meet without it
if pair.included():
    rc.barrier(process_set=pair)
else:
    try:
        rc.barrier(process_set=pair)
    except rc.InvalidInputError as exc:
        assert "is not in process set" in str(exc), exc
    else:
        raise AssertionError("a barrier on a set without this rank did not fail")
after()
print("CASE subset barrier OK", flush=True)
assert threading.active_count() >= 1
rc.shutdown()
print("REFUSALS OK", flush=True)
