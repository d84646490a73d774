"""Conformance job: a suite sharing one ``init()`` goes on in step after a test fails.

Horovod users run their test files the way Horovod's CI runs its own: the whole file in one
job, every test on every rank, one ``init()`` for all.  A test that fails on one rank must fail
on every rank, and the next test must start in step: the same unnamed-op numbers, no join or
process-set state left behind.  Each ``check_*`` here is one such test; :func:`suite` runs them
as pytest would (a failure is recorded, the next one runs) and checks after each that every
rank is at the same test with agreeing op numbers.

``python -m ringcomm.launch.launcher -np N python conformance_recovery.py MODE`` with MODE

- ``suite`` (run with a short RINGCOMM_STALL_CHECK_SECONDS): Adasum reducescatter refused on
  every dtype, join with each rank joining first (allgather and broadcast refused while a rank
  has joined, then unnamed ops in step), a refusal on one rank raised on every rank, a check
  that fails on one rank between collectives failing on every rank;
- ``stall`` (run with RINGCOMM_STALL_SHUTDOWN_SECONDS set): the last rank fails before a
  collective the others entered; they raise StallError naming it and the op, then all go on;
- ``optimizer_sets``: DistributedOptimizer(process_set=S) on every rank, S holding the even
  ranks only: members average their gradients, a rank outside S steps on its own ones.

Prints ``CONFORMANCE OK rank=R`` when every check passed.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import ringcomm_torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
DTYPES = (torch.int32, torch.int64, torch.float16, torch.float32, torch.float64)


def expect_raise(fn: Callable[[], object], kinds: tuple[type[BaseException], ...], what: str) -> BaseException:
    try:
        fn()
    except kinds as exc:
        return exc
    raise AssertionError(f"rank {R}: {what} did not raise {[k.__name__ for k in kinds]}")


def in_step(index: int) -> None:
    """Every rank is at test ``index`` and numbers its next unnamed ops alike (after a barrier, as
    the tear-down of Horovod's own test file does)."""
    hvd.barrier()
    got = hvd.allgather_object(index)
    assert got == [index] * N, f"rank {R}: ranks are at tests {got}, expected all at {index}"
    total = hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum)  # unnamed: must pair across ranks
    assert total.item() == N * (N - 1) / 2, f"rank {R}: unnamed allreduce after test {index} gave {total}"


def check_reducescatter_adasum_refused() -> None:
    for dtype in DTYPES:
        for dim in (1, 2, 3):
            t = torch.ones([N * 2] * dim).to(dtype)
            exc = expect_raise(lambda t=t: hvd.reducescatter(t, op=hvd.Adasum), (RuntimeError,),
                               f"reducescatter(op=Adasum) of {dtype} {dim}-d")
            assert isinstance(exc, NotImplementedError), f"rank {R}: {type(exc).__name__}: {exc}"
            assert f"rank {R}" in str(exc) and "Adasum" in str(exc), str(exc)
    got = hvd.reducescatter(torch.ones(N * 2, 3), op=hvd.Sum)
    assert torch.equal(got, torch.full((2, 3), float(N))), f"rank {R}: reducescatter after the refusals: {got}"


def check_join_each_rank_first() -> None:
    t = torch.ones(5, 4)
    for first in range(N):
        if R == first:
            last = hvd.join()
        else:
            exc = expect_raise(lambda: hvd.allgather(t), (RuntimeError,), f"allgather while rank {first} joined")
            assert f"rank(s) [{first}]" in str(exc), str(exc)
            expect_raise(lambda f=first: hvd.broadcast(t, root_rank=(f + 1) % N), (RuntimeError,),
                         f"broadcast while rank {first} joined")
            avg = hvd.allreduce(torch.full((3,), 2.0), op=hvd.Sum)  # the joined rank adds zeros
            assert torch.equal(avg, torch.full((3,), 2.0 * (N - 1))), f"rank {R}: allreduce with a joined rank: {avg}"
            last = hvd.join()
        assert last != first or N == 1, f"rank {R}: join() returned the first rank to join ({first})"
        assert hvd.allgather_object(last) == [last] * N, f"rank {R}: join() returned different ranks"
        gathered = hvd.allgather(torch.tensor([R]))  # unnamed, right after the join: in step
        assert gathered.tolist() == list(range(N)), f"rank {R}: allgather after join: {gathered.tolist()}"


def check_refusal_on_one_rank() -> None:
    bad = R == N - 1
    t = torch.full((4,), float(R))
    exc = expect_raise(lambda: hvd.broadcast(t, root_rank=N if bad else 0), (ValueError, RuntimeError),
                       "broadcast with a bad root on the last rank")
    if not bad:
        assert f"rank {N - 1}" in str(exc) and "broadcast" in str(exc), f"rank {R}: {exc}"
    got = hvd.broadcast(t, root_rank=0)  # unnamed: the refused op used up one number on every rank
    assert torch.equal(got, torch.zeros(4)), f"rank {R}: broadcast after the refusal: {got}"


def check_fails_on_some_ranks_only() -> None:
    """The last rank's check fails between two collectives (a wrong value, say); the others go on
    to the next collective and wait for it while it waits in the tear-down barrier.  Rank 0 ends
    that wait: the others' collective fails, naming the ranks and the barrier, and every rank
    reaches the barrier, in step."""
    hvd.allreduce(torch.ones(3), op=hvd.Sum)
    if R == N - 1:
        raise AssertionError("this rank's check failed")
    exc = expect_raise(lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum), (RuntimeError,),
                       "allreduce that the last rank never reached")
    assert isinstance(exc, hvd.HorovodInternalError) and "diverged" in str(exc), f"rank {R}: {exc}"
    assert f"ranks [{N - 1}] wait in barrier" in str(exc), f"rank {R}: {exc}"
    raise AssertionError("failed with the last rank, as it should")


def check_stalled_setup_fails_every_rank(marker: Path) -> None:
    """The last rank fails before broadcast_parameters; the others raise StallError naming it."""
    model = torch.nn.Linear(3, 2)
    if R == N - 1:
        try:
            raise ValueError("setup failed on this rank only")
        except ValueError:
            pass
        deadline = time.monotonic() + 60
        while len(list(marker.glob("raised-*"))) < N - 1:  # the others have given up waiting
            assert time.monotonic() < deadline, f"rank {R}: the other ranks never raised"
            time.sleep(0.05)
        return
    started = time.monotonic()
    exc = expect_raise(lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0), (RuntimeError,),
                       "broadcast_parameters that the last rank never entered")
    waited = time.monotonic() - started
    assert isinstance(exc, hvd.HorovodInternalError), f"rank {R}: {type(exc).__name__}: {exc}"
    assert f"[{N - 1}]" in str(exc) and "broadcast" in str(exc), f"rank {R}: {exc}"
    assert waited < 60, f"rank {R}: the stalled op ended after {waited:.0f} s"
    (marker / f"raised-{R}").touch()


def suite(checks: list[Callable[[], None]], expected_failures: set[str]) -> None:
    failed = set()
    for i, check in enumerate(checks):
        try:
            check()
        except Exception:
            failed.add(check.__name__)
            traceback.print_exc()
        in_step(i)
    assert failed == expected_failures, f"rank {R}: failed {sorted(failed)}, expected {sorted(expected_failures)}"


def check_optimizer_process_set() -> None:
    even = hvd.add_process_set(list(range(0, N, 2)))
    torch.manual_seed(1234)
    model = torch.nn.Linear(6, 3)
    reference = torch.nn.Linear(6, 3)
    reference.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters(),
                                   process_set=even)
    torch.manual_seed(R)  # every rank its own data
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    local = [p.grad.clone() for p in reference.parameters()]
    if even.included():
        grads = [hvd.allreduce(g, op=hvd.Average, process_set=even) for g in local]
    else:
        grads = local  # outside the set: no exchange, its own gradients
    for p, g, q in zip(model.parameters(), grads, reference.parameters()):
        assert torch.allclose(p.detach(), q.detach() - 0.5 * g, atol=1e-6), \
            f"rank {R} ({'in' if even.included() else 'outside'} set {list(range(0, N, 2))}): weights differ"
    hvd.remove_process_set(even)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "suite":
        suite([check_reducescatter_adasum_refused, check_join_each_rank_first, check_refusal_on_one_rank,
               check_fails_on_some_ranks_only, check_refusal_on_one_rank], {"check_fails_on_some_ranks_only"})
    elif mode == "stall":
        marker = Path(os.environ["RECOVERY_MARKER_DIR"])
        suite([lambda: check_stalled_setup_fails_every_rank(marker)], set())
    elif mode == "optimizer_sets":
        suite([check_optimizer_process_set], set())
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    hvd.shutdown()
    print(f"CONFORMANCE OK rank={R}", flush=True)
