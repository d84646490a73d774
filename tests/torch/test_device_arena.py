"""Per-tensor CUDA allreduces reduced on the device among one host's ranks (CUDA IPC, through each
rank's shared arena), run on CPU through the fake device's model of IPC: the arena is a
shared-memory CPU tensor the peer processes map, events are counters in shared memory that stay
not happened while the recording rank's fake is held, and a stream's wait for a peer's event
blocks where it is queued.

Runs alone (one rank: no arena, the pinned path) or under the launcher at np 2 and 3 with
``RINGCOMM_DEVICE_IPC=1`` and a 1 MiB arena, at np 2 with the setting off, and at np 4 as two
hosts of two ranks each, interleaved (``ARENA_TEST_HOSTS=2``: each rank names its host before
``init``), where only each rank's shard of its host's sum goes through host memory
(test_torch_jobs.py).
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import ringcomm_torch as hvd  # noqa: E402
from conftest import TEST_HOSTS, hosts_of_job, name_test_host, settle_arena, timeline_phases  # noqa: E402
from ringcomm import api as core_api  # noqa: E402
from ringcomm.errors import HorovodInternalError, MismatchError  # noqa: E402
from ringcomm_torch import device, device_arena, device_arena_ops, device_ipc  # noqa: E402
from ringcomm_torch.device_threads import RETURN_THREAD  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _init():
    name_test_host()
    hvd.init()
    yield


def on_device() -> bool:
    """Whether the job's CUDA allreduces take the arena (alike on every rank): some host has two ranks."""
    return core_api.current_settings().device_ipc and hvd.size() > 1 and hosts_of_job(hvd.size()) < hvd.size()


def spans_hosts() -> bool:
    return hosts_of_job(hvd.size()) > 1


class HostBytes:
    """What one op moved through host memory on this rank: on one host nothing (no pinned buffer
    taken, nothing staged); across hosts only this rank's shard of the tensor, in the dtype it crosses
    hosts in (float16 itself, bfloat16 as float32)."""

    def __init__(self, ops, arena: device_arena.Arena | None) -> None:
        self.ops, self.arena = ops, arena
        self.pinned = ops.pinned_allocations
        self.staged = 0 if arena is None else arena.staged_bytes

    def only_the_shard(self, numel: int, dtype) -> bool:
        assert self.arena is not None
        staged = self.arena.staged_bytes - self.staged
        if not spans_hosts():
            return staged == 0 and self.ops.pinned_allocations == self.pinned
        local = self.arena.local
        lo, hi = device_ipc.shard_bounds(numel, local.index(hvd.rank()), len(local))
        return staged == (hi - lo) * torch.empty((), dtype=device_ipc.stage_dtype(dtype)).element_size()


def settled(t: torch.Tensor) -> device_arena.Arena | None:
    """This rank's arena once every rank's has settled (shared or given up), or None (no arena)."""
    arena = device_arena.arena_for(t, hvd.Sum, hvd.global_process_set)
    if arena is None:
        return None
    settle_arena(arena)
    return arena


def mine(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + hvd.rank())
    return torch.randn(n, generator=g).to(dtype)


def alike_on_every_rank(t: torch.Tensor) -> bool:
    with device.override(None):  # on the host: staged through nothing
        rows = hvd.allgather(t.detach().reshape(1, -1).float())
    return all(torch.equal(rows[0], row) for row in rows)


def test_the_arena_is_shared_once_and_taken_only_where_every_rank_has_room(ops):
    arena = settled(mine(4))
    if not on_device():
        assert arena is None
        return
    assert arena.state == "ready", arena.reason
    assert arena.slots.capacity == core_api.current_settings().device_ipc_arena_bytes
    assert arena.local == tuple(r for r in range(hvd.size()) if r % TEST_HOSTS == hvd.rank() % TEST_HOSTS)
    assert ("spans 2 hosts" in arena.reason) == spans_hosts(), arena.reason
    assert device_arena.arena_for(mine(4), hvd.Min, hvd.global_process_set) is None  # only Sum and Average
    assert device_arena.arena_for(torch.ones(4, dtype=torch.int32), hvd.Sum, hvd.global_process_set) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_results_are_bitwise_alike_on_every_rank_and_the_pinned_paths_within_rounding(ops, dtype):
    arena = settled(mine(4))
    x = mine(1000, dtype, seed=1)
    cases = [dict(op=hvd.Sum), dict(op=hvd.Average), dict(op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
             dict(op=hvd.Average, prescale_factor=2.0)]
    for kw in cases:
        moved = HostBytes(ops, arena)
        got = hvd.allreduce(x, **kw)
        if on_device():
            assert moved.only_the_shard(x.numel(), dtype), kw
        with device.override(None):  # the host path, for reference
            want = hvd.allreduce(x.float(), **kw).to(dtype)
        assert alike_on_every_rank(got), kw
        tol = dict(rtol=1e-2, atol=1e-2) if dtype in (torch.float16, torch.bfloat16) else dict(rtol=1e-5, atol=1e-6)
        assert torch.allclose(got.float(), want.float(), **tol), (kw, (got.float() - want.float()).abs().max())
        assert got.dtype is dtype and got.shape == x.shape


def test_in_place_async_and_non_contiguous_tensors(ops):
    settled(mine(4))
    size = hvd.size()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + hvd.rank()
    strided = base.t()  # not contiguous
    h = hvd.allreduce_async_(strided, op=hvd.Sum, name="arena.strided")
    x = mine(37, seed=2)
    out = hvd.synchronize(hvd.allreduce_async(x, op=hvd.Average, name="arena.out"))
    assert hvd.synchronize(h) is strided
    want = (torch.arange(24, dtype=torch.float32).reshape(4, 6) * size + size * (size - 1) / 2).t()
    assert torch.equal(strided, want)
    assert torch.equal(base.t(), want)  # written through the view into its base
    assert alike_on_every_rank(out)
    assert torch.allclose(out, hvd.allreduce(x.clone(), op=hvd.Average, name="arena.ref"), rtol=1e-5, atol=1e-6)


def test_a_tensor_larger_than_what_is_free_goes_through_pinned_memory_on_every_rank(ops):
    arena = settled(mine(4))
    if not on_device():
        pytest.skip("no arena here")
    cap = arena.slots.capacity
    pinned_before = ops.pinned_allocations
    big = mine(cap // 4 + 8, seed=3)  # one float32 more than fits
    assert torch.allclose(hvd.allreduce(big, op=hvd.Sum), hvd.allreduce(big.clone(), op=hvd.Sum, name="r"),
                          rtol=1e-5, atol=1e-6)
    assert ops.pinned_allocations > pinned_before
    # two in flight that fit one at a time: the second finds no room on any rank and takes the pinned path
    half = mine(cap // 4 // 2 + 64, seed=4)
    h1 = hvd.allreduce_async(half, op=hvd.Sum, name="arena.first")
    h2 = hvd.allreduce_async(half, op=hvd.Sum, name="arena.second")
    a, b = hvd.synchronize(h1), hvd.synchronize(h2)
    assert alike_on_every_rank(a) and alike_on_every_rank(b)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # the arena's and the engine's sums, in their orders
    assert arena.slots.free_bytes == cap  # every range is free again


def test_no_wait_for_a_peer_on_the_callers_thread_even_while_a_peers_device_is_held(ops, foreign_waits):
    if not on_device():
        pytest.skip("no arena here")
    settled(mine(4))
    waits = foreign_waits
    held = hvd.rank() == hvd.size() - 1
    x = mine(300, seed=5)
    if held:
        ops.hold()  # its posted event and its copies wait for fire()
    started = time.monotonic()
    h = hvd.allreduce_async(x, op=hvd.Sum, name="arena.held")
    took = time.monotonic() - started
    me = threading.current_thread().name
    assert me not in waits, waits
    assert took < 5.0, took
    if held:
        time.sleep(0.5)  # the other ranks' return threads wait for this rank's posted event meanwhile
        ops.fire()
    out = hvd.synchronize(h)
    assert not torch.isnan(out).any()
    assert alike_on_every_rank(out)
    assert torch.allclose(out, hvd.allreduce(x.clone(), op=hvd.Sum, name="arena.held.ref"), rtol=1e-5, atol=1e-6)
    assert RETURN_THREAD in waits


def test_a_peers_result_is_read_only_after_every_rank_wrote_its_shard_into_it(ops):
    """The last rank holds its device after posting: its shards reach the others' ranges only at
    fire(), poison until then, and nobody copies its result out before."""
    if not on_device():
        pytest.skip("no arena here")
    settled(mine(4))
    held = hvd.rank() == hvd.size() - 1
    x = mine(300, seed=9)
    if not held:
        time.sleep(0.3)  # the held rank posts, then holds, before anyone can agree
    h = hvd.allreduce_async(x, op=hvd.Sum, name="arena.done-held")
    if held:
        ops.hold()
        time.sleep(0.8)  # its return thread queues its shard's copies (deferred, poison) meanwhile
        ops.fire()
    out = hvd.synchronize(h)
    assert not torch.isnan(out).any()
    assert alike_on_every_rank(out)
    assert torch.allclose(out, hvd.allreduce(x.clone(), op=hvd.Sum, name="arena.done-held.ref"), rtol=1e-5,
                          atol=1e-6)


def test_a_rank_that_submits_another_kind_under_the_name_fails_the_op_on_every_rank(ops):
    if not on_device():
        pytest.skip("no arena here")
    settled(mine(4))
    odd = hvd.rank() == 0
    t = torch.ones(8, dtype=torch.int32) if odd else torch.ones(8)  # int32 takes the pinned path
    with pytest.raises(MismatchError):
        hvd.allreduce(t, op=hvd.Sum, name="arena.mixed")
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="arena.after"), torch.full((3,), float(hvd.size())))


@pytest.mark.parametrize("case", ["shape", "dtype"])
def test_ranks_whose_tensors_differ_in_shape_or_dtype_fail_the_op_on_every_rank(ops, case):
    """The same bytes in another shape (17x1311 against 17x23x57) or dtype (float32 against
    float16 of twice the elements) fail the op through the arena as on the pinned path: a
    MismatchError on every rank naming each rank's tensor; the next op works."""
    if not on_device():
        pytest.skip("no arena here")
    settled(mine(4))
    last = hvd.rank() == hvd.size() - 1
    if case == "shape":
        t = torch.ones(17, 23, 57) if last else torch.ones(17, 23 * 57)
    else:
        t = torch.ones(2000, dtype=torch.float16) if last else torch.ones(1000)
    with pytest.raises(MismatchError, match="ranks disagree on the tensor") as err:
        hvd.allreduce(t, op=hvd.Sum, name=f"arena.differ.{case}")
    assert f"rank {hvd.size() - 1}: " + ("float32 [17, 23, 57]" if case == "shape" else "float16 [2000]") \
        in str(err.value), err.value
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"arena.differ.{case}.after"),
                       torch.full((3,), float(hvd.size())))


def test_a_rank_that_cannot_sum_its_shard_fails_the_op_on_every_rank_and_the_next_op_works(ops, monkeypatch):
    """Rank 1's sum raises (on one host: the shard's sum; across hosts: the host's partial sum): every
    rank raises, naming rank 1, and every range is free for the next op, which succeeds everywhere."""
    arena = settled(mine(4))
    if not on_device():
        pytest.skip("no arena here")
    if hvd.rank() == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("the device refused the sum")
        monkeypatch.setattr(device_ipc if spans_hosts() else device_arena_ops,
                            "partial_sum" if spans_hosts() else "sum_shard", broken)
    with pytest.raises(HorovodInternalError, match=r"rank\(s\) \[1\] could not reduce their shard"):
        hvd.allreduce(mine(100, seed=11), op=hvd.Sum, name="arena.broken")
    monkeypatch.undo()
    assert arena.slots.free_bytes == arena.slots.capacity
    x = mine(100, seed=12)
    out = hvd.allreduce(x, op=hvd.Sum, name="arena.after-broken")
    assert alike_on_every_rank(out)
    assert torch.allclose(out, hvd.allreduce(x.clone(), op=hvd.Sum, name="arena.after-broken.ref"), rtol=1e-5,
                          atol=1e-6)


def test_an_allreduce_while_a_rank_has_joined_adds_zeros_for_it_and_the_sharing_waits_for_it(ops):
    """A rank that has joined offers no range (the op takes the pinned path, where it adds zeros), and
    an arena first shared meanwhile is shared again once every rank takes part."""
    settled(mine(4))
    size = hvd.size()
    fresh = device.FakeOps(ipc=True)  # a second device: its arena is not shared yet
    x = torch.full((50,), float(hvd.rank()))
    if hvd.rank() == 0:
        hvd.join()
    else:
        out = hvd.allreduce(x, op=hvd.Sum, name="arena.joined")
        assert torch.equal(out, torch.full((50,), float(sum(range(1, size)))))
        with device.override(fresh):
            out = hvd.allreduce(x, op=hvd.Sum, name="arena.joined.fresh")  # starts the sharing: rank 0 is away
        assert torch.equal(out, torch.full((50,), float(sum(range(1, size)))))
        hvd.join()
    with device.override(fresh):
        arena = settled(x)
        if on_device():
            assert arena is not None and arena.state == "ready", arena and arena.reason
        out = hvd.allreduce(x, op=hvd.Sum, name="arena.after-join")
    assert torch.equal(out, torch.full((50,), float(sum(range(size)))))
    assert alike_on_every_rank(out)


def test_sync_batch_norm_on_the_device_matches_the_pinned_path(ops):
    settled(mine(4))
    torch.manual_seed(0)
    bn = hvd.SyncBatchNorm(5)
    ref = hvd.SyncBatchNorm(5)
    ref.load_state_dict(bn.state_dict())
    x = mine(4 * 5 * 3, seed=6).reshape(4, 5, 3).requires_grad_()
    y = bn(x)
    y.square().sum().backward()
    with device.override(None):
        xr = x.detach().clone().requires_grad_()
        yr = ref(xr)
        yr.square().sum().backward()
    assert torch.allclose(y, yr, rtol=1e-4, atol=1e-5)
    assert torch.allclose(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(bn.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)


def test_the_ringcomm_backend_reduces_a_device_tensor_through_the_arena(ops):
    import ringcomm_torch.distributed  # noqa: F401  (registers the backend)

    arena = settled(mine(4))
    if not dist.is_initialized():
        # the job is running already: the group adopts it (the store is only for torch's own use)
        dist.init_process_group("ringcomm", store=dist.HashStore(), rank=hvd.rank(), world_size=hvd.size())
    t = mine(500, seed=7)
    want = hvd.allreduce(t.clone(), op=hvd.Sum, name="arena.backend.ref")
    moved = HostBytes(ops, arena)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    if on_device():
        assert moved.only_the_shard(t.numel(), t.dtype)
    assert alike_on_every_rank(t)
    assert torch.allclose(t, want, rtol=1e-5, atol=1e-6)
    u = mine(64, seed=8)
    dist.all_reduce(u, op=dist.ReduceOp.AVG)
    assert alike_on_every_rank(u)


def test_a_backend_call_refused_on_one_rank_fails_the_others_arena_op_and_the_next_one_pairs(ops):
    import ringcomm_torch.distributed  # noqa: F401  (registers the backend)

    settled(mine(4))
    if not dist.is_initialized():
        dist.init_process_group("ringcomm", store=dist.HashStore(), rank=hvd.rank(), world_size=hvd.size())
    last = hvd.size() - 1
    t = mine(300, seed=9)
    # the last rank's reduce op, then its root, are refused before its op starts; the others' ops
    # (through the arena where the job has one) fail with its reason
    with pytest.raises((ValueError, dist.DistBackendError), match="ReduceOp BAND is not supported"):
        dist.all_reduce(t, op=dist.ReduceOp.BAND if hvd.rank() == last else dist.ReduceOp.SUM)
    with pytest.raises((ValueError, dist.DistBackendError), match=f"root {hvd.size()} is not a rank of this group"):
        dist.broadcast(t, src=hvd.size() if hvd.rank() == last else 0)
    u = mine(300, seed=10)
    want = hvd.allreduce(u.clone(), op=hvd.Sum, name="arena.backend.refused.ref")
    dist.all_reduce(u)
    assert alike_on_every_rank(u)
    assert torch.allclose(u, want, rtol=1e-5, atol=1e-6)


def test_ddp_on_the_ringcomm_backend_gets_the_pinned_paths_gradients(ops, monkeypatch):
    import copy

    import ringcomm_torch.distributed  # noqa: F401  (registers the backend)

    settled(mine(4))
    if not dist.is_initialized():
        dist.init_process_group("ringcomm", store=dist.HashStore(), rank=hvd.rank(), world_size=hvd.size())
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = mine(8 * 6, seed=10).reshape(6, 8)
    grads = []
    through: list[int] = []
    real = device_arena_ops.allreduce
    monkeypatch.setattr(device_arena_ops, "allreduce", lambda *a, **k: through.append(1) or real(*a, **k))
    for fake in (ops, None):  # the arena, then the host path
        with device.override(fake):
            model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001)
            pinned_before = ops.pinned_allocations
            model(x).square().mean().backward()
            if fake is not None and on_device():
                if not spans_hosts():
                    assert ops.pinned_allocations == pinned_before  # DDP's buckets reduced in the arena
                assert through  # DDP's bucket went to the arena
        grads.append([p.grad.clone() for p in model.parameters()])
    for g, h in zip(*grads):
        assert alike_on_every_rank(g)
        assert torch.allclose(g, h, rtol=1e-5, atol=1e-6)


def test_threads_of_one_rank_reduce_through_the_arena_at_once(ops):
    settled(mine(4))
    size = hvd.size()
    errors: list[BaseException] = []

    def run(tag: str) -> None:
        try:
            for i in range(15):
                x = torch.full((100 + i,), float(hvd.rank() + i))
                out = hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum, name=f"arena.{tag}.{i}"))
                assert torch.equal(out, torch.full((100 + i,), float(size * i + size * (size - 1) / 2))), (tag, i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(tag,)) for tag in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    arena = device_arena.arena_for(mine(4), hvd.Sum, hvd.global_process_set)
    if arena is not None:
        assert arena.slots.free_bytes == arena.slots.capacity


def test_the_timeline_shows_the_copies_in_and_out_of_the_arena_and_the_device_reduction(ops, tmp_path):
    """With a timeline, an allreduce through the arena has MEMCPY_IN_ARENA first and
    MEMCPY_OUT_ARENA last on its row, and IPC_REDUCE between them on one host; through pinned
    memory it has the host copies instead."""
    settled(mine(4))
    path = tmp_path / "arena.json"
    hvd.start_timeline(str(path))
    hvd.allreduce(mine(1000), name="arena.tl")
    hvd.stop_timeline()
    if hvd.rank() != 0:
        return
    phases = timeline_phases(path, "allreduce.arena.tl")
    if on_device():
        assert phases[0] == "MEMCPY_IN_ARENA" and phases[-1] == "MEMCPY_OUT_ARENA", phases
        assert ("IPC_REDUCE" in phases) != spans_hosts(), phases
        assert "MEMCPY_D2H" not in phases and "MEMCPY_H2D" not in phases, phases
    else:
        assert phases[0] == "MEMCPY_D2H" and phases[-1] == "MEMCPY_H2D", phases


def test_a_tensor_below_the_min_bytes_goes_through_pinned_memory_and_the_settings_are_checked(monkeypatch):
    """``RINGCOMM_DEVICE_IPC_MIN_BYTES``: a smaller tensor never takes the arena (alike on every
    rank: its size is); the two device settings reject what cannot work."""
    import dataclasses

    from ringcomm.errors import InvalidInputError
    from ringcomm.job.config import Settings

    real = core_api.current_settings()
    with device.override(device.FakeOps(ipc=True)):
        x = mine(1000)  # 4000 bytes
        if on_device() and real.device_ipc_min_bytes <= 4000:
            assert device_arena.arena_for(x, hvd.Sum, hvd.global_process_set) is not None
        monkeypatch.setattr(core_api, "current_settings", lambda: dataclasses.replace(real, device_ipc_min_bytes=4001))
        assert device_arena.arena_for(x, hvd.Sum, hvd.global_process_set) is None
    assert Settings.from_env({}).device_ipc and Settings.from_env({}).device_ipc_wait == "stream"
    assert Settings.from_env({"RINGCOMM_DEVICE_IPC_WAIT": "host"}).device_ipc_wait == "host"
    for bad in ({"RINGCOMM_DEVICE_IPC_WAIT": "spin"}, {"RINGCOMM_DEVICE_IPC_MIN_BYTES": "-1"}):
        with pytest.raises(InvalidInputError, match="RINGCOMM_DEVICE_IPC_"):
            Settings.from_env(bad)


def test_a_peers_events_are_waited_for_as_the_setting_says(ops, monkeypatch):
    """``RINGCOMM_DEVICE_IPC_WAIT=stream``: the side stream waits for the peers' events and no
    thread does; ``host``: a thread waits for each, and no stream waits for another process."""
    if not on_device():
        pytest.skip("no arena here")
    from ringcomm_torch.device_ipc_ops import FakeIpcEvent

    settled(mine(4))
    kinds: list[str] = []
    real_stream, real_host = FakeIpcEvent.on_stream_wait, device.FakeOps.wait_event

    def on_stream(self):
        if self.foreign:
            kinds.append("stream")
        real_stream(self)

    def on_host(self, event):
        if isinstance(event, FakeIpcEvent) and event.foreign:
            kinds.append("host")
        real_host(self, event)

    monkeypatch.setattr(FakeIpcEvent, "on_stream_wait", on_stream)
    monkeypatch.setattr(device.FakeOps, "wait_event", on_host)
    hvd.allreduce(mine(500, seed=3), name="arena.waits")
    local = len(device_arena.arena_for(mine(4), hvd.Sum, hvd.global_process_set).local)
    assert len(kinds) == 2 * (local - 1), kinds  # each other local rank's posted, then its done
    assert set(kinds) == {core_api.current_settings().device_ipc_wait}, kinds
