"""ringcomm_torch in one process (size 1, no launcher): every Horovod name, shapes, dtypes, errors."""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")

import ringcomm_torch as hvd  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    assert hvd.size() == 1, "run these tests without a launcher"
    yield
    hvd.shutdown()  # the next module starts from no job, whatever order the files run in


API_NAMES = """
init shutdown is_initialized rank size local_rank local_size cross_rank cross_size
Sum Average Min Max Product Adasum
allreduce allreduce_ allreduce_async allreduce_async_
grouped_allreduce grouped_allreduce_ grouped_allreduce_async grouped_allreduce_async_
allgather allgather_async grouped_allgather grouped_allgather_async
broadcast broadcast_ broadcast_async broadcast_async_
alltoall alltoall_async reducescatter reducescatter_async grouped_reducescatter grouped_reducescatter_async
barrier join poll synchronize
Compression DistributedOptimizer broadcast_parameters broadcast_optimizer_state broadcast_object allgather_object
HorovodInternalError start_timeline stop_timeline
mpi_threads_supported nccl_built gloo_enabled gloo_built mpi_enabled mpi_built cuda_built rocm_built
ProcessSet global_process_set
""".split()


def test_every_horovod_name_exists():
    missing = [n for n in API_NAMES if not hasattr(hvd, n)]
    assert not missing
    assert hvd.mpi_threads_supported() is False and hvd.nccl_built() == 0 and hvd.mpi_built() is False
    assert hvd.gloo_enabled() is False and hvd.gloo_built() is False and hvd.mpi_enabled() is False
    assert hvd.cuda_built() == torch.backends.cuda.is_built()
    assert hvd.is_initialized() and hvd.rank() == 0 and hvd.local_rank() == 0
    assert hvd.local_size() == 1 and hvd.cross_rank() == 0 and hvd.cross_size() == 1
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_sparse_allreduce_on_one_rank_returns_the_entries_and_refuses_dense_tensors():
    t = torch.sparse_coo_tensor(torch.tensor([[0, 2, 2]]), torch.tensor([1.0, 5.0, 1.0]), (4,),
                                check_invariants=False)
    h = hvd.sparse_allreduce_async(t, name="single.sparse", op=hvd.Sum)
    assert torch.equal(h().coalesce().to_dense(), torch.tensor([1.0, 0.0, 6.0, 0.0]))
    assert torch.equal(hvd.synchronize(h).to_dense(), t.to_dense())
    with pytest.raises(TypeError, match="sparse COO tensor"):
        hvd.sparse_allreduce_async(torch.ones(2), name="single.dense", op=hvd.Sum)
    with pytest.raises(TypeError, match="op="):
        hvd.sparse_allreduce_async(t, name="single.max", op=hvd.Max)
    with pytest.raises(AttributeError, match="no attribute"):
        hvd.no_such_name  # noqa: B018


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.uint8, torch.int8, torch.int16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_collectives_keep_shape_dtype_and_values(dtype):
    t = (torch.arange(12) % 7).reshape(4, 3).to(dtype)
    for out in (hvd.allreduce(t, op=hvd.Sum), hvd.allreduce(t, op=hvd.Max), hvd.broadcast(t, 0),
                hvd.allgather(t), hvd.alltoall(t), hvd.reducescatter(t, op=hvd.Sum)):
        assert out.dtype == dtype and out.shape == t.shape and torch.equal(out, t)
        assert out.data_ptr() != t.data_ptr()
    avg = hvd.allreduce(t)
    assert avg.dtype == dtype and torch.equal(avg, t)
    assert [x.dtype for x in hvd.grouped_allreduce([t, t])] == [dtype, dtype]
    assert [x.shape for x in hvd.grouped_allgather([t, t[:1]])] == [t.shape, (1, 3)]
    assert [x.shape for x in hvd.grouped_reducescatter([t, t[:2]], op=hvd.Sum)] == [t.shape, (2, 3)]


def test_bool_tensors():
    t = torch.tensor([True, False, True])
    assert torch.equal(hvd.allreduce(t, op=hvd.Max), t)
    assert torch.equal(hvd.allgather(t), t)
    assert hvd.broadcast(t, 0).dtype == torch.bool
    with pytest.raises(TypeError):
        hvd.allreduce(t)  # Average is not defined for bool


def test_in_place_and_async_variants_return_the_same_tensor():
    t = torch.arange(6, dtype=torch.float32)
    assert hvd.allreduce_(t) is t
    assert hvd.broadcast_(t, 0) is t
    h = hvd.allreduce_async_(t, op=hvd.Sum, name="single.inplace")
    assert isinstance(h, hvd.Handle)
    assert hvd.synchronize(h) is t
    assert hvd.poll(h) is True
    h = hvd.allreduce_async(t, name="single.async")
    r = hvd.synchronize(h)
    assert r is not t and torch.equal(r, t)
    assert hvd.synchronize(hvd.broadcast_async_(t, 0)) is t
    ts = [t.clone(), t.clone().double()]
    assert all(a is b for a, b in zip(hvd.grouped_allreduce_(ts), ts))
    assert all(a is b for a, b in zip(hvd.synchronize(hvd.grouped_allreduce_async_(ts)), ts))
    out, splits = hvd.synchronize(hvd.alltoall_async(t))
    assert torch.equal(out, t) and splits.tolist() == [6] and splits.dtype == torch.int32
    assert torch.equal(hvd.synchronize(hvd.allgather_async(t)), t)
    assert torch.equal(hvd.synchronize(hvd.reducescatter_async(t)), t)
    assert len(hvd.synchronize(hvd.grouped_allgather_async([t, t]))) == 2
    assert len(hvd.synchronize(hvd.grouped_reducescatter_async([t]))) == 1
    assert hvd.grouped_allreduce([]) == []


def test_alltoall_returns_splits_only_when_given():
    t = torch.arange(4.0)
    assert isinstance(hvd.alltoall(t), torch.Tensor)
    out, recv = hvd.alltoall(t, splits=torch.tensor([4], dtype=torch.int64))
    assert torch.equal(out, t) and recv.dtype == torch.int64 and recv.tolist() == [4]
    out, recv = hvd.alltoall(t, splits=[4])
    assert recv.dtype == torch.int32


def test_scale_factors_and_legacy_average():
    t = torch.ones(3)
    assert torch.allclose(hvd.allreduce(t, prescale_factor=2.0, postscale_factor=3.0), torch.full((3,), 6.0))
    with pytest.warns(DeprecationWarning):
        assert torch.equal(hvd.allreduce(t, average=False), t)
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(t, average=True, op=hvd.Sum)


def test_non_contiguous_and_0d_tensors():
    base = torch.arange(12.0).reshape(3, 4)
    view = base.t()
    assert not view.is_contiguous()
    assert hvd.allreduce_(view, op=hvd.Sum) is view
    assert torch.equal(base, torch.arange(12.0).reshape(3, 4))
    assert torch.equal(hvd.allreduce(view), view)
    assert torch.equal(hvd.broadcast(view, 0), view)
    scalar = torch.tensor(5.0)
    assert hvd.allreduce(scalar).shape == () and hvd.broadcast(scalar, 0).item() == 5.0


def test_bfloat16_broadcast_is_bit_exact():
    t = torch.randn(100).bfloat16()
    assert torch.equal(hvd.broadcast(t, 0).view(torch.int16), t.view(torch.int16))
    assert torch.equal(hvd.allgather(t).view(torch.int16), t.view(torch.int16))


def test_invalid_inputs_raise_at_the_call():
    with pytest.raises(TypeError, match="complex64"):
        hvd.allreduce(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="process_set"):
        hvd.allreduce(torch.zeros(2), process_set=hvd.ProcessSet([0, 5]))
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.zeros(2), root_rank=3)
    with pytest.raises(TypeError):
        hvd.synchronize(42)


def test_autograd_at_size_one_is_identity():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(4, 3)
    for fn in (lambda a: hvd.allreduce(a), lambda a: hvd.allreduce(a, op=hvd.Sum), hvd.allgather,
               lambda a: hvd.broadcast(a, 0), hvd.alltoall, hvd.reducescatter,
               lambda a: hvd.alltoall(a, splits=[4])[0],
               lambda a: hvd.grouped_allreduce([a])[0], lambda a: hvd.grouped_allgather([a])[0],
               lambda a: hvd.grouped_reducescatter([a])[0],
               lambda a: hvd.allreduce(a, compression=hvd.Compression.fp16)):
        x.grad = None
        (fn(x) * w).sum().backward()
        assert torch.allclose(x.grad, w, atol=1e-2), fn


def test_a_result_is_in_the_graph_only_when_autograd_records_the_input():
    ops = (hvd.allreduce, hvd.allgather, lambda a: hvd.broadcast(a, 0), lambda a: hvd.grouped_allreduce([a])[0])
    for fn in ops:
        plain = fn(torch.ones(3))  # grad mode on, the input needs no grad: no graph, a new tensor
        assert plain.grad_fn is None and not plain.requires_grad and plain.tolist() == [1.0, 1.0, 1.0]
        x = torch.ones(3, requires_grad=True)
        assert fn(x).grad_fn is not None, fn
        with torch.no_grad():
            quiet = fn(x)
        assert quiet.grad_fn is None and not quiet.requires_grad, fn
        t = torch.ones(3)
        y = fn(t)
        y.add_(1)  # the result is the caller's own: changing it leaves the input alone
        assert y.tolist() == [2.0, 2.0, 2.0] and t.tolist() == [1.0, 1.0, 1.0], fn


def test_fp16_compression_round_trip():
    t = torch.randn(10, dtype=torch.float64)
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16 and ctx == torch.float64
    back = hvd.Compression.fp16.decompress(c, ctx)
    assert back.dtype == torch.float64 and torch.allclose(back, t, atol=1e-2)
    i = torch.arange(3)
    ci, ctx = hvd.Compression.fp16.compress(i)
    assert ci is i and hvd.Compression.fp16.decompress(ci, ctx) is i
    c, ctx = hvd.Compression.none.compress(t)
    assert c is t and hvd.Compression.none.decompress(c, ctx) is t
    r = hvd.allreduce(t, compression=hvd.Compression.fp16)
    assert r.dtype == torch.float64 and torch.allclose(r, t, atol=1e-2)


def test_timeline_records_ops(tmp_path):
    path = tmp_path / "tl.json"
    hvd.start_timeline(str(path), mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="timeline.x")
    hvd.broadcast(torch.ones(3), 0, name="timeline.y")
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    _backward(model)
    opt.step()
    hvd.stop_timeline()
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    trace = json.loads(files[0].read_text())
    names = [e["args"]["name"] for e in trace if e.get("name") == "process_name"]
    assert "allreduce.timeline.x" in names and "broadcast.timeline.y" in names
    # the gradients go in one bucket, named after the first gradient backward produces
    assert "allreduce.2.bias" in names and "allreduce.0.weight" not in names
    pid = next(e["pid"] for e in trace if e.get("name") == "process_name" and e["args"]["name"] == "allreduce.2.bias")
    # one flat buffer of the four gradients; its BUCKET_PACK phase names them
    (packed,) = [e["args"]["parameters"] for e in trace if e.get("pid") == pid and e.get("name") == "BUCKET_PACK"]
    assert sorted(packed) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    hvd.stop_timeline()  # second stop is a no-op


def test_bucket_bytes_zero_gives_one_op_per_parameter_named_as_horovod_does(tmp_path, monkeypatch):
    import dataclasses

    from ringcomm import runtime

    rt = runtime.active()
    monkeypatch.setattr(rt, "settings", dataclasses.replace(rt.settings, bucket_bytes=0))
    path = tmp_path / "tl.json"
    hvd.start_timeline(str(path))
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    _backward(model)
    opt.step()
    hvd.stop_timeline()
    names = {e["args"]["name"] for e in json.loads(path.read_text()) if e.get("name") == "process_name"}
    assert {"allreduce.0.weight", "allreduce.0.bias", "allreduce.2.weight", "allreduce.2.bias"} <= names


def test_host_buckets_follow_reverse_parameter_order_the_byte_caps_and_the_dtype(monkeypatch):
    import dataclasses

    from ringcomm import runtime
    from ringcomm_torch.buckets import HostBucket

    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in
              ((100, torch.float32), (300, torch.float32), (10, torch.float32), (2000, torch.float32),
               (5, torch.float64), (7, torch.float64))]
    rt = runtime.active()
    # caps of 1600 bytes (the first bucket and the others): 2000 floats are a bucket of their own
    monkeypatch.setattr(rt, "settings", dataclasses.replace(rt.settings, bucket_bytes=1600))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                   named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
    groups = {tuple(p.numel() for p in g) for g in opt.reducer.group_of.values()}
    assert groups == {(7, 5), (10, 300), }  # reverse order, one dtype each; lone ones stay ungrouped
    assert all(isinstance(b, HostBucket) for b in opt.reducer.host_buckets.values()) and len(opt.reducer.host_buckets) == 2
    monkeypatch.setattr(rt, "settings", dataclasses.replace(rt.settings, bucket_bytes=1 << 30))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                   named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
    # the first bucket is at most 1 MiB, the others at most the cap
    assert {tuple(p.numel() for p in g) for g in opt.reducer.group_of.values()} == {(7, 5), (2000, 10, 300, 100)}


def test_objects_barrier_join():
    assert hvd.broadcast_object({"a": [1, 2]}, 0) == {"a": [1, 2]}
    assert hvd.allgather_object("x") == ["x"]
    hvd.barrier()
    assert hvd.join() == 0


# ---------------------------------------------------------------- DistributedOptimizer

def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _backward(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=g)
    model(x).pow(2).mean().backward()


def test_distributed_optimizer_behaves_as_the_wrapped_one():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.defaults is inner.defaults and "SGD" in repr(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_model = _model()
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            for m, o, s in ((model, opt, sched), (ref_model, ref, ref_sched)):
                o.zero_grad()
                _backward(m, step)
                o.step()
                s.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    sd = opt.state_dict()
    assert len(sd["state"]) == 4
    opt.load_state_dict(sd)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_zero_grad_while_pending_raises():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    _backward(model)
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_named_parameters_errors():
    model = _model()
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="duplicates: 0.weight"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=params + [("0.weight", params[0][1])])
    with pytest.raises(ValueError, match=r"not named: param_groups\[0\]\['params'\]\[3\] \(shape \(2,\)\)"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=params[:3])
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=[1, 2])


def test_step_after_synchronize_warns_and_skip_synchronize_allows_clipping():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    _backward(model)
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    opt.zero_grad()
    _backward(model)
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert norm <= 1e-3 + 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()


def test_backward_passes_per_step_accumulates_and_guards():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    ref = _model()
    _backward(model, 1)
    _backward(model, 2)
    _backward(ref, 1)
    _backward(ref, 2)
    opt.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    _backward(model)
    _backward(model)
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        _backward(model)
    opt.synchronize()


def test_sparse_gradients():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters())
    emb(torch.tensor([1, 2, 2])).sum().backward()
    opt.synchronize()  # reduced sparse (indices and values allgathered), coalesced
    assert emb.weight.grad.is_sparse and emb.weight.grad.is_coalesced()
    assert emb.weight.grad.to_dense()[:3].tolist() == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
    with opt.skip_synchronize():
        opt.step()
    emb2 = torch.nn.Embedding(10, 3, sparse=True)
    before = emb2.weight.detach().clone()
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(emb2.parameters(), lr=0.1),
                                    named_parameters=emb2.named_parameters(), sparse_as_dense=True)
    emb2(torch.tensor([1, 2])).sum().backward()
    opt2.step()
    changed = (emb2.weight.detach() != before).any(dim=1)
    assert changed.tolist() == [False, True, True] + [False] * 7
    del opt


@pytest.mark.parametrize("kwargs", [dict(groups=2), dict(num_groups=1), dict(compression=hvd.Compression.fp16),
                                    dict(gradient_predivide_factor=2.0), dict(op=hvd.Sum)])
def test_optimizer_options_match_plain_sgd(kwargs):
    model, ref = _model(), _model()
    if "groups" in kwargs:
        kwargs = dict(groups=[[model[0].weight, model[2].bias]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **kwargs)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _backward(m, step)
            o.step()
    tol = 1e-3 if "compression" in kwargs else 1e-6
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=tol)


def test_unused_parameter_gets_zero_gradient():
    model = _model()
    extra = torch.nn.Linear(2, 2)
    params = list(model.named_parameters()) + [("extra." + n, p) for n, p in extra.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
    _backward(model)
    opt.step()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in extra.parameters())


# ---------------------------------------------------------------- broadcast helpers

def test_broadcast_parameters_accepts_every_form():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    bn = torch.nn.BatchNorm1d(3)
    hvd.broadcast_parameters(bn.state_dict(), root_rank=0)  # includes the int64 0-d num_batches_tracked
    with pytest.raises(TypeError):
        hvd.broadcast_parameters(torch.zeros(2), root_rank=0)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.9)),
    lambda ps: torch.optim.AdamW(ps, lr=0.01),
    lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    lambda ps: torch.optim.Adagrad(ps, lr=0.01),
    lambda ps: torch.optim.LBFGS(ps),
], ids=["sgd", "adam", "adamw", "rmsprop", "adagrad", "lbfgs"])
def test_broadcast_optimizer_state_keeps_parameters_and_state(make):
    model = _model()
    opt = make(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # uninitialized state: nothing changes
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert len(opt.state_dict()["state"]) == (len(opt.state_dict()["state"]))

    def closure():
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        return torch.tensor(0.0)
    opt.step(closure)
    sd = opt.state_dict()
    hvd.broadcast_optimizer_state(hvd.DistributedOptimizer(opt) if not isinstance(opt, torch.optim.LBFGS)
                                  else opt, root_rank=0)
    assert str(opt.state_dict()) == str(sd)


def test_sync_batch_norm_function_gradcheck_and_size_one():
    """The cross-rank function itself (its collectives are identities at size 1): gradcheck in float64,
    and the module equals BatchNorm at size 1, including running stats and eval mode."""
    from ringcomm_torch.sync_batch_norm import _SyncBatchNormFunction

    torch.manual_seed(0)
    x = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(2, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def fn(x, w, b):
        return _SyncBatchNormFunction.apply(x, w, b, None, None, 1e-5, 0.1, hvd.global_process_set)

    assert torch.autograd.gradcheck(fn, (x, w, b), fast_mode=True)
    ref = torch.nn.functional.batch_norm(x, None, None, w, b, True, 0.1, 1e-5)
    assert torch.allclose(fn(x, w, b), ref, atol=1e-12)
    rm, rv = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    _SyncBatchNormFunction.apply(x, w, b, rm, rv, 1e-5, 0.1, hvd.global_process_set)
    rm2, rv2 = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    torch.nn.functional.batch_norm(x, rm2, rv2, w, b, True, 0.1, 1e-5)
    assert torch.allclose(rm, rm2) and torch.allclose(rv, rv2)  # unbiased variance in running_var
    bn, plain = hvd.SyncBatchNorm(3), torch.nn.BatchNorm2d(3)
    xs = torch.randn(4, 3, 5, 5)
    assert torch.allclose(bn(xs), plain(xs), atol=1e-6)
    assert torch.allclose(bn.running_var, plain.running_var)
    bn.eval(), plain.eval()
    assert torch.allclose(bn(xs), plain(xs), atol=1e-6)
    with pytest.raises(ValueError, match="2 or more dimensions"):
        bn(torch.randn(3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        _SyncBatchNormFunction.apply(torch.randn(1, 3), None, None, None, None, 1e-5, 0.1, hvd.global_process_set)


def test_copy_spans_made_before_the_op_is_named_go_to_its_timeline_row(tmp_path):
    """The D2H staging copy happens before the core names the op: the span waits for the handle."""
    import json

    from ringcomm_torch.tensors import traced_copy

    path = tmp_path / "copies.json"
    hvd.start_timeline(str(path))
    with traced_copy("MEMCPY_D2H") as timed:  # what staging a CUDA tensor does, on this thread
        assert timed
    hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="copies.x"))
    hvd.stop_timeline()
    with traced_copy("MEMCPY_D2H") as timed:  # no timeline: nothing is timed or kept
        assert not timed
    events = json.loads(path.read_text())
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    pid = next(p for p, name in rows.items() if name == "allreduce.copies.x")
    spans = sorted((e for e in events if e.get("pid") == pid and e["ph"] == "X"), key=lambda e: e["ts"])
    assert [e["name"] for e in spans][:2] == ["MEMCPY_D2H", "QUEUE"]
