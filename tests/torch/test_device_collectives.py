"""The per-tensor collectives' device path (``hvd.allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter``; sync, async and grouped), run on CPU through the fake device.

Under ``device.override(FakeOps())`` every tensor is a device tensor of one
:class:`~ringcomm_torch.device.DeviceService`: staged into a pinned buffer of its pool by one
copy on its side stream after an event of the current stream, handed to the core by the stager
once the copy's event fired, and copied home on the side stream with the current stream waiting
for it.  The fake records each call with its thread and, while held, keeps events not ready and
the copies' destinations NaN.  Runs alone or under the launcher (test_torch_jobs.py, np 2).
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

import ringcomm as rc  # noqa: E402
import ringcomm_torch as hvd  # noqa: E402
from ringcomm_torch import device  # noqa: E402
from ringcomm_torch.device_threads import RETURN_THREAD, RETURN_THREADS, STAGER_THREAD, returns  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


def mine(n: int = 6, dtype=torch.float32) -> torch.Tensor:
    """This rank's values: ``arange(n) + rank``."""
    return (torch.arange(n, dtype=torch.float32) + hvd.rank()).to(dtype)


def summed(n: int = 6) -> torch.Tensor:
    """Every rank's :func:`mine`, summed."""
    size = hvd.size()
    return torch.arange(n, dtype=torch.float32) * size + size * (size - 1) / 2


def only_queued_here(ops: device.FakeOps, mark: int) -> list[str]:
    """The calls this thread made since ``mark``."""
    me = threading.current_thread().name
    return [c for c, t in ops.calls[mark:] if t == me]


def test_every_collective_on_the_device_gives_the_host_results_and_a_blocking_one_waits_for_its_copy_itself():
    ops = device.FakeOps()
    size, r = hvd.size(), hvd.rank()
    with device.override(ops):
        mark, staged = len(ops.calls), ops.count("wait_event", STAGER_THREAD)
        assert torch.equal(hvd.allreduce(mine(), op=hvd.Sum), summed())
        assert torch.allclose(hvd.allreduce(mine()), summed() / size)
        assert torch.allclose(hvd.allreduce(mine(), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
                              summed() * 1.5)
        t = mine()
        assert hvd.allreduce_(t, op=hvd.Sum) is t and torch.equal(t, summed())
        assert torch.equal(hvd.allgather(mine(2).view(1, 2)),
                           torch.stack([torch.arange(2.0) + k for k in range(size)]))
        assert torch.equal(hvd.broadcast(mine(), root_rank=size - 1), torch.arange(6.0) + size - 1)
        b = mine()
        assert hvd.broadcast_(b, root_rank=0) is b and torch.equal(b, torch.arange(6.0))
        rows = torch.full((size, 2), float(r))  # row j goes to rank j
        assert torch.equal(hvd.alltoall(rows), torch.arange(float(size)).repeat_interleave(2).view(size, 2))
        whole = mine(2 * size).view(size, 2)
        assert torch.equal(hvd.reducescatter(whole, op=hvd.Sum), summed(2 * size).view(size, 2)[r:r + 1])
        g = hvd.grouped_allreduce([mine(), mine(3, torch.float64)], op=hvd.Sum)
        assert torch.equal(g[0], summed()) and g[1].dtype is torch.float64 and torch.equal(g[1].float(), summed(3))
        bf = hvd.allreduce(mine(4, torch.bfloat16), op=hvd.Sum)  # reduced in float32 on the wire
        assert bf.dtype is torch.bfloat16 and torch.equal(bf, summed(4).to(torch.bfloat16))
        ints = hvd.allgather(torch.tensor([[r, -r]], dtype=torch.int64))
        assert ints.dtype is torch.int64 and ints[:, 0].tolist() == list(range(size))
    calls = only_queued_here(ops, mark)
    receiving = (r != size - 1) + (r != 0)  # the broadcasts this rank only receives: nothing goes to the host
    kept = r == 0  # broadcast_'s root keeps its tensor: nothing comes home
    assert calls.count("copy") >= 2 * 13 - receiving - kept
    # a blocking call waits for its copy to the host on its own thread, as it waits for the op:
    # no other thread stands between it and its op; it queues nothing on the current stream
    # meanwhile, so both copies run there, in its order: no side stream to switch to or to order
    assert calls.count("wait_event") >= 13 - receiving
    assert ops.count("wait_event", STAGER_THREAD) == staged
    assert "stream_wait" not in calls and "on" not in calls


def test_an_async_call_only_queues_device_work_and_the_stager_waits_for_its_copy():
    ops = device.FakeOps()
    size, r = hvd.size(), hvd.rank()
    with device.override(ops):
        mark, staged = len(ops.calls), ops.count("wait_event", STAGER_THREAD)
        handles = [hvd.allreduce_async(mine(), op=hvd.Sum), hvd.allreduce_async_(mine(), op=hvd.Sum),
                   hvd.allgather_async(mine(2).view(1, 2)), hvd.broadcast_async(mine(), root_rank=0),
                   hvd.alltoall_async(torch.full((size, 2), float(r))),
                   hvd.reducescatter_async(mine(2 * size).view(size, 2), op=hvd.Sum),
                   hvd.grouped_allreduce_async([mine(), mine(3, torch.float64)], op=hvd.Sum)]
        queued = only_queued_here(ops, mark)
        assert "wait_event" not in queued  # the calls only queued device work
        assert queued.count("stream_wait") >= 7 - (r != 0)  # on the side stream, after the current one's
        results = [hvd.synchronize(h) for h in handles]
    assert "wait_event" not in only_queued_here(ops, mark)  # nor did synchronize wait for a copy
    assert ops.count("wait_event", STAGER_THREAD) - staged >= 7 - (r != 0)  # the stager did
    assert torch.equal(results[0], summed()) and torch.equal(results[1], summed())
    assert torch.equal(results[3], torch.arange(6.0))


def test_a_blocking_call_queues_behind_an_async_op_still_waiting_for_its_copy():
    """Ops start in the order they were called: a blocking call made while an async op waits
    for its copy goes to the stager behind it, and starts after it, on every rank."""
    ops = device.FakeOps()
    submitted: list[float] = []
    real = rc.allreduce_async

    def spy(arr, *args, **kwargs):
        submitted.append(float(arr.reshape(-1)[0]))
        return real(arr, *args, **kwargs)

    with device.override(ops):
        ops.hold()
        rc.allreduce_async = spy
        try:
            first = hvd.allreduce_async(torch.full((3,), 1.0), op=hvd.Sum, name="order.first")
            out: list = []
            caller = threading.Thread(target=lambda: out.append(
                hvd.allreduce(torch.full((3,), 2.0), op=hvd.Sum, name="order.second")))
            caller.start()
            time.sleep(0.2)
            assert not submitted and caller.is_alive()  # both wait for the first one's copy
            ops.fire()
            caller.join(20)
            assert not caller.is_alive()
            got = hvd.synchronize(first)
        finally:
            rc.allreduce_async = real
    assert submitted == [1.0, 2.0], submitted
    assert torch.equal(got, torch.full((3,), float(hvd.size()))) and torch.equal(out[0], 2 * got)
    assert ops.count("wait_event", caller.name) == 0  # its op went through the stager's queue


def test_a_broadcast_copies_the_tensor_to_the_host_on_its_root_only_and_the_others_start_at_once():
    ops = device.FakeOps()
    size, r = hvd.size(), hvd.rank()
    with device.override(ops):
        for root in range(size):
            t = mine()
            ops.hold()  # the root's copy to the host stays queued until every rank has called
            mark, waits = len(ops.calls), ops.count("wait_event")
            h = hvd.broadcast_async_(t, root_rank=root, name=f"root.{root}")
            queued = only_queued_here(ops, mark)
            assert queued.count("copy") == (r == root), queued  # the others' values are never read
            hvd.barrier()  # every rank has called: now the root's copy may land
            ops.fire()
            assert hvd.synchronize(h) is t and torch.equal(t, torch.arange(6.0) + root)
            assert ops.count("wait_event") - waits == (r == root)  # only the root's op waited for the device
            assert only_queued_here(ops, mark).count("copy") == 1  # the root's to the host, the others' home
            ops.fire()
        for root in range(size):  # out of place
            out = hvd.broadcast(mine(), root_rank=root, name=f"new.{root}")
            assert torch.equal(out, torch.arange(6.0) + root)


def test_an_async_op_returns_before_its_copy_is_done_and_its_result_stays_poison_until_the_way_home_fires():
    ops = device.FakeOps()
    submitted: list = []
    real = rc.allreduce_async

    def spy(arr, *args, **kwargs):
        submitted.append(arr.copy())
        return real(arr, *args, **kwargs)

    with device.override(ops):
        t = mine()
        ops.hold()
        rc.allreduce_async = spy
        try:
            started = time.monotonic()
            h = hvd.allreduce_async_(t, op=hvd.Sum, name="held")
            assert time.monotonic() - started < 5 and not submitted  # the stager waits for the copy
            assert not hvd.poll(h)
            ops.fire()  # the copy to the host lands: the stager hands it to the core
            deadline = time.monotonic() + 10
            while not submitted and time.monotonic() < deadline:
                time.sleep(0.01)
            assert submitted and torch.equal(torch.from_numpy(submitted[0]), mine())  # no poison reached it
            ops.hold()  # the way home is held
            mark = len(ops.calls)
            assert hvd.synchronize(h) is t
            # queued home on the current stream itself, in its order, and one event after it: the
            # buffer goes back to the pool once it has happened
            assert only_queued_here(ops, mark) == ["copy", "record"]
            assert torch.isnan(t).all()  # the current stream has not run the copy home yet
            ops.fire()
        finally:
            rc.allreduce_async = real
    assert torch.equal(t, summed())


def test_staging_switches_the_current_stream_only_for_a_tensor_it_must_convert_first():
    """A contiguous tensor of a wire dtype is copied to the host as it is: no device work before
    the copy, so no switch to the side stream around it (the copy names its stream itself); a
    bfloat16 tensor is widened there first, and a non-contiguous one gathered."""
    ops = device.FakeOps()
    with device.override(ops):
        same = torch.arange(8.0)  # on every rank
        for t, switches in ((same.clone(), 0), (same.to(torch.bfloat16), 1), (same.view(2, 4).t(), 1)):
            mark = len(ops.calls)
            h = hvd.allreduce_async(t, op=hvd.Sum)
            assert only_queued_here(ops, mark).count("on") == switches, (t.dtype, t.is_contiguous())
            assert torch.equal(hvd.synchronize(h).float(), t.float() * hvd.size())


def test_grouped_async_ops_of_several_dtypes_copy_each_tensor_once_each_way():
    ops = device.FakeOps()
    size = hvd.size()
    tensors = [mine(5), mine(3, torch.float64), mine(4, torch.bfloat16), mine(2)]
    with device.override(ops):
        copies = ops.count("copy")
        h = hvd.grouped_allreduce_async_(tensors, op=hvd.Sum, name="mixed")
        assert ops.count("copy") - copies == len(tensors)  # one copy to the host per tensor
        out = hvd.synchronize(h)
        assert ops.count("copy") - copies == 2 * len(tensors)  # and one home
        assert all(o is t for o, t in zip(out, tensors))
        for t, n in zip(tensors, (5, 3, 4, 2)):
            assert torch.equal(t.float(), summed(n).to(t.dtype).float())
        gathered = hvd.synchronize(hvd.grouped_allgather_async([mine(2).view(1, 2), mine(1).view(1, 1)]))
        assert [tuple(g.shape) for g in gathered] == [(size, 2), (size, 1)]
        parts = hvd.synchronize(hvd.grouped_reducescatter_async([mine(size).view(size, 1)], op=hvd.Sum))
        assert torch.equal(parts[0].view(-1), summed(size)[hvd.rank():hvd.rank() + 1])


def test_the_pool_reuses_its_pinned_buffers_once_their_copies_home_are_done():
    ops = device.FakeOps()
    with device.override(ops):
        svc = device.service_for(mine())
        assert svc is not None and svc.pool.allocations == 0
        for _ in range(3):  # warm: one buffer per size class in flight at once
            hvd.allreduce(mine(1000))
            hvd.allgather(mine(1000).view(1, -1))
        warm = svc.pool.allocations
        for _ in range(10):
            hvd.allreduce(mine(1000))
            hvd.allgather(mine(1000).view(1, -1))
        assert svc.pool.allocations == warm and ops.pinned_allocations == warm
        ops.hold()  # a buffer whose last copy has not happened is not handed out again
        buf = svc.pool.acquire(4000)
        svc.release(buf)
        again = svc.pool.acquire(4000)
        assert again is not buf
        ops.fire()
        svc.pool.release(again)
        assert {id(svc.pool.acquire(4000)), id(svc.pool.acquire(4000))} == {id(buf), id(again)}


def test_one_service_per_device_and_the_optimizer_shares_it_with_the_collectives():
    ops = device.FakeOps()
    with device.override(ops):
        a, b = device.service_for(torch.zeros(1)), device.service_for(torch.ones(2, dtype=torch.float64))
        model = torch.nn.Linear(4, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    assert a is b and a is not None and a.ops is ops
    assert all(bucket.service is a for bucket in opt.reducer.device_buckets.values())
    assert device.service_for(torch.zeros(1)) is None  # outside the override: a host tensor


def test_the_return_threads_are_bounded_whatever_the_number_of_ops_in_flight():
    # a pool of another test in this process may have left threads of the same name
    before = {t.ident for t in threading.enumerate() if t.name == RETURN_THREAD}
    started_before = returns.threads
    ops = device.FakeOps()
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(24)])
    with device.override(ops):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), groups=24)
    assert len(opt.reducer.device_buckets) == 24
    ops.hold()  # every bucket's op in flight at once, its copy held
    model(torch.ones(2, 8)).sum().backward()
    ops.fire()
    opt.step()
    new = {t.ident for t in threading.enumerate() if t.name == RETURN_THREAD} - before
    assert len(new) == returns.threads - started_before  # every return thread started is the pool's
    assert 1 <= returns.threads <= RETURN_THREADS



class _Op:
    """A core handle stand-in: done once ``gate`` is set; ``waiting`` is set when a thread waits on it."""

    def __init__(self, gate: threading.Event, value: int) -> None:
        self.gate, self.value, self.waiting = gate, value, threading.Event()

    def done(self) -> bool:
        return self.gate.is_set()

    def wait(self) -> int:
        self.waiting.set()
        self.gate.wait()
        return self.value


def test_a_return_thread_takes_a_finished_op_before_an_older_one_still_in_flight():
    from ringcomm_torch.device_threads import ReturnPool

    pool = ReturnPool(limit=1)
    blocker, late, early = (_Op(threading.Event(), v) for v in (0, 1, 2))
    order: list[int] = []
    first = pool.submit(blocker, order.append, "blocker")
    assert blocker.waiting.wait(10)  # the pool's one thread waits on it
    a = pool.submit(late, order.append, "late")  # queued first
    b = pool.submit(early, order.append, "early")  # queued second, and done
    early.gate.set()
    blocker.gate.set()  # the thread comes free: it takes "early", done, before "late"
    first.wait()
    b.wait()
    assert order == [0, 2] and not a.done() and pool.threads == 1
    late.gate.set()
    a.wait()
    assert order == [0, 2, 1]


@pytest.mark.parametrize("kind", ["allreduce", "allgather", "broadcast"])
def test_a_second_op_of_a_name_in_flight_raises_at_its_call_while_the_first_waits_for_its_copy(kind):
    """A device op hands its data to the core only once its copy is done, yet a second op of the
    same name raises DuplicateNameError (a ValueError, as Horovod's) at its call, before any copy,
    and the name is free again once the first is done, on every rank alike."""
    from ringcomm.errors import DuplicateNameError

    start = {"allreduce": lambda t, nm: hvd.allreduce_async(t, op=hvd.Sum, name=nm),
             "allgather": lambda t, nm: hvd.allgather_async(t, name=nm),
             "broadcast": lambda t, nm: hvd.broadcast_async(t, 0, name=nm)}[kind]
    ops = device.FakeOps()
    name = f"dup.{kind}"
    with device.override(ops):
        ops.hold()  # the first op's copy to the host stays pending: the core has not seen it
        first = start(mine(), name)
        with pytest.raises(DuplicateNameError, match="already in flight") as err:
            start(mine(), name)
        assert isinstance(err.value, ValueError)
        ops.fire()
        hvd.synchronize(first)
        again = hvd.synchronize(start(mine(), name))  # the name is free again
    want = {"allreduce": summed(), "allgather": torch.cat([mine() - hvd.rank() + r for r in range(hvd.size())]),
            "broadcast": mine() - hvd.rank()}[kind]
    assert torch.equal(again, want), (again, want)


def test_a_host_op_of_the_name_a_device_op_waits_under_raises_and_the_device_op_completes():
    """The device op that waits for its copy holds its name: a host op of that name is a second op
    in flight (DuplicateNameError at its call), not the first one arriving, and the device op
    completes with its own data."""
    import numpy as np

    from ringcomm.errors import DuplicateNameError
    from ringcomm_torch.collectives import core_name

    ops = device.FakeOps()
    with device.override(ops):
        ops.hold()
        first = hvd.allreduce_async(mine(), op=hvd.Sum, name="dup.mixed")
        with pytest.raises(DuplicateNameError, match="already in flight"):
            rc.allreduce_async(np.ones(3, np.float32), name=core_name("allreduce", "dup.mixed"))
        ops.fire()
        got = hvd.synchronize(first)
    assert torch.equal(got, summed()), (got, summed())
