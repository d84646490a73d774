"""DistributedOptimizer's device path, run on CPU through the fake device operations.

``device.override(FakeOps())`` makes the optimizer treat every parameter as a device
parameter: buckets pack gradients, copy them "device to host" on a side stream and hand
them to the core from the stager thread once the copy's event fires.  The fake records
each call with its thread and, while held, keeps events not ready and the copies'
destinations full of NaN, so reading too early shows.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

import ringcomm as rc  # noqa: E402
import ringcomm_torch as hvd  # noqa: E402
from ringcomm_torch import buckets, device  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


def model_and_opt(ops, widths=(8, 16, 16, 4), x=None, **kwargs):
    """A model and its optimizer over ``ops``; with ``x``, also the gradients of one local pass."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = torch.nn.Sequential(*layers)
    grads = None if x is None else local_grads(model, x)
    model.zero_grad()
    with device.override(ops):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **kwargs)
    return (model, opt) if x is None else (model, opt, grads)


def local_grads(model, x):
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_bucket_plan_has_a_small_first_bucket_then_ddp_sized_ones():
    mib = 1 << 20
    assert buckets.plan_buckets([mib // 2, mib // 2, mib, 10 * mib, 20 * mib], mib, 25 * mib) == [[0, 1], [2, 3], [4]]
    assert buckets.plan_buckets([3 * mib, 30 * mib, 1], mib, 25 * mib) == [[0], [1], [2]]  # too large: alone
    assert buckets.plan_buckets([5, 5, 5], 0, 0) == [[0], [1], [2]]
    assert buckets.bucket_caps(64 * mib, 25 * mib) == (mib, 25 * mib)  # the defaults: DDP's
    assert buckets.bucket_caps(8 * mib, 25 * mib) == (mib, 8 * mib)  # the fusion threshold caps them
    assert buckets.bucket_caps(64 * mib, mib // 2) == (mib // 2, mib // 2)  # and RINGCOMM_BUCKET_BYTES
    assert buckets.bucket_caps(64 * mib, 0) == (0, 0)  # RINGCOMM_BUCKET_BYTES=0: one op per parameter


def test_hook_queues_without_waiting_data_is_poison_until_the_event_fires_and_results_are_bitwise_right():
    ops = device.FakeOps()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))  # the same on every rank
    # every rank has the same gradients: their average is the local gradient, bitwise (at 1, 2, 4 ranks)
    model, opt, expected = model_and_opt(ops, x=x)
    submitted = []
    real = rc.allreduce_async

    def spy(arr, *args, **kwargs):
        submitted.append(arr.copy())
        return real(arr, *args, **kwargs)

    ops.hold()
    hook_thread = threading.current_thread().name
    try:
        rc.allreduce_async, started = spy, time.monotonic()
        model(x).square().sum().backward()  # the hooks run on this thread and must not wait
        assert time.monotonic() - started < 5
        assert ops.count("wait_event", hook_thread) == 0  # no synchronize of any kind on the hook's thread
        assert not submitted  # the stager waits for the event: nothing reached the core
        bucket = next(iter(opt.reducer.device_buckets.values()))
        assert torch.isnan(bucket._pinned.view(torch.float32)).all()  # the copy has not happened
        ops.fire()
        opt.synchronize()
    finally:
        rc.allreduce_async = real
    assert submitted and not any(a.dtype.kind == "f" and (a != a).any() for a in submitted)
    for p, g in zip(model.parameters(), expected):
        assert torch.equal(p.grad, g)
    assert ops.count("wait_event", hook_thread) == 0
    assert ops.count("wait_event", "ringcomm-torch-stager") >= 1


def test_one_copy_each_way_per_bucket_and_no_pinned_allocation_after_the_first_step():
    ops = device.FakeOps()
    model, opt = model_and_opt(ops, widths=(32,) * 12)  # 22 tensors, one small first bucket
    n = len(opt.reducer.device_buckets)
    assert n >= 1 and sum(len(k) for k in opt.reducer.device_buckets) == 22
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))  # the same on every rank
    for step in range(3):
        before = ops.count("copy")
        packs, unpacks = ops.count("pack"), ops.count("unpack")
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        assert ops.count("copy") - before == 2 * n  # device->host and host->device, once per bucket
        # zero_grad() sets the gradients to None: each step packs them anew into the buckets, whose
        # views they then become, so the results need no copy back (test_device_return.py)
        assert ops.count("pack") - packs == n and ops.count("unpack") - unpacks == 0
        if step == 0:
            allocated = ops.pinned_allocations
            assert allocated == n
    assert ops.pinned_allocations == allocated


def resnet18_shapes():
    """The 62 parameter tensors of torchvision's resnet18 (11.7 M floats, 47 MB)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            first_in = cin if block == 0 else cout
            shapes += [(cout, first_in, 3, 3), (cout,), (cout,), (cout, cout, 3, 3), (cout,), (cout,)]
            if block == 0 and (stride != 1 or cin != cout):
                shapes += [(cout, cin, 1, 1), (cout,), (cout,)]
        cin = cout
    return shapes + [(1000, 512), (1000,)]


def test_a_resnet18_shaped_model_makes_one_core_op_per_bucket():
    shapes = resnet18_shapes()
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    assert len(params) == 62 and 46e6 < sum(p.numel() for p in params) * 4 < 48e6
    ops = device.FakeOps()
    with device.override(ops):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                       named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
    sizes = [sum(p.numel() * 4 for p in b) for b in opt.reducer.device_buckets]
    assert sizes[0] <= buckets.FIRST_BUCKET_BYTES or len(next(iter(opt.reducer.device_buckets))) == 1
    assert len(sizes) <= 4 and all(s <= buckets.BUCKET_BYTES or len(b) == 1
                                   for s, b in zip(sizes, opt.reducer.device_buckets))
    calls = []
    real = rc.allreduce_async

    def spy(arr, *args, **kwargs):
        calls.append(kwargs.get("name"))
        return real(arr, *args, **kwargs)

    rc.allreduce_async = spy
    try:
        loss = sum((p * 0.5).sum() for p in params)
        loss.backward()
        opt.step()
    finally:
        rc.allreduce_async = real
    assert len(calls) == len(opt.reducer.device_buckets)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in params)


def test_device_buckets_keep_horovod_semantics():
    ops = device.FakeOps()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))  # the same on every rank
    # compression, backward_passes_per_step, zero_grad refusal, skip_synchronize, groups=
    model, opt, grads = model_and_opt(ops, x=x, compression=hvd.Compression.fp16, backward_passes_per_step=2)
    ref = [(g * 2).to(torch.float16).to(torch.float32) for g in grads]
    model(x).square().sum().backward()
    with pytest.raises(AssertionError):
        opt.zero_grad()  # a pass is accumulated locally: refused until step()
    model(x).square().sum().backward()
    opt.synchronize()
    for p, g in zip(model.parameters(), ref):
        assert torch.allclose(p.grad, g, rtol=1e-3, atol=1e-3)
    with opt.skip_synchronize():
        opt.step()
    model, opt, expected = model_and_opt(ops, x=x, groups=2)
    assert len(opt.reducer.device_buckets) == 2
    model(x).square().sum().backward()
    opt.step()
    for p, g in zip(model.parameters(), expected):
        assert torch.equal(p.grad, g)


def test_a_collective_on_staged_device_data_is_named_now_and_submitted_once_the_copy_is_done():
    """hvd.*_async on CUDA tensors: the caller returns before the copy to the host is done; the
    op takes its automatic name at the call (program order) and reaches the core afterwards."""
    import numpy as np

    from ringcomm_torch import collectives
    from ringcomm_torch.tensors import Staged

    ops = device.FakeOps()
    ops.hold()
    ready = ops.event()
    ops.record(ready, "side")  # held: not ready
    arr = np.ones(4, np.float32)
    s = Staged(arr, torch.float32, torch.float32, torch.device("cpu"), False, None, None, ready,
               device.service(ops, torch.device("cpu")))
    names = []
    with device.override(ops):
        core = collectives._start([s], "allreduce", None, hvd.global_process_set,
                                  lambda nm: names.append(nm) or rc.allreduce_async(arr, name=nm, out=arr))
    time.sleep(0.05)
    assert not names and not core.done()  # the stager waits for the copy
    later = rc.allreduce_async(np.ones(2, np.float32))  # an unnamed op submitted after it, on the host
    ops.fire()
    assert np.array_equal(core.wait(), np.ones(4, np.float32))
    later.wait()
    assert names[0].startswith("allreduce.noname.")
    assert int(names[0].rsplit(".", 1)[1]) + 1 == int(later.name.rsplit(".", 1)[1])  # numbered in call order


def test_the_benchmarks_built_in_resnet18_has_torchvisions_parameter_shapes():
    from ringcomm.bench._train_worker import ResNet18Shape

    assert [tuple(p.shape) for p in ResNet18Shape().parameters()] == resnet18_shapes()


class _Doubled:
    """A core handle whose results come out doubled: what Sum over two ranks with equal inputs gives."""

    def __init__(self, handle, outs):
        self.handle, self.outs, self.name = handle, outs, handle.name

    def done(self):
        return self.handle.done()

    def wait(self):
        result = self.handle.wait()
        for out in self.outs:
            out *= 2
        return result


@pytest.mark.parametrize("kind", ["host", "device"])
def test_sparse_as_dense_gradients_get_the_reduced_values_in_a_bucket(monkeypatch, kind):
    """A sparse gradient reduced as dense is a copy: the bucket must write the result back to it,
    whether the bucket is a host one (views of a flat buffer) or a device one."""
    real_one, real_group = rc.allreduce_async, rc.grouped_allreduce_async

    def one(array, *args, out=None, **kwargs):
        return _Doubled(real_one(array, *args, out=out, **kwargs), [array if out is None else out])

    def group(arrays, *args, outs=None, **kwargs):
        return _Doubled(real_group(arrays, *args, outs=outs, **kwargs), list(arrays if outs is None else outs))
    monkeypatch.setattr(rc, "allreduce_async", one)
    monkeypatch.setattr(rc, "grouped_allreduce_async", group)
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2)
    named = [("emb.weight", emb.weight), ("lin.weight", lin.weight), ("lin.bias", lin.bias)]
    x = torch.tensor([1, 3, 3])
    # the local gradients come from a pass before the optimizer exists: once its hooks start a
    # bucket during backward(), the bucket reduces in place, so .grad may hold the sum already
    lin(emb(x)).sum().backward()
    local = {n: p.grad.to_dense().clone() for n, p in named}
    for _, p in named:
        p.grad = None
    with device.override(device.FakeOps() if kind == "device" else None):
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.0), named_parameters=named,
                                       sparse_as_dense=True, op=hvd.Sum)
    assert len(opt.reducer.host_buckets if kind == "host" else opt.reducer.device_buckets) == 1
    lin(emb(x)).sum().backward()
    opt.synchronize()
    for n, p in named:  # every rank has the same gradients: the real Sum, then doubled
        assert torch.equal(p.grad.to_dense(), 2 * hvd.size() * local[n]), n


def test_a_group_key_hashes_by_identity_and_stays_a_tuple() -> None:
    a, b = torch.zeros(2), torch.ones(3)
    key = buckets.GroupKey([a, b])
    assert {key: 1}[key] == 1 and key == key
    assert key != buckets.GroupKey([a, b]) and key not in {buckets.GroupKey([a, b]): 1}
    assert len(key) == 2 and key[0] is a and list(key) == [a, b]
    calls = []
    original = torch.Tensor.__hash__
    try:  # a lookup never hashes the member tensors
        torch.Tensor.__hash__ = lambda t: calls.append(t) or original(t)  # type: ignore[method-assign]
        _ = {key: 1}[key]
    finally:
        torch.Tensor.__hash__ = original  # type: ignore[method-assign]
    assert calls == []
