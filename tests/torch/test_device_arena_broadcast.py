"""Per-tensor CUDA broadcasts copied from the root's arena on the device (CUDA IPC) in a job on
one host, run on CPU through the fake device's model of IPC (see test_device_arena.py): every
rank gets the root's bits, no pinned buffer is taken and no thread waits for the device, ranks
that disagree fail the op on every rank, and whatever cannot take the arena takes pinned memory.

Runs alone (one rank: no arena), and under the launcher with test_device_arena.py
(test_torch_jobs.py): at np 2 and 3 on one host, at np 2 with the setting off, and at np 4 as two
hosts, where every broadcast takes pinned memory.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import ringcomm_torch as hvd  # noqa: E402
from conftest import Untouched, hosts_of_job, name_test_host, settle_arena, timeline_phases  # noqa: E402
from ringcomm import api as core_api  # noqa: E402
from ringcomm.errors import InvalidInputError, MismatchError  # noqa: E402
from ringcomm_torch import device, device_arena  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _init():
    name_test_host()
    hvd.init()
    yield


def on_device() -> bool:
    """Whether the job's CUDA broadcasts take the arena (alike on every rank): every rank on one host."""
    return core_api.current_settings().device_ipc and hvd.size() > 1 and hosts_of_job(hvd.size()) == 1


def settled(t: torch.Tensor) -> device_arena.Arena | None:
    """This rank's arena for broadcasts once every rank's has settled, or None (no arena)."""
    arena = device_arena.one_host_arena_for(t, hvd.global_process_set)
    if arena is None:
        return None
    settle_arena(arena)
    return arena


def rank_values(shape, dtype, seed: int = 0) -> torch.Tensor:
    """Values that differ on every rank, in ``dtype``."""
    g = torch.Generator().manual_seed(seed * 100 + hvd.rank())
    x = torch.randn(shape, generator=g) * 50
    if dtype is torch.bool:
        return x > 0
    return x.to(dtype)


def the_roots(shape, dtype, root: int, seed: int = 0) -> torch.Tensor:
    """Rank ``root``'s :func:`rank_values`, computed on any rank."""
    g = torch.Generator().manual_seed(seed * 100 + root)
    x = torch.randn(shape, generator=g) * 50
    return x > 0 if dtype is torch.bool else x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8,
                                   torch.bool])
def test_every_rank_gets_the_roots_bits_from_each_root_through_the_arena(ops, dtype):
    settled(rank_values(4, torch.float32))
    for root in range(hvd.size()):
        untouched = Untouched(ops)
        t = rank_values((7, 33), dtype, seed=root)
        out = hvd.broadcast(t, root_rank=root, name=f"bcast.{dtype}.{root}")
        assert out is not t and out.dtype == dtype and out.shape == t.shape
        assert torch.equal(out, the_roots((7, 33), dtype, root, seed=root)), (dtype, root)
        assert torch.equal(t, rank_values((7, 33), dtype, seed=root))  # the input is left as it was
        assert untouched or not on_device()


def test_in_place_async_and_non_contiguous_tensors(ops):
    settled(rank_values(4, torch.float32))
    root = hvd.size() - 1
    base = rank_values((40, 6), torch.float32, seed=3)
    view = base.t()  # not contiguous
    h = hvd.broadcast_async_(view, root_rank=root, name="bcast.view")
    assert hvd.synchronize(h) is view
    assert torch.equal(base, the_roots((40, 6), torch.float32, root, seed=3))
    x = rank_values(500, torch.float64, seed=4)
    assert hvd.broadcast_(x, 0, name="bcast.inplace") is x
    assert torch.equal(x, the_roots(500, torch.float64, 0, seed=4))


def test_a_non_root_reads_the_roots_range_only_once_the_root_posted_it(ops):
    """The root holds its device after queueing its copy in: its *posted* happens only at fire(),
    and no other rank's result is read before (a fake wait blocks until then)."""
    if not on_device():
        pytest.skip("no arena here")
    settled(rank_values(4, torch.float32))
    root = hvd.size() - 1
    x = rank_values(300, torch.float32, seed=5)
    if hvd.rank() == root:
        ops.hold()
        h = hvd.broadcast_async(x, root, name="bcast.held")
        time.sleep(0.8)  # the others agree and queue their waits meanwhile
        ops.fire()
    else:
        h = hvd.broadcast_async(x, root, name="bcast.held")
    out = hvd.synchronize(h)
    assert torch.equal(out, the_roots(300, torch.float32, root, seed=5))


def test_ranks_that_name_another_root_fail_the_op_on_every_rank_and_the_next_op_works(ops):
    if not on_device():
        pytest.skip("no arena here")
    arena = settled(rank_values(4, torch.float32))
    with pytest.raises(MismatchError, match="ranks disagree on root_rank") as err:
        hvd.broadcast(rank_values(100, torch.float32), root_rank=hvd.rank(), name="bcast.roots")
    assert "rank 1: 1" in str(err.value), err.value
    assert arena.slots.free_bytes == arena.slots.capacity
    out = hvd.broadcast(rank_values(100, torch.float32, seed=6), 0, name="bcast.roots.after")
    assert torch.equal(out, the_roots(100, torch.float32, 0, seed=6))


@pytest.mark.parametrize("case", ["shape", "dtype"])
def test_ranks_whose_tensors_differ_fail_the_op_on_every_rank(ops, case):
    if not on_device():
        pytest.skip("no arena here")
    settled(rank_values(4, torch.float32))
    last = hvd.rank() == hvd.size() - 1
    if case == "shape":
        t = torch.ones(12, 10) if last else torch.ones(120)
    else:
        t = torch.ones(120, dtype=torch.int32) if last else torch.ones(120)
    with pytest.raises(MismatchError, match="broadcast .*ranks disagree on the tensor") as err:
        hvd.broadcast(t, 0, name=f"bcast.differ.{case}")
    assert f"rank {hvd.size() - 1}: " + ("float32 [12, 10]" if case == "shape" else "int32 [120]") in str(err.value)
    assert torch.equal(hvd.broadcast(torch.full((3,), float(hvd.rank())), 0, name=f"bcast.differ.{case}.after"),
                       torch.zeros(3))


def test_a_root_out_of_range_on_one_rank_fails_the_op_on_every_rank(ops):
    if hvd.size() < 2:
        pytest.skip("one rank")
    settled(rank_values(4, torch.float32))
    t = rank_values(64, torch.float32)
    if hvd.rank() == 0:
        with pytest.raises(InvalidInputError, match="root_rank=99 is out of range"):
            hvd.broadcast(t, 99, name="bcast.bad-root")
    else:
        with pytest.raises(MismatchError, match="rank 0 refused"):
            hvd.broadcast(t, 0, name="bcast.bad-root")
    out = hvd.broadcast(rank_values(64, torch.float32, seed=7), 1, name="bcast.bad-root.after")
    assert torch.equal(out, the_roots(64, torch.float32, 1, seed=7))


def test_a_tensor_larger_than_the_roots_free_range_goes_through_pinned_memory(ops):
    arena = settled(rank_values(4, torch.float32))
    n = core_api.current_settings().device_ipc_arena_bytes // 4 + 16  # more than the whole arena
    untouched = Untouched(ops)
    out = hvd.broadcast(rank_values(n, torch.float32, seed=8), 0, name="bcast.large")
    assert torch.equal(out, the_roots(n, torch.float32, 0, seed=8))
    assert not untouched or arena is None
    if arena is not None:
        assert arena.slots.free_bytes == arena.slots.capacity


def test_a_broadcast_while_a_rank_has_joined_fails_as_on_pinned_memory_and_the_next_op_works(ops):
    """A rank that has joined adds zeros to the agreement: the op takes pinned memory, where a
    broadcast cannot run after join(), and fails on every other rank, as there."""
    if hvd.size() < 2:
        pytest.skip("one rank")
    settled(rank_values(4, torch.float32))
    if hvd.rank() == 0:
        hvd.join()
    else:
        with pytest.raises(MismatchError, match=r"cannot run while rank\(s\) \[0\] have joined"):
            hvd.broadcast(rank_values(50, torch.float32, seed=9), 1, name="bcast.joined")
        hvd.join()
    out = hvd.broadcast(rank_values(50, torch.float32, seed=10), 0, name="bcast.after-join")
    assert torch.equal(out, the_roots(50, torch.float32, 0, seed=10))


def test_the_backend_and_ddps_buffers_take_the_arena_and_forward_does_not_wait_for_the_device(ops):
    import ringcomm_torch.distributed  # noqa: F401  (registers the backend)

    settled(rank_values(4, torch.float32))
    if not dist.is_initialized():
        dist.init_process_group("ringcomm", store=dist.HashStore(), rank=hvd.rank(), world_size=hvd.size())
    t = rank_values(400, torch.float32, seed=11)
    untouched = Untouched(ops)
    dist.broadcast(t, src=hvd.size() - 1)
    assert torch.equal(t, the_roots(400, torch.float32, hvd.size() - 1, seed=11))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    assert untouched or not on_device()
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # its checks allgather through pinned memory
    untouched = Untouched(ops)
    ddp(rank_values((5, 6), torch.float32, seed=12)).sum().backward()  # each rank's own running stats
    ddp(torch.linspace(-1, 1, 30).reshape(5, 6))  # takes rank 0's buffers first, then the same batch's
    bn = model[1]
    stats = torch.stack([bn.running_mean, bn.running_var])
    with device.override(None):
        rows = hvd.allgather(stats.reshape(1, -1))
    assert all(torch.equal(rows[0], row) for row in rows)
    assert untouched or not on_device()


def test_the_timeline_shows_the_copies_in_and_out_of_the_arena(ops, tmp_path):
    settled(rank_values(4, torch.float32))
    path = tmp_path / "bcast.json"
    hvd.start_timeline(str(path))
    hvd.broadcast(rank_values(1000, torch.float32), 0, name="bcast.tl")
    hvd.stop_timeline()
    if hvd.rank() != 0:
        return
    # hosts named apart on one machine (ARENA_TEST_HOSTS) look like one host to the launcher: the
    # op is agreed, then taken through pinned memory under the name the fallback gives it
    phases = timeline_phases(path, "broadcast.bcast.tl" + (".host" if hosts_of_job(hvd.size()) > 1 else ""))
    if on_device():
        assert phases[0] == "MEMCPY_IN_ARENA" and phases[-1] == "MEMCPY_OUT_ARENA", phases
        assert "MEMCPY_D2H" not in phases and "MEMCPY_H2D" not in phases, phases
    else:
        assert phases[0] == "MEMCPY_D2H" and phases[-1] == "MEMCPY_H2D", phases


def test_what_takes_the_arena_is_decided_alike_on_every_rank(monkeypatch):
    """Below ``RINGCOMM_DEVICE_IPC_MIN_BYTES``, across hosts, in another process set, or with the
    setting off, a broadcast takes pinned memory; any dtype may take the arena."""
    import dataclasses

    real = core_api.current_settings()
    with device.override(device.FakeOps(ipc=True)):
        x = torch.ones(1000, dtype=torch.int16)  # 2000 bytes
        if on_device() and real.device_ipc_min_bytes <= 2000:
            assert device_arena.one_host_arena_for(x, hvd.global_process_set) is not None
        monkeypatch.setattr(core_api, "current_settings", lambda: dataclasses.replace(real, device_ipc_min_bytes=2001))
        assert device_arena.one_host_arena_for(x, hvd.global_process_set) is None
        monkeypatch.setattr(core_api, "current_settings", lambda: dataclasses.replace(real, device_ipc=False))
        assert device_arena.one_host_arena_for(torch.ones(10 ** 6), hvd.global_process_set) is None
    with device.override(device.FakeOps(ipc=False)):
        assert device_arena.one_host_arena_for(torch.ones(10 ** 6), hvd.global_process_set) is None
