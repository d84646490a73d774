"""Worker for tests/jobs/test_process_sets.py: the torch layer on a process set, and SyncBatchNorm (np 2 or 3).

Every rank builds the whole data set from fixed seeds and checks its own share
against one-process references: torch collectives and their gradients on a
subset, DistributedOptimizer on a subset vs. one process on the members'
concatenated batch, and SyncBatchNorm (global set and subset; 1d/2d/3d;
float64 and float32; unequal per-rank batch sizes) vs. torch.nn.BatchNorm*d on
the concatenated batch.  Prints ``WORKER OK rank=R``.
"""

from __future__ import annotations

import copy

import torch

import ringcomm_torch as hvd

torch.set_num_threads(1)
hvd.init(process_sets="dynamic")
R, N = hvd.rank(), hvd.size()
# the subset: the even ranks at np 3 ([0, 2]); the last rank alone at np 2 ([1], a set of one)
S = hvd.add_process_set([0, 2] if N == 3 else [N - 1])
MEMBERS = S.ranks


def close(got: torch.Tensor, exp: torch.Tensor, tol: float, what: str) -> None:
    assert got.shape == exp.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(exp.shape)}"
    err = (got.detach().double() - exp.detach().double()).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:g} (rank {R})"


def raises_value_error(fn, needle: str) -> None:
    try:
        fn()
    except ValueError as exc:
        assert needle in str(exc), f"{needle!r} not in {exc}"
        return
    raise AssertionError(f"no ValueError ({needle})")


# ------------------------------------------------------------------ collectives on a subset

def check_collectives_on_subset() -> None:
    if not S.included():
        raises_value_error(lambda: hvd.allreduce(torch.ones(2), process_set=S),
                           f"rank {R} is not in process set {S.process_set_id} (ranks {MEMBERS})")
        raises_value_error(lambda: hvd.barrier(process_set=S), "is not in process set")
        return
    me, k = S.rank(), S.size()
    assert me == MEMBERS.index(R) and k == len(MEMBERS)
    t = torch.full((3,), float(R))
    close(hvd.allreduce(t, op=hvd.Sum, process_set=S), torch.full((3,), float(sum(MEMBERS))), 0, "allreduce")
    close(hvd.allreduce(t, process_set=S), torch.full((3,), sum(MEMBERS) / k), 1e-6, "allreduce average")
    a, b = hvd.grouped_allreduce([t, t * 2], op=hvd.Sum, process_set=S)
    close(b, torch.full((3,), 2.0 * sum(MEMBERS)), 0, "grouped_allreduce")
    h = hvd.allreduce_async_(t.clone(), op=hvd.Max, process_set=S)
    close(hvd.synchronize(h), torch.full((3,), float(max(MEMBERS))), 0, "allreduce_async_")
    # allgather: values, and the gradient is this member's rows of the averaged output gradient
    x = torch.full((me + 1, 2), float(R), requires_grad=True)
    out = hvd.allgather(x, process_set=S)
    rows = sum(j + 1 for j in range(k))
    exp = torch.cat([torch.full((j + 1, 2), float(q)) for j, q in enumerate(MEMBERS)])
    close(out, exp, 0, "allgather")
    weight = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2)
    (out * weight).sum().backward()
    offset = sum(j + 1 for j in range(me))
    close(x.grad, weight[offset:offset + me + 1], 1e-6, "allgather gradient")
    # broadcast from the last member (a global rank): the root gets the averaged gradient
    x = torch.full((4,), float(R), requires_grad=True)
    y = hvd.broadcast(x, root_rank=MEMBERS[-1], process_set=S)
    close(y, torch.full((4,), float(MEMBERS[-1])), 0, "broadcast")
    y.sum().backward()
    close(x.grad, torch.ones(4) if R == MEMBERS[-1] else torch.zeros(4), 1e-6, "broadcast gradient")
    # reducescatter Average: the gradient is the allgathered output gradient (Horovod's)
    x = torch.ones(2 * k, 3, requires_grad=True)
    out = hvd.reducescatter(x, op=hvd.Average, process_set=S)
    close(out, torch.ones(2, 3), 1e-6, "reducescatter")
    out.sum().backward()
    close(x.grad, torch.ones(2 * k, 3), 1e-6, "reducescatter gradient")
    # alltoall: one row to each member
    x = torch.arange(k, dtype=torch.float32) + 10 * R
    close(hvd.alltoall(x, process_set=S), torch.tensor([10.0 * q + me for q in MEMBERS]), 0, "alltoall")
    hvd.barrier(process_set=S)
    assert hvd.allgather_object(R, process_set=S) == MEMBERS
    assert hvd.broadcast_object({"r": R}, root_rank=MEMBERS[0], process_set=S) == {"r": MEMBERS[0]}


# ------------------------------------------------------------------ DistributedOptimizer on a subset

def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def check_optimizer_on_subset() -> None:
    model = make_model(3)
    if not S.included():
        # as Horovod's: a rank outside the set builds the optimizer, which exchanges nothing there,
        # and steps on its own gradients (a plain optimizer gives bitwise the same parameters)
        ref = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), process_set=S)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):
            g = torch.Generator().manual_seed(80 + R + step)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), f"rank {R}: the optimizer outside its process set changed the gradients"
        return
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                   named_parameters=model.named_parameters(), process_set=S)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    b, k, me = 3, S.size(), S.rank()
    for step in range(3):
        g = torch.Generator().manual_seed(50 + step)
        x, y = torch.randn(k * b, 5, generator=g), torch.randn(k * b, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[me * b:(me + 1) * b]), y[me * b:(me + 1) * b]).backward()
        opt.step()  # gradients averaged over the set's members only
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p, q, 1e-5, f"DistributedOptimizer on {S}: {name}")


# ------------------------------------------------------------------ SyncBatchNorm

SPATIAL = {"1d": (), "1d-L": (5,), "2d": (4, 3), "3d": (2, 3, 2)}
REFERENCE = {"1d": torch.nn.BatchNorm1d, "1d-L": torch.nn.BatchNorm1d, "2d": torch.nn.BatchNorm2d,
             "3d": torch.nn.BatchNorm3d}


def check_sync_batch_norm(layout: str, dtype: torch.dtype, members: list[int], process_set, momentum,
                          seed: int) -> None:
    """Two training steps and an eval step against one BatchNorm over the members' concatenated batch."""
    channels = 3
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    sizes = [q + 2 for q in members]  # unequal batch sizes: rank q holds q + 2 samples
    me = members.index(R)
    start, n = sum(sizes[:me]), sizes[me]
    bn = hvd.SyncBatchNorm(channels, momentum=momentum, process_set=process_set).to(dtype)
    ref = REFERENCE[layout](channels, momentum=momentum).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(channels, generator=g, dtype=dtype) + 0.5)
        ref.bias.copy_(torch.randn(channels, generator=g, dtype=dtype))
        bn.weight.copy_(ref.weight)
        bn.bias.copy_(ref.bias)
    what = f"SyncBatchNorm {layout} {dtype} members {members} momentum {momentum}"
    for step in range(2):
        full = torch.randn(sum(sizes), channels, *SPATIAL[layout], generator=g, dtype=dtype) * 2 + 0.7
        upstream = torch.randn(full.shape, generator=g, dtype=dtype)
        x = full[start:start + n].clone().requires_grad_(True)
        y = bn(x)
        (y * upstream[start:start + n]).sum().backward()
        rx = full.clone().requires_grad_(True)
        ry = ref(rx)
        (ry * upstream).sum().backward()
        close(y, ry[start:start + n], tol, f"{what} step {step}: output")
        close(x.grad, rx.grad[start:start + n], tol, f"{what} step {step}: input gradient")
        # weight and bias gradients are this rank's share: their sum over the members is the whole batch's
        wsum = hvd.allreduce(bn.weight.grad, op=hvd.Sum, process_set=process_set)
        bsum = hvd.allreduce(bn.bias.grad, op=hvd.Sum, process_set=process_set)
        close(wsum, ref.weight.grad, tol * 10, f"{what} step {step}: weight gradient")
        close(bsum, ref.bias.grad, tol * 10, f"{what} step {step}: bias gradient")
        close(bn.running_mean, ref.running_mean, tol, f"{what} step {step}: running_mean")
        close(bn.running_var, ref.running_var, tol, f"{what} step {step}: running_var (unbiased)")
        assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
        for m in (bn, ref):
            m.zero_grad()
    bn.eval()
    ref.eval()
    full = torch.randn(sum(sizes), channels, *SPATIAL[layout], generator=g, dtype=dtype)
    close(bn(full[start:start + n]), ref(full)[start:start + n], tol, f"{what}: eval output")
    bn.train()


def check_sync_batch_norm_all() -> None:
    everyone = list(range(N))
    seed = 0
    for layout in SPATIAL:
        for dtype in (torch.float64, torch.float32):
            seed += 1
            check_sync_batch_norm(layout, dtype, everyone, hvd.global_process_set, 0.1, seed)
    check_sync_batch_norm("2d", torch.float64, everyone, hvd.global_process_set, None, 99)  # cumulative average
    if S.included():
        check_sync_batch_norm("2d", torch.float64, MEMBERS, S, 0.2, 100)
        check_sync_batch_norm("1d-L", torch.float32, MEMBERS, S, 0.1, 101)
    # convert_sync_batchnorm keeps parameters and running statistics
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3))
    net[1].running_mean.fill_(0.25)
    conv = hvd.SyncBatchNorm.convert_sync_batchnorm(net)
    assert isinstance(conv[1], hvd.SyncBatchNorm) and conv[1].weight is net[1].weight
    assert torch.equal(conv[1].running_mean, torch.full((3,), 0.25))
    out = conv(torch.randn(2, 2, 3, 3))
    assert out.shape == (2, 3, 3, 3)


if __name__ == "__main__":
    check_collectives_on_subset()
    check_optimizer_on_subset()
    check_sync_batch_norm_all()
    hvd.barrier()
    assert hvd.remove_process_set(S)
    print(f"WORKER OK rank={R}", flush=True)
    hvd.shutdown()
