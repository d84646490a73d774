"""DDP and collectives on the "ringcomm" torch.distributed backend, checked against gloo in the same job.

    python ddp_checks.py MODE[,MODE...] [--spawn NP PORT]

The default group runs on "ringcomm"; a second group over every rank runs on gloo
(``dist.new_group(backend="gloo")``), so each check compares the two side by side.  Started by
ringcomm-run or torchrun (``env://``), with ``--spawn`` by ``torch.multiprocessing.spawn``
with ``init_method="tcp://..."``, or with Slurm's variables (``SLURM_PROCID``, ``SLURM_NTASKS``)
and ``init_method="tcp://MASTER_ADDR:MASTER_PORT"``, as Slurm scripts do.  Prints ``MODE OK rank=R`` when every check passed.

Modes: ``equiv`` (DDP 20 steps on both backends from the same seed: parameters within 1e-6),
``collectives`` (every collective against gloo or NumPy), ``device`` (the collectives and DDP
through the fake device, checking where the device work is queued and waited for), ``hooks`` (fp16/bf16 compression and
PowerSGD comm hooks), ``fsdp`` (FSDP2, DTensor and functional collectives over a DeviceMesh), ``train`` (trains until killed: prints ``STEP n``; a failure prints
``CAUGHT`` with the error and exits 3), ``monitored`` (rank 1 arrives late at a monitored barrier).
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import ringcomm_torch.distributed  # noqa: F401  (registers "ringcomm")

R = dist.ReduceOp


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(ddp: nn.Module, rank: int, steps: int) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def check_equiv(rank: int, gloo: dist.ProcessGroup) -> None:
    on_rc = nn.parallel.DistributedDataParallel(model(7))
    on_gloo = nn.parallel.DistributedDataParallel(model(7), process_group=gloo)
    train(on_rc, rank, 20)
    train(on_gloo, rank, 20)
    diff = max_diff(on_rc.module, on_gloo.module)
    assert diff <= 1e-6, f"rank {rank}: ringcomm and gloo parameters differ by {diff}"
    flat = torch.cat([p.detach().reshape(-1) for p in on_rc.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    assert all(torch.equal(every[0], t) for t in every), "ranks disagree on the ringcomm model"
    print(f"rank {rank}: max |ringcomm - gloo| after 20 steps = {diff:.3g}", flush=True)


def check_compiled(rank: int, gloo: dist.ProcessGroup) -> None:
    """DDP under ``torch.compile`` (TorchDynamo, through AOTAutograd, no code generation) on each
    backend from one seed: the same parameters (1e-6) after 6 steps.  DDP's reducer calls the
    process group from C++ in the compiled forward, where TorchDynamo sees its Python frames."""
    trained = []
    for group in (None, gloo):
        ddp = nn.parallel.DistributedDataParallel(model(9), process_group=group)
        train(torch.compile(ddp, backend="aot_eager"), rank, 6)
        trained.append(ddp.module)
    diff = max_diff(*trained)
    assert diff <= 1e-6, f"rank {rank}: compiled DDP on ringcomm and on gloo differ by {diff}"


def both(fn, gloo: dist.ProcessGroup) -> tuple:  # type: ignore[no-untyped-def]
    return fn(None), fn(gloo)


def check_collectives(rank: int, gloo: dist.ProcessGroup) -> None:
    n = dist.get_world_size()
    base = torch.arange(6, dtype=torch.float64).reshape(2, 3) + rank + 1
    for op in (R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT):
        a, b = base.clone(), base.clone()
        dist.all_reduce(a, op=op)
        if op == R.AVG:  # gloo has no AVG: the sum over the size
            dist.all_reduce(b, op=R.SUM, group=gloo)
            b /= n
        else:
            dist.all_reduce(b, op=op, group=gloo)
        assert torch.allclose(a, b), (op, a, b)
    try:
        dist.all_reduce(base.clone(), op=R.BAND)
        raise AssertionError("BAND was accepted")
    except Exception as exc:
        assert "BAND" in str(exc) and "SUM" in str(exc), exc
    # async, in place, non-contiguous, bfloat16, int
    t = torch.ones(4, 4)[:, 1]  # non-contiguous view
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    assert torch.equal(t, torch.full((4,), float(n))), t
    bf = torch.full((5,), rank + 0.5, dtype=torch.bfloat16)
    dist.all_reduce(bf)
    assert torch.allclose(bf.float(), torch.full((5,), sum(r + 0.5 for r in range(n)))), bf
    ints = [torch.tensor([rank, 2 * rank], dtype=torch.int64), torch.tensor([1], dtype=torch.int64)]
    dist.all_reduce_coalesced(ints, op=R.SUM)
    assert ints[0].tolist() == [sum(range(n)), 2 * sum(range(n))] and ints[1].item() == n, ints
    # broadcast from every root
    for root in range(n):
        a = torch.full((3,), float(rank))
        dist.broadcast(a, root)
        assert torch.equal(a, torch.full((3,), float(root)))
    # allgather, allgather_into_tensor (+ coalesced through the coalescing manager)
    outs = [torch.empty(2, 2) for _ in range(n)]
    dist.all_gather(outs, torch.full((2, 2), float(rank)))
    assert all(torch.equal(o, torch.full((2, 2), float(r))) for r, o in enumerate(outs))
    big = torch.empty(n * 3)
    dist.all_gather_into_tensor(big, torch.full((3,), float(rank)))
    assert torch.equal(big, torch.arange(n).repeat_interleave(3).float()), big
    # as FSDP gathers: the input is this rank's own slice of the output (large: the ring; bfloat16 bits;
    # a non-contiguous output, which is written back after)
    for count, dtype in ((300_000, torch.float32), (5, torch.bfloat16)):
        flat = torch.zeros(n * count, dtype=dtype)
        mine = flat.narrow(0, rank * count, count)
        mine.copy_(torch.arange(count, dtype=torch.float32).to(dtype) + rank)
        dist.all_gather_into_tensor(flat, mine)
        want = torch.cat([torch.arange(count, dtype=torch.float32).to(dtype) + r for r in range(n)])
        assert torch.equal(flat, want), (count, dtype)
    strided = torch.zeros(n * 3, 2)[:, 0]
    dist.all_gather_into_tensor(strided, torch.full((3,), float(rank)))
    assert torch.equal(strided, torch.arange(n).repeat_interleave(3).float()), strided
    pg = dist.distributed_c10d._get_default_group()
    o1, o2 = torch.empty(n * 2), torch.empty(n, 1)
    pg.all_gather_single_coalesced([o1, o2], [torch.full((2,), float(rank)), torch.full((1,), rank * 10.0)]).wait()
    assert torch.equal(o1, torch.arange(n).repeat_interleave(2).float()) and o2.reshape(-1).tolist() == [
        10.0 * r for r in range(n)], (o1, o2)
    # reduce_scatter (list and tensor) against gloo's reduce_scatter_tensor
    inp = torch.arange(n * 4, dtype=torch.float32) * (rank + 1)
    a, b = torch.empty(4), torch.empty(4)
    dist.reduce_scatter_tensor(a, inp.clone())
    dist.reduce_scatter_tensor(b, inp.clone(), group=gloo)
    assert torch.equal(a, b), (a, b)
    c = torch.empty(4)
    dist.reduce_scatter(c, list(inp.clone().chunk(n)), op=R.MAX)
    assert torch.equal(c, inp.chunk(n)[rank] / (rank + 1) * n), c
    outs2 = [torch.empty(4), torch.empty(2)]
    pg.reduce_scatter_single_coalesced(outs2, [inp.clone(), torch.ones(2 * n)], dist.ReduceScatterOptions()).wait()
    assert torch.equal(outs2[0], b) and torch.equal(outs2[1], torch.full((2,), float(n))), outs2
    # alltoall (list and single, with and without splits)
    ins = [torch.full((r + 1,), float(10 * rank + r)) for r in range(n)]
    outs3 = [torch.empty(rank + 1) for _ in range(n)]
    dist.all_to_all(outs3, ins)
    assert all(torch.equal(o, torch.full((rank + 1,), float(10 * r + rank))) for r, o in enumerate(outs3)), outs3
    a2 = torch.arange(n * 2, dtype=torch.float32) + 100 * rank
    o_rc, o_gl = torch.empty(n * 2), torch.empty(n * 2)
    dist.all_to_all_single(o_rc, a2)
    dist.all_to_all_single(o_gl, a2, group=gloo)
    assert torch.equal(o_rc, o_gl), (o_rc, o_gl)
    in_splits = [r + 1 for r in range(n)]
    out_splits = [rank + 1] * n
    src = torch.arange(sum(in_splits), dtype=torch.float32) + 100 * rank
    o_rc, o_gl = torch.empty(sum(out_splits)), torch.empty(sum(out_splits))
    dist.all_to_all_single(o_rc, src, out_splits, in_splits)
    dist.all_to_all_single(o_gl, src, out_splits, in_splits, group=gloo)
    assert torch.equal(o_rc, o_gl), (o_rc, o_gl)
    # output_split_sizes on one rank that do not match what the ranks send: the op fails on every
    # rank (through the lane, and past its bound through the engine), naming the counts, and the
    # next op works
    wrong = [r + 1 for r in range(n)]
    wrong[0] += 1
    for width in (1, 1 << 17):
        bad = torch.empty(sum(wrong) if rank == 0 else sum(out_splits), width)
        rows = src.reshape(-1, 1).expand(-1, width).contiguous()
        try:
            dist.all_to_all_single(bad, rows, wrong if rank == 0 else out_splits, in_splits)
            raise AssertionError("all_to_all_single took output_split_sizes that do not match what arrives")
        except dist.DistBackendError as exc:
            assert f"rank 0 expects {wrong} rows from ranks {list(range(n))}, which send it {[1] * n}" in str(exc), exc
            assert "output_split_sizes against the others' input_split_sizes" in str(exc), exc
    # an argument refused on one rank (checked before the op starts) fails the op on every rank
    odd = torch.uint32 if rank == 0 else torch.float32  # a dtype ringcomm refuses, on rank 0
    refusals = [
        (f"the output's {n + 1} rows do not split evenly", lambda: dist.all_to_all_single(
            torch.empty(n + 1 if rank == n - 1 else n), torch.arange(float(n)))),
        ("input tensors at the root", lambda: dist.scatter(
            torch.empty(2), [torch.ones(2)] * (n + (rank == 0)) if rank == 0 else None, src=0)),
        ("the input must hold group size", lambda: dist.reduce_scatter_tensor(
            torch.empty(2), torch.ones(2 * n + (rank == n - 1)))),
        ("output tensors for a group", lambda: dist.all_gather(
            [torch.empty(1) for _ in range(n - (rank == 0))], torch.ones(1))),
        # checks of the op itself, its root or a tensor, failing on one rank only
        ("ReduceOp BAND is not supported", lambda: dist.all_reduce(
            torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND if rank == 0 else dist.ReduceOp.SUM)),
        (f"root {n} is not a rank of this group", lambda: dist.reduce(torch.ones(2), dst=n if rank == 1 else 0)),
        ("tensor dtype uint32 is not supported", lambda: dist.broadcast(
            torch.ones(2, dtype=torch.uint32 if rank == n - 1 else torch.float32), src=0)),
        ("tensor dtype uint32 is not supported", lambda: dist.reduce_scatter(
            torch.empty(1, dtype=odd), [torch.ones(1, dtype=odd)] * n)),
        ("sparse", lambda: dist.all_to_all_single(
            torch.empty(n), (torch.ones(n).to_sparse() if rank == 1 else torch.ones(n)))),
        ("tensor dtype uint32 is not supported", lambda: dist.gather(
            torch.ones(1, dtype=torch.uint32 if rank == 1 else torch.float32),
            [torch.empty(1) for _ in range(n)] if rank == 0 else None, dst=0)),
    ]
    for words, call in refusals:
        try:
            call()
            raise AssertionError(f"the call refused on one rank went through: {words}")
        except (dist.DistBackendError, ValueError, TypeError) as exc:
            assert words in str(exc), exc
    # scatter's outputs of another size than the root sends: every rank fails
    try:
        dist.scatter(torch.empty(3 if rank == n - 1 else 2), [torch.ones(2)] * n if rank == 0 else None, src=0)
        raise AssertionError("scatter took an output of another size than its part")
    except dist.DistBackendError as exc:
        assert f"rank {n - 1} expects" in str(exc), exc
    ok = torch.ones(1)
    dist.all_reduce(ok)
    assert ok.item() == n, ok
    # rows of no elements; all_to_all of tensors of other sizes for each rank (which gloo refuses),
    # from non-contiguous inputs into non-contiguous outputs (each written back after), in bfloat16
    dist.all_to_all_single(torch.empty(n, 0), torch.empty(n, 0))
    cols = [torch.arange(2.0 * (r + 1)).reshape(-1, 2)[:, 0] + 10 * rank for r in range(n)]
    for dtype in (torch.float32, torch.bfloat16):
        outs4 = [torch.empty(rank + 1, 2, dtype=dtype)[:, 1] for _ in range(n)]
        dist.all_to_all(outs4, [c.to(dtype) for c in cols])
        want4 = [(torch.arange(2.0 * (rank + 1)).reshape(-1, 2)[:, 0] + 10 * j).to(dtype) for j in range(n)]
        assert all(torch.equal(a, b) for a, b in zip(outs4, want4)), (outs4, want4)
    # rows of two columns, past the lane's bound (through the engine), into a CPU output
    big = torch.arange(n * 2 * (1 << 19), dtype=torch.float32).reshape(-1, 2) + 100 * rank
    o_rc, o_gl = torch.empty_like(big), torch.empty_like(big)
    dist.all_to_all_single(o_rc, big)
    dist.all_to_all_single(o_gl, big, group=gloo)
    assert torch.equal(o_rc, o_gl)
    # gather, scatter, reduce
    for root in (0, n - 1):
        got = [torch.empty(2) for _ in range(n)] if rank == root else None
        dist.gather(torch.full((2,), float(rank)), got, dst=root)
        if rank == root:
            assert all(torch.equal(g, torch.full((2,), float(r))) for r, g in enumerate(got)), got
        out = torch.empty(3)
        parts = [torch.full((3,), float(r * 7)) for r in range(n)] if rank == root else None
        dist.scatter(out, parts, src=root)
        assert torch.equal(out, torch.full((3,), float(rank * 7))), out
        # past the lane's bound (through the engine), and in bfloat16, beside gloo
        for numel, dtype in ((1 << 20, torch.float32), (5, torch.bfloat16)):
            parts = [torch.arange(numel, dtype=dtype) + r for r in range(n)] if rank == root else None
            o_rc, o_gl = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
            dist.scatter(o_rc, parts, src=root)
            dist.scatter(o_gl, parts, src=root, group=gloo)
            assert torch.equal(o_rc, o_gl), (numel, dtype, o_rc, o_gl)
        red = torch.full((2,), float(rank + 1))
        dist.reduce(red, dst=root)
        if rank == root:
            assert torch.equal(red, torch.full((2,), float(n * (n + 1) / 2))), red
        else:
            assert torch.equal(red, torch.full((2,), float(rank + 1))), red
    dist.barrier()
    # objects ride on allgather/broadcast
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(n)], objs
    # send/recv are refused with the call's name
    try:
        dist.send(torch.ones(1), dst=(rank + 1) % n)
        raise AssertionError("send was accepted")
    except Exception as exc:
        assert "send" in str(exc) and "gloo" in str(exc), exc
    # a group of some ranks runs on a ringcomm process set; the others are not members
    if n >= 3:
        sub = dist.new_group([0, n - 1])
        if rank in (0, n - 1):
            s = torch.full((2,), float(rank))
            dist.all_reduce(s, group=sub)
            assert torch.equal(s, torch.full((2,), float(n - 1))), s
            b2 = torch.full((1,), float(rank))
            dist.broadcast(b2, src=n - 1, group=sub)
            assert b2.item() == n - 1, b2
        dist.barrier()


def check_device(rank: int, gloo: dist.ProcessGroup) -> None:
    """The backend's device path, on the fake device (every tensor a device tensor): every collective,
    DDP and FSDP training give gloo's results; a DDP step (its hooks and its buffers' broadcast) and
    every ``async_op=True`` call only queue device work on the calling thread, and the stager waits
    for their copies to the host; a synchronous call waits for its own copy, on its own thread."""
    import threading

    from ringcomm_torch import device

    ops = device.FakeOps()
    with device.override(ops):
        check_collectives(rank, gloo)
        check_equiv(rank, gloo)
        check_fsdp(rank, gloo)
        me, stager = threading.current_thread().name, "ringcomm-torch-stager"
        for root in range(dist.get_world_size()):  # one copy each: the root's to the host, the others' home
            for async_op in (False, True):
                t = torch.full((5,), float(rank))
                copies, mine, staged = ops.count("copy"), ops.count("wait_event", me), ops.count("wait_event", stager)
                work = dist.broadcast(t, src=root, async_op=async_op)
                if async_op:
                    assert ops.count("wait_event", me) == mine, f"rank {rank}: an async call waited for the device"
                    work.wait()
                assert t.tolist() == [float(root)] * 5, f"rank {rank}: broadcast from {root}: {t}"
                assert ops.count("copy") - copies == 1, f"rank {rank}: {ops.count('copy') - copies} copies, root {root}"
                waited = (ops.count("wait_event", me) - mine, ops.count("wait_event", stager) - staged)
                assert waited == ((0, rank == root) if async_op else (rank == root, 0)), \
                    f"rank {rank}: device waits (here, stager) {waited}, root {root}, async_op={async_op}"
        ddp = nn.parallel.DistributedDataParallel(model(5))
        mine = ops.count("wait_event", me)
        train(ddp, rank, 2)  # hooks on this thread (autograd runs CPU tensors' backward here)
        assert ops.count("wait_event", me) == mine, f"rank {rank}: a DDP step waited for the device"
    waited_on = {t for c, t in ops.calls if c == "wait_event"}
    assert waited_on <= {stager, me}, f"rank {rank}: device waits on threads {waited_on}"
    here = [c for c, t in ops.calls if t == me]
    assert here.count("copy") > 50 and here.count("stream_wait") > 50, f"rank {rank}: {len(here)} calls here"
    home = ops.count("copy", "ringcomm-torch-completer")  # the results, queued as each op completes
    assert home > 50, f"rank {rank}: {home} copies home on the backend's completer"


def check_fsdp(rank: int, gloo: dist.ProcessGroup) -> None:
    """FSDP2 (``fully_shard``) over a DeviceMesh of each backend from one seed: the same parameters
    (1e-6) after 10 steps, shards of uneven sizes at np 3, and HSDP over a 2-D "ringcomm" mesh at
    an even np of 4 or more; a DTensor made whole and the functional
    collectives over the "ringcomm" mesh give the arithmetic's results; then
    :func:`check_fsdp_mixed_precision_and_checkpoint`."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    n = dist.get_world_size()
    meshes = {"ringcomm": init_device_mesh("cpu", (n,)), "gloo": DeviceMesh.from_group(gloo, "cpu")}
    assert meshes["ringcomm"].get_group().group_name == dist.distributed_c10d._get_default_group().group_name
    trained = {}
    for backend, mesh in meshes.items():
        net = model(11)
        for layer in net:
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        train(net, rank, 10)
        trained[backend] = [p.full_tensor() for p in net.parameters()]
    if n >= 4 and n % 2 == 0:  # HSDP: shards within each half of the ranks, replicas across the halves
        hybrid = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
        net = model(11)
        fully_shard(net, mesh=hybrid)
        train(net, rank, 10)
        trained["ringcomm hybrid"] = [p.full_tensor() for p in net.parameters()]
    diff = max(float((a - b).detach().abs().max()) for name in trained if name != "gloo"
               for a, b in zip(trained[name], trained["gloo"]))
    assert diff <= 1e-6, f"rank {rank}: FSDP on ringcomm and on gloo differ by {diff}"
    mesh = meshes["ringcomm"]
    whole = torch.arange(5 * n * 2, dtype=torch.float32).reshape(5 * n, 2)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    assert sharded.to_local().shape == (5, 2) and torch.equal(sharded.full_tensor(), whole)
    mine = torch.arange(4.0) + rank
    summed = funcol.all_reduce(mine, "sum", mesh)
    assert torch.equal(summed, torch.arange(4.0) * n + sum(range(n))), summed
    gathered = funcol.all_gather_tensor(mine, 0, mesh)
    assert torch.equal(gathered, torch.cat([torch.arange(4.0) + r for r in range(n)])), gathered
    print(f"rank {rank}: FSDP max |ringcomm - gloo| after 10 steps = {diff:.3g}", flush=True)
    check_fsdp_mixed_precision_and_checkpoint(rank, meshes)


def check_fsdp_mixed_precision_and_checkpoint(rank: int, meshes: dict) -> None:
    """FSDP2 with bfloat16 parameters and float32 gradient reduction, no resharding after forward and
    two micro-batches per step (``set_requires_gradient_sync``), AdamW, on each backend's mesh from
    one seed: the same parameters (1e-6); then torch.distributed.checkpoint saves the "ringcomm"
    model and optimizer, and loading them back undoes a change to every parameter."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    trained = {}
    for backend, mesh in meshes.items():
        net = model(13)
        for layer in net:
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        fully_shard(net, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for step in range(6):
            net.set_requires_gradient_sync(step % 2 == 1)
            x, y = batch(rank, step)
            nn.functional.cross_entropy(net(x).float(), y).backward()
            if step % 2 == 1:
                opt.step()
                opt.zero_grad()
        trained[backend] = (net, opt)
    params = {b: [p.full_tensor().detach() for p in net.parameters()] for b, (net, _) in trained.items()}
    diff = max(float((a - b).abs().max()) for a, b in zip(params["ringcomm"], params["gloo"]))
    assert diff <= 1e-6, f"rank {rank}: mixed-precision FSDP on ringcomm and on gloo differ by {diff}"
    net, opt = trained["ringcomm"]
    where = [tempfile.mkdtemp(prefix="ringcomm-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    dcp.save({"model": net.state_dict(), "optim": opt.state_dict()}, checkpoint_id=where[0])
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    state = {"model": net.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=where[0])
    net.load_state_dict(state["model"])
    back = [p.full_tensor().detach() for p in net.parameters()]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where[0], ignore_errors=True)
    assert all(torch.equal(a, b) for a, b in zip(back, params["ringcomm"])), f"rank {rank}: the checkpoint did not load"
    print(f"rank {rank}: mixed-precision FSDP max |ringcomm - gloo| = {diff:.3g}; checkpoint round trip ok", flush=True)


def check_hooks(rank: int, gloo: dist.ProcessGroup) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    # torch's DDP accepts bf16_compress_hook only with CUDA and NCCL (whatever the backend)
    names = ("fp16", "bf16", "powersgd") if torch.cuda.is_available() else ("fp16", "powersgd")
    for name in names:
        models = []
        for group in (None, gloo):
            ddp = nn.parallel.DistributedDataParallel(model(3), process_group=group)
            if name == "fp16":
                ddp.register_comm_hook(group, dh.fp16_compress_hook)
            elif name == "bf16":
                ddp.register_comm_hook(group, dh.bf16_compress_hook)
            else:
                state = ps.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                         use_error_feedback=True, warm_start=True, random_seed=0)
                ddp.register_comm_hook(state, ps.powerSGD_hook)
            train(ddp, rank, 6)
            models.append(ddp.module)
        diff = max_diff(*models)
        assert diff <= 1e-3, f"{name} hook: ringcomm and gloo differ by {diff}"
        print(f"rank {rank}: {name} hook: max |ringcomm - gloo| = {diff:.3g}", flush=True)


def run_train(rank: int) -> None:
    ddp = nn.parallel.DistributedDataParallel(model(1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    step = 0
    try:
        while True:
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            if step % 5 == 0:
                print(f"STEP {step} rank={rank} pid={os.getpid()}", flush=True)
            step += 1
            time.sleep(0.02)
    except Exception as exc:
        print(f"CAUGHT rank={rank} {type(exc).__name__} at {time.time():.3f}: {exc}", flush=True)
        try:  # a collective after the loss fails at once, as torch's DistBackendError
            dist.all_reduce(torch.ones(1))
            print(f"THEN rank={rank} the next all_reduce passed", flush=True)
        except Exception as again:
            print(f"THEN rank={rank} {type(again).__name__}: {again}", flush=True)
        os._exit(3)


def run_monitored(rank: int) -> None:
    if rank == 1:
        time.sleep(4.0)
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=2), wait_all_ranks=True)
        print(f"MONITORED passed rank={rank}", flush=True)
    except Exception as exc:
        print(f"MONITORED rank={rank} {type(exc).__name__}: {exc}", flush=True)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))  # everyone arrives: passes


def main(rank: int, mode: str, init_method: str | None = None, world: int | None = None) -> None:
    if init_method:
        dist.init_process_group("ringcomm", init_method=init_method, rank=rank, world_size=world)
    else:
        dist.init_process_group("ringcomm")
    rank = dist.get_rank()
    assert dist.get_backend() == "ringcomm"
    gloo = dist.new_group(backend="gloo")
    for one in mode.split(","):  # several modes in one job: torch's start-up is paid once
        if one == "equiv":
            check_equiv(rank, gloo)
        elif one == "collectives":
            check_collectives(rank, gloo)
        elif one == "compile":
            check_compiled(rank, gloo)
        elif one == "hooks":
            check_hooks(rank, gloo)
        elif one == "fsdp":
            check_fsdp(rank, gloo)
        elif one == "device":
            check_device(rank, gloo)
        elif one == "train":
            run_train(rank)
        elif one == "monitored":
            run_monitored(rank)
        else:
            raise SystemExit(f"unknown mode {one!r}")
        print(f"{one.upper()} OK rank={rank}", flush=True)
    dist.destroy_process_group()


def _spawned(rank: int, mode: str, world: int, port: int) -> None:
    main(rank, mode, f"tcp://127.0.0.1:{port}", world)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "--spawn":
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(sys.argv[1], int(sys.argv[3]), int(sys.argv[4])), nprocs=int(sys.argv[3]))
    elif "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        # as Slurm scripts do: rank and size from srun's variables, the address from the job script
        main(int(os.environ["SLURM_PROCID"]), sys.argv[1],
             f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", int(os.environ["SLURM_NTASKS"]))
    else:
        main(int(os.environ.get("RANK", "0")), sys.argv[1])
