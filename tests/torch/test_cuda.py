"""CUDA tensors through ringcomm_torch (staged through pinned host memory by the device's one service).
Skipped without a GPU.

Runs in one process or under ``ringcomm-run`` at any size (tools/gpu_check.sh runs np 1, 2, 4, and np 4
with ``ARENA_TEST_HOSTS=2``: rank r names host r % 2, so the reductions across hosts run on the GPU).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available on this machine (torch.cuda.is_available() is False)",
                allow_module_level=True)

import ringcomm_torch as hvd  # noqa: E402
from conftest import name_test_host, settle_arena, timeline_phases  # noqa: E402
from ringcomm_torch import device  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _init():
    name_test_host()
    hvd.init()
    yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64], ids=str)
def test_collectives_keep_device_dtype_and_values(dtype):
    t = (torch.arange(24, device="cuda") % 5).reshape(6, 4).to(dtype)
    n = hvd.size()
    for out in (hvd.allreduce(t, op=hvd.Max), hvd.broadcast(t, 0), hvd.allreduce(t, op=hvd.Min)):
        assert out.device == t.device and out.dtype == dtype and torch.equal(out, t)
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum), t * n)
    rows = torch.cat([t] * n)  # alltoall splits dim 0 evenly: n * 6 rows
    assert hvd.allgather(t).device == t.device and hvd.alltoall(rows).device == t.device
    assert hvd.reducescatter(rows, op=hvd.Sum).device == t.device
    y = t.clone()
    assert hvd.allreduce_(y, op=hvd.Max) is y and torch.equal(y, t)
    assert hvd.broadcast_(y, 0) is y and y.device == t.device


def test_pinned_buffers_are_reused():
    t = torch.randn(1000, device="cuda")
    pool = device.service_for(t).pool  # the device's one pool, shared with the optimizer's buckets
    for _ in range(3):  # a buffer returns to the pool once its copy back completed: warm up both ops
        hvd.allreduce_(t)
        hvd.allreduce(t)
        torch.cuda.synchronize()
    before = pool.allocations
    for _ in range(20):
        hvd.allreduce_(t)
        hvd.allreduce(t)
        torch.cuda.synchronize()
    assert pool.allocations == before


def test_single_tensor_allreduces_reduce_on_the_gpus_through_the_shared_arena():
    """With RINGCOMM_DEVICE_IPC=1 (as tools/gpu_check.sh runs it): the arena is shared, and a float
    allreduce is right, alike on every rank and ordered on the current stream (a result read right
    after the call sees the kernels queued before it).  On one host nothing goes through pinned
    memory; across named hosts only each rank's shard of its host's sum does."""
    from ringcomm_torch import device_arena, device_ipc

    t = torch.zeros(1 << 16, device="cuda")
    arena = device_arena.arena_for(t, hvd.Sum, hvd.global_process_set)
    if arena is None:
        pytest.skip("the device path is off here (one rank, several hosts or RINGCOMM_DEVICE_IPC=0)")
    settle_arena(arena)
    assert arena.state == "ready", arena.reason
    before = device.service_for(t).pool.allocations
    staged = arena.staged_bytes
    n = hvd.size()
    for step in range(1, 6):
        t.fill_(float(hvd.rank() + step))  # queued on the current stream before the op's copy
        out = hvd.allreduce(t, op=hvd.Sum)
        hvd.allreduce_(t, op=hvd.Average)
        assert float(out[-1]) == n * step + n * (n - 1) / 2
        assert float(t[0]) == step + (n - 1) / 2
    half = torch.randn(4097, device="cuda", generator=torch.Generator("cuda").manual_seed(hvd.rank())).half()
    got = hvd.allreduce(half, op=hvd.Sum)
    after = device.service_for(t).pool.allocations  # before the allgather below, which is staged
    rows = hvd.allgather(got.reshape(1, -1))
    assert all(torch.equal(rows[0], row) for row in rows)  # one rank sums each shard: the same bits
    if len(arena.local) == n:
        assert after == before  # nothing went through pinned host memory
        assert arena.staged_bytes == staged
    else:
        me, hosts_ranks = arena.local.index(hvd.rank()), len(arena.local)
        shard = [b - a for a, b in [device_ipc.shard_bounds(m, me, hosts_ranks) for m in (t.numel(), 4097)]]
        assert arena.staged_bytes - staged == 4 * 10 * shard[0] + 2 * shard[1]  # shards only, float16 as float16


def test_a_single_tensor_broadcast_on_one_host_is_copied_from_the_roots_arena():
    """With RINGCOMM_DEVICE_IPC=1, every rank on one host: a broadcast of any dtype gives every rank
    the root's bits, reads what the current stream queued before the call, and is ordered before
    what it queues after; nothing goes through pinned host memory."""
    from ringcomm_torch import device_arena

    t = torch.zeros(1 << 15, device="cuda")
    arena = device_arena.one_host_arena_for(t, hvd.global_process_set)
    if arena is None:
        pytest.skip("broadcasts take pinned memory here (one rank, several hosts or RINGCOMM_DEVICE_IPC=0)")
    settle_arena(arena)
    if arena.state != "ready" or len(arena.local) < hvd.size():
        pytest.skip(f"the ranks span hosts or the arena is off ({arena.reason})")
    pool = device.service_for(t).pool
    before = pool.allocations
    root = hvd.size() - 1
    for step in range(1, 4):
        t.fill_(float(hvd.rank() * 10 + step))  # queued before the call
        out = hvd.broadcast(t, root)
        out.add_(1)  # queued after: runs on the root's values
        hvd.broadcast_(t, 0)
        assert float(out[-1]) == root * 10 + step + 1
        assert float(t[0]) == step
    ints = torch.arange(999, device="cuda", dtype=torch.int64) * (hvd.rank() + 1)
    assert torch.equal(hvd.broadcast(ints, root), torch.arange(999, device="cuda") * (root + 1))
    assert pool.allocations == before


def test_the_backends_allgather_and_reduce_scatter_on_one_host_go_through_the_arenas():
    """With RINGCOMM_DEVICE_IPC=1, every rank on one host: the "ringcomm" backend's CUDA
    all_gather_into_tensor and reduce_scatter_tensor (FSDP's) give every rank's bits and the sum,
    read what the current stream queued before the call, and take no pinned buffer."""
    import torch.distributed as dist

    import ringcomm_torch.distributed  # noqa: F401  (registers the backend)
    from ringcomm_torch import device_arena

    n, me = hvd.size(), hvd.rank()
    t = torch.zeros(1 << 15, device="cuda")
    arena = device_arena.one_host_arena_for(t, hvd.global_process_set)
    if arena is None:
        pytest.skip("these ops take pinned memory here (one rank, several hosts or RINGCOMM_DEVICE_IPC=0)")
    settle_arena(arena)
    if arena.state != "ready" or len(arena.local) < n:
        pytest.skip(f"the ranks span hosts or the arena is off ({arena.reason})")
    if not dist.is_initialized():  # the job is running already: the group adopts it
        dist.init_process_group("ringcomm", store=dist.HashStore(), rank=me, world_size=n)
    pool = device.service_for(t).pool
    before = pool.allocations
    for step in range(1, 4):
        t.fill_(float(me * 10 + step))  # queued before the call
        out = torch.empty(n * t.numel(), device="cuda")
        dist.all_gather_into_tensor(out, t)
        want = torch.tensor([r * 10.0 + step for r in range(n)], device="cuda").repeat_interleave(t.numel())
        assert torch.equal(out, want)
        block = torch.empty(t.numel() // n, device="cuda")
        dist.reduce_scatter_tensor(block, t[: block.numel() * n], op=dist.ReduceOp.AVG)
        assert torch.allclose(block, torch.full_like(block, sum(r * 10.0 + step for r in range(n)) / n))
    assert pool.allocations == before


def test_sync_batch_norm_on_cuda_matches_the_host():
    import copy

    torch.manual_seed(0)
    ref = hvd.SyncBatchNorm(4)
    bn = copy.deepcopy(ref).cuda()
    x = torch.randn(3 + hvd.rank(), 4, 5, generator=torch.Generator().manual_seed(hvd.rank()))
    xc, xh = x.cuda().requires_grad_(), x.clone().requires_grad_()
    bn(xc).square().sum().backward()  # its backward sums stay on the GPU (the device service)
    ref(xh).square().sum().backward()
    assert torch.allclose(xc.grad.cpu(), xh.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(bn.running_var.cpu(), ref.running_var, rtol=1e-5, atol=1e-6)


def test_results_are_ordered_on_the_current_stream():
    t = torch.zeros(1 << 20, device="cuda")
    for _ in range(5):
        t.add_(1.0)  # queued on the current stream before the staging copy
        hvd.allreduce_(t, op=hvd.Max)
    assert float(t[-1]) == 5.0


def test_autograd_and_optimizer_on_cuda():
    x = torch.randn(4, 3, device="cuda", requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * 2).sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, 2.0 * hvd.size()))
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2).cuda()
    ref = torch.nn.Linear(5, 2).cuda()
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = torch.randn(8, 5, device="cuda")
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(data).pow(2).mean().backward()
        o.step()
    # every rank drew the same data (seed 0), so the average is the local gradient
    assert torch.allclose(model.weight, ref.weight, atol=1e-6)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)


def test_timeline_shows_the_copies_of_the_path_taken(tmp_path):
    """Through pinned memory: the device-host copies first and last; through the shared arena
    (RINGCOMM_DEVICE_IPC=1, ranks sharing a host): the copies into and out of the arena."""
    from ringcomm_torch import device_arena

    t = torch.ones(1 << 20, device="cuda")
    arena = device_arena.arena_for(t, hvd.Sum, hvd.global_process_set)
    through_arena = False
    if arena is not None:  # every rank's arena settled before the traced op
        settle_arena(arena)
        through_arena = all(hvd.allgather_object(arena.state == "ready"))
    path = tmp_path / "cuda-timeline.json"
    hvd.start_timeline(str(path))
    hvd.allreduce(t, name="cuda.grad")
    hvd.stop_timeline()
    if hvd.rank() != 0:  # as Horovod's: only rank 0 writes the timeline
        return
    phases = timeline_phases(path, "allreduce.cuda.grad")
    if through_arena:
        assert phases[0] == "MEMCPY_IN_ARENA" and phases[-1] == "MEMCPY_OUT_ARENA", phases
    else:
        assert phases[0] == "MEMCPY_D2H" and phases[-1] == "MEMCPY_H2D", phases
    assert "NEGOTIATE_ALLREDUCE" in phases


def test_optimizer_buckets_on_cuda_never_synchronize_outside_the_stager():
    """During backward() and step() nothing synchronizes a stream, the device or an event except
    the stager thread; one core op per bucket; the results are every rank's average."""
    import threading

    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(20)]).cuda()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert 1 < len(opt.reducer.device_buckets) < 10
    waits: list[str] = []
    real = (torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize, torch.cuda.synchronize)

    def spy(fn):
        def call(*args, **kwargs):
            waits.append(threading.current_thread().name)
            return fn(*args, **kwargs)
        return call

    x = torch.randn(32, 256, device="cuda")
    torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize, torch.cuda.synchronize = map(spy, real)
    try:
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.synchronize()
            grads = [p.grad.clone() for p in model.parameters()]
            with opt.skip_synchronize():
                opt.step()
    finally:
        torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize, torch.cuda.synchronize = real
    from ringcomm_torch.device_ipc import IpcBucket

    ipc = [b for b in opt.reducer.device_buckets.values() if isinstance(b, IpcBucket)]
    if ipc and all(len(b.local) == b.size for b in ipc):
        assert not waits, waits  # reduced on the GPUs of one host: nothing waits for the device at all
    else:  # through pinned memory (across hosts: only each rank's shard): only the stager waits for it
        assert waits and set(waits) == {"ringcomm-torch-stager"}, waits
    for g in grads:  # the same on every rank
        gathered = hvd.allgather(g.unsqueeze(0))
        assert all(torch.equal(gathered[0], row) for row in gathered)


def test_optimizer_timeline_shows_each_buckets_parameters(tmp_path):
    import json

    path = tmp_path / "cuda-buckets.json"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).cuda()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.start_timeline(str(path))
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    opt.step()
    hvd.stop_timeline()
    if hvd.rank() != 0:
        return
    events = json.loads(path.read_text())
    for phase in ("BUCKET_PACK", "BUCKET_UNPACK"):
        carried = [e["args"]["parameters"] for e in events if e.get("name") == phase]
        assert sorted(n for names in carried for n in names) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("set_to_none", [False, True], ids=["zeroed", "set_to_none"])
def test_optimizer_gradients_become_views_of_the_cuda_buckets(set_to_none):
    """After a step each gradient lies in its bucket's flat buffer, and the values match a twin
    trained with the plain optimizer on every step (every rank draws the same data)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)]).cuda()
    twin = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=2,
                                   named_parameters=model.named_parameters())
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(16, 128, device="cuda")
    for _ in range(4):
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad(set_to_none=set_to_none)
            m(x).square().mean().backward()
            o.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
    for bucket in opt.reducer.device_buckets.values():
        assert all(bucket.views())
        home = bucket._flat.untyped_storage().data_ptr()
        assert all(p.grad.untyped_storage().data_ptr() == home for p in bucket.params)
