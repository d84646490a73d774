"""The "ringcomm" backend's CUDA allgathers and reduce-scatters (FSDP's parameters and gradients)
through the shared arenas of a job on one host, run on CPU through the fake device's model of IPC
(see test_device_arena.py): every rank gets every rank's bits, each rank's block of the sum is the
sum in rank order, FSDP2 trains as one process would on every rank's batch, no pinned buffer is taken and no thread
waits for the device, ranks that disagree fail the op on every rank, and a rank's range is not
written again before every rank has read it.

Runs alone (one rank: no arena), and under the launcher with test_device_arena.py
(test_torch_jobs.py): at np 2 and 3 on one host, at np 2 with the setting off, and at np 4 as two
hosts, where every op takes pinned memory.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import ringcomm_torch as hvd  # noqa: E402
from conftest import Untouched, hosts_of_job, name_test_host, settle_arena  # noqa: E402
from ringcomm import api as core_api  # noqa: E402
from ringcomm_torch import device, device_arena, device_arena_ops  # noqa: E402

pytestmark = pytest.mark.timeout(120)

R = dist.ReduceOp


@pytest.fixture(scope="module", autouse=True)
def _init():
    import ringcomm_torch.distributed  # noqa: F401  (registers the backend)

    name_test_host()
    hvd.init()
    if not dist.is_initialized():  # the job is running already: the group adopts it
        dist.init_process_group("ringcomm", store=dist.HashStore(), rank=hvd.rank(), world_size=hvd.size())
    yield


def on_device() -> bool:
    """Whether the backend's CUDA allgathers take the arena (alike on every rank): one host."""
    return core_api.current_settings().device_ipc and hvd.size() > 1 and hosts_of_job(hvd.size()) == 1


def settled() -> None:
    arena = device_arena.one_host_arena_for(torch.ones(4), hvd.global_process_set)
    if arena is not None:
        settle_arena(arena)


def values(shape, dtype, rank: int, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s tensor (computable on any rank)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(shape, generator=g) * 50
    return x > 0 if dtype is torch.bool else x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_all_gather_into_a_tensor_and_into_a_list_give_every_ranks_bits(ops, dtype):
    settled()
    n, me = hvd.size(), hvd.rank()
    want = torch.cat([values((5, 7), dtype, r) for r in range(n)])
    untouched = Untouched(ops)
    out = torch.empty(n * 5, 7, dtype=dtype)
    dist.all_gather_into_tensor(out, values((5, 7), dtype, me))
    assert torch.equal(out, want), dtype
    parts = [torch.empty(5, 7, dtype=dtype) for _ in range(n)]
    dist.all_gather(parts, values((5, 7), dtype, me))
    assert torch.equal(torch.cat(parts), want), dtype
    assert untouched or not on_device()


def test_outputs_that_are_not_contiguous_and_async_ops(ops):
    settled()
    n, me = hvd.size(), hvd.rank()
    want = torch.cat([values(35, torch.float32, r, seed=1) for r in range(n)])
    out = torch.zeros(n * 35, 2)[:, 0]  # every other element
    work = dist.all_gather_into_tensor(out, values(35, torch.float32, me, seed=1), async_op=True)
    work.wait()
    assert torch.equal(out, want)
    parts = [torch.zeros(7, 5).t() for _ in range(n)]
    dist.all_gather(parts, values((5, 7), torch.float32, me, seed=1))
    assert torch.equal(torch.cat([p.reshape(-1) for p in parts]), want)
    block = torch.zeros(6, 4).t()[:, :3]  # the output of a reduce-scatter, not contiguous
    dist.reduce_scatter_tensor(block, torch.ones(n * 12, dtype=torch.float32))
    assert torch.equal(block, torch.full((4, 3), float(n)))


def in_rank_order(blocks: list[torch.Tensor], average: bool, dtype) -> torch.Tensor:
    """The sum of ``blocks`` term by term in rank order, half precision in float32, rounded once."""
    acc = blocks[0].to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype, copy=True)
    for b in blocks[1:]:
        acc.add_(b.to(acc.dtype))
    if average:
        acc.div_(len(blocks))
    return acc.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("op", [R.SUM, R.AVG])
def test_each_rank_gets_its_block_of_the_sum_in_rank_order(ops, dtype, op):
    settled()
    n, me = hvd.size(), hvd.rank()
    inputs = [values((n * 6, 3), dtype, r, seed=2) for r in range(n)]
    untouched = Untouched(ops)
    out = torch.empty(6, 3, dtype=dtype)
    dist.reduce_scatter_tensor(out, inputs[me].clone(), op=op)
    want = in_rank_order([x[me * 6:(me + 1) * 6] for x in inputs], op == R.AVG, dtype)
    if on_device():
        assert torch.equal(out, want), (dtype, op)
        assert untouched
    else:  # the engine's order and precision
        assert torch.allclose(out.double(), want.double(), rtol=1e-2 if dtype.itemsize == 2 else 1e-5), (dtype, op)
    listed = torch.empty(6, 3, dtype=dtype)
    dist.reduce_scatter(listed, list(inputs[me].chunk(n)), op=op)
    assert torch.equal(listed, out)


def test_the_pinned_path_gives_the_same_blocks_within_rounding_and_max_takes_it(ops):
    settled()
    n, me = hvd.size(), hvd.rank()
    inputs = [values(n * 300, torch.float32, r, seed=3) for r in range(n)]
    on_arena = torch.empty(300)
    dist.reduce_scatter_tensor(on_arena, inputs[me].clone())
    with device.override(None):  # host tensors: the engine's reduce-scatter
        pinned = torch.empty(300)
        dist.reduce_scatter_tensor(pinned, inputs[me].clone())
    assert torch.allclose(on_arena, pinned, rtol=1e-5, atol=1e-4)
    untouched = Untouched(ops)
    top = torch.empty(300)
    dist.reduce_scatter_tensor(top, inputs[me].clone(), op=R.MAX)  # the device sums only: pinned memory
    assert torch.equal(top, torch.stack([x[me * 300:(me + 1) * 300] for x in inputs]).amax(0))
    assert not untouched or n == 1


def test_fsdp_trains_through_the_arena_to_what_one_process_gets_from_every_ranks_batch(ops, monkeypatch):
    """FSDP2 over a "ringcomm" mesh gathers its parameters and reduce-scatters its gradients
    through the arena (no pinned buffer) and ends where one process does that trains the same
    model on every rank's batch at once (1e-5)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    settled()
    n = hvd.size()
    calls = {"allgather": 0, "reduce_scatter": 0}
    for kind in calls:
        real = getattr(device_arena_ops, kind)

        def counted(*a, _real=real, _kind=kind, **k):
            calls[_kind] += 1
            return _real(*a, **k)
        monkeypatch.setattr(device_arena_ops, kind, counted)

    def model() -> torch.nn.Module:
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3))

    def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 10 + rank)
        return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)

    sharded, whole = model(), model()
    mesh = init_device_mesh("cpu", (n,))
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    untouched = Untouched(ops)
    for net, ranks in ((sharded, [hvd.rank()]), (whole, list(range(n)))):
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for step in range(6):
            opt.zero_grad()
            losses = [torch.nn.functional.cross_entropy(net(x), y) for x, y in (batch(step, r) for r in ranks)]
            (sum(losses) / len(losses)).backward()
            opt.step()
        if net is sharded and on_device():
            assert untouched and calls["allgather"] >= 12 and calls["reduce_scatter"] >= 6, calls
    diff = max(float((a.full_tensor() - b).detach().abs().max()) for a, b in zip(sharded.parameters(),
                                                                                 whole.parameters()))
    assert diff <= 1e-5, diff


def test_a_rank_writes_its_range_again_only_once_every_rank_has_read_it(ops, monkeypatch):
    """Rank 0's device is held after its tensor is in its range, and its return thread is slow to
    queue its copies: the others' next op, which takes the same range, writes into it only once
    rank 0's copies of this op have run (the others' streams wait for its *done* only after the
    second agreement says it was recorded)."""
    if not on_device():
        pytest.skip("no arena here")
    settled()
    n, me = hvd.size(), hvd.rank()
    first = torch.cat([values(64, torch.float32, r, seed=4) for r in range(n)])
    second = torch.cat([values(64, torch.float32, r, seed=5) for r in range(n)])
    if me == 0:
        real = device_arena_ops.wait_for_peers
        slow = [True]

        def late(*a, **k):
            if slow and threading.current_thread() is not threading.main_thread():
                slow.clear()
                time.sleep(0.5)  # the others reach synchronize() meanwhile
            return real(*a, **k)
        monkeypatch.setattr(device_arena_ops, "wait_for_peers", late)
    out = torch.empty(n * 64)
    work = dist.all_gather_into_tensor(out, values(64, torch.float32, me, seed=4), async_op=True)
    if me == 0:
        ops.hold()  # this rank's tensor is in its range already; its copies out wait for fire()
        work.wait()
        time.sleep(0.5)  # the others' next op is ready to write meanwhile
        ops.fire()
    else:
        work.wait()
    assert torch.equal(out, first)
    again = torch.empty(n * 64)
    dist.all_gather_into_tensor(again, values(64, torch.float32, me, seed=5))
    assert torch.equal(again, second)


def test_ranks_whose_inputs_differ_fail_the_op_on_every_rank_and_the_next_op_works(ops):
    if not on_device():
        pytest.skip("no arena here")
    settled()
    n, last = hvd.size(), hvd.rank() == hvd.size() - 1
    t = torch.ones(4, 6) if last else torch.ones(24)
    with pytest.raises(dist.DistBackendError, match=r"allgather .*ranks disagree on the tensor") as err:
        dist.all_gather_into_tensor(torch.empty(n * 24), t)
    assert f"rank {n - 1}: float32 [4, 6]" in str(err.value), err.value
    with pytest.raises(dist.DistBackendError, match=r"reducescatter .*ranks disagree on the tensor"):
        dist.reduce_scatter_tensor(torch.empty(24), torch.ones(n * 24, dtype=torch.float64 if last else torch.float32))
    out = torch.empty(n * 3)
    dist.all_gather_into_tensor(out, torch.full((3,), float(hvd.rank())))
    assert torch.equal(out, torch.arange(n).repeat_interleave(3).float())


def test_a_tensor_larger_than_the_free_range_goes_through_pinned_memory(ops):
    settled()
    n, me = hvd.size(), hvd.rank()
    count = core_api.current_settings().device_ipc_arena_bytes // 4 + 16  # more than the whole arena
    untouched = Untouched(ops)
    out = torch.empty(n * count)
    dist.all_gather_into_tensor(out, torch.full((count,), float(me)))
    assert torch.equal(out, torch.arange(n).repeat_interleave(count).float())
    assert not untouched or n == 1
