"""DistributedOptimizer's device buckets on their way back, run on CPU through the fake device.

A bucket's results come home on a completer thread as soon as its reduction is done: one
host-to-device copy into the bucket's flat buffer (plus one batched copy into the gradients that
are not views of it), then an event; the thread in ``synchronize()``/``step()`` only makes its
stream wait for that event.  From the first step on, every contiguous parameter's ``.grad`` is a
view of its bucket's flat buffer, so a step that finds them there packs and unpacks nothing.

Each test trains a twin of the model with the plain optimizer as the reference: at one rank the
average is the local gradient, so gradients and parameters must match it bitwise.
"""

from __future__ import annotations

import copy
import json
import threading
import time

import pytest

torch = pytest.importorskip("torch")

import ringcomm as rc  # noqa: E402
import ringcomm_torch as hvd  # noqa: E402
from ringcomm.errors import HorovodInternalError  # noqa: E402
from ringcomm_torch import device  # noqa: E402

pytestmark = pytest.mark.timeout(60)

COMPLETER = "ringcomm-torch-device-return"
X = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))  # the same on every rank


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


def make(ops, widths=(32,) * 12, **kwargs):
    """A model, its DistributedOptimizer over ``ops`` (three buckets unless ``groups`` says
    otherwise), and a twin with the plain optimizer."""
    kwargs.setdefault("groups", 3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    twin = copy.deepcopy(model)
    with device.override(ops):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **kwargs)
    return model, opt, twin, torch.optim.SGD(twin.parameters(), lr=0.1)


def train(model, opt, twin, twin_opt, *, set_to_none, passes=1):
    """One step of both (``passes`` backward passes each); checks them bitwise equal."""
    opt.zero_grad(set_to_none=set_to_none)
    twin_opt.zero_grad(set_to_none=set_to_none)
    for _ in range(passes):
        model(X).square().mean().backward()
        twin(X).square().mean().backward()
    opt.step()
    twin_opt.step()
    assert_same(model, twin)


def assert_same(model, twin):
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), f"{name}.grad differs from the one-process reference"
        assert torch.equal(p, q), f"{name} differs from the one-process reference"


def counts(ops, buckets, call, thread=None):
    """``call`` calls per bucket so far (touching its flat buffer)."""
    return [0 if b._flat is None else ops.count(call, thread, b._flat) for b in buckets]


def test_step_only_waits_on_streams_and_each_bucket_comes_home_on_a_completer_thread():
    ops = device.FakeOps()
    model, opt, twin, twin_opt = make(ops)
    buckets = list(opt.reducer.device_buckets.values())
    n = len(buckets)
    assert n == 3
    me = threading.current_thread().name
    for step in range(3):
        home = counts(ops, buckets, "copy", COMPLETER)
        opt.zero_grad()
        twin_opt.zero_grad()
        model(X).square().mean().backward()
        twin(X).square().mean().backward()
        mark = len(ops.calls)
        opt.step()
        twin_opt.step()
        assert [c for c, t in ops.calls[mark:] if t == me] == ["stream_wait"] * n  # no copy, no wait
        # one host-to-device copy per bucket, on a completer thread; nothing else there waits or packs
        assert [a - b for a, b in zip(counts(ops, buckets, "copy", COMPLETER), home)] == [1] * n
        assert counts(ops, buckets, "copy", me) == [step + 1] * n  # the hooks' device-to-host copies
        assert_same(model, twin)
    assert ops.count("wait_event", COMPLETER) == ops.count("pack", COMPLETER) == 0
    assert ops.count("unpack") == 0


def test_with_views_in_place_nothing_is_packed_or_unpacked_after_the_first_step():
    ops = device.FakeOps()
    model, opt, twin, twin_opt = make(ops)
    buckets = list(opt.reducer.device_buckets.values())
    n = len(buckets)
    train(model, opt, twin, twin_opt, set_to_none=False)  # the first step packs and sets up the views
    assert counts(ops, buckets, "pack") == [1] * n and counts(ops, buckets, "unpack") == [0] * n
    assert all(all(b.views()) for b in buckets)
    allocated = ops.pinned_allocations
    assert allocated == n
    for _ in range(3):
        before = [counts(ops, buckets, c) for c in ("pack", "unpack", "copy")]
        train(model, opt, twin, twin_opt, set_to_none=False)  # zeroed in place: still the views
        after = [counts(ops, buckets, c) for c in ("pack", "unpack", "copy")]
        assert [[a - b for a, b in zip(x, y)] for x, y in zip(after, before)] == [[0] * n, [0] * n, [2] * n]
    assert ops.pinned_allocations == allocated
    flat_of = {id(p): b._flat for b in buckets for p in b.params}
    for p in model.parameters():  # each gradient lies in its bucket's buffer
        flat = flat_of[id(p)]
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_set_to_none_between_steps_packs_again_and_the_views_come_back():
    ops = device.FakeOps()
    model, opt, twin, twin_opt = make(ops)
    buckets = list(opt.reducer.device_buckets.values())
    n = len(buckets)
    for step in range(4):
        none = step % 2 == 0  # torch's default, then zeroing in place
        packs = counts(ops, buckets, "pack")
        train(model, opt, twin, twin_opt, set_to_none=none)
        assert [a - b for a, b in zip(counts(ops, buckets, "pack"), packs)] == [1 if none or step == 0 else 0] * n
        assert all(all(b.views()) for b in buckets)
    assert ops.count("unpack") == 0


def test_a_gradient_the_user_replaced_is_packed_alone_and_becomes_a_view_again():
    ops = device.FakeOps()
    model, opt, twin, twin_opt = make(ops)
    buckets = list(opt.reducer.device_buckets.values())
    train(model, opt, twin, twin_opt, set_to_none=False)
    first = next(iter(model.parameters()))
    owner = next(b for b in buckets if any(p is first for p in b.params))
    packs = counts(ops, buckets, "pack")
    opt.zero_grad(set_to_none=False)
    twin_opt.zero_grad(set_to_none=False)
    first.grad = torch.full_like(first, 0.25)  # the user's own tensor replaces the view
    next(iter(twin.parameters())).grad = torch.full_like(first, 0.25)
    model(X).square().mean().backward()
    twin(X).square().mean().backward()
    opt.step()
    twin_opt.step()
    assert_same(model, twin)
    assert [a - b for a, b in zip(counts(ops, buckets, "pack"), packs)] == [int(b is owner) for b in buckets]
    assert ops.count("pack", buffer=owner._flat) == 2 and ops.count("unpack") == 0
    assert all(owner.views())


def test_a_non_contiguous_parameter_keeps_its_own_gradient_and_gets_the_results_copied_back():
    ops = device.FakeOps()
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 32).t())  # (32, 8), not contiguous
    b = torch.nn.Parameter(torch.randn(8))
    tw, tb = (torch.nn.Parameter(t.detach().clone()) for t in (w, b))
    with device.override(ops):
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w, b], lr=0.1), named_parameters=[("w", w), ("b", b)])
    twin_opt = torch.optim.SGD([tw, tb], lr=0.1)
    (bucket,) = opt.reducer.device_buckets.values()
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        twin_opt.zero_grad(set_to_none=False)
        (X @ w + b).square().sum().backward()
        (X @ tw + tb).square().sum().backward()
        opt.step()
        twin_opt.step()
        assert torch.equal(w.grad, tw.grad) and torch.equal(b.grad, tb.grad)
        assert torch.equal(w, tw) and torch.equal(b, tb)
        assert bucket.views() == [p is b for p in bucket.params]
        assert ops.count("unpack", COMPLETER, bucket._flat) == step + 1  # w's results, copied back
        assert ops.count("pack", buffer=bucket._flat) == step + 1  # w's gradient (and b's, the first time)


def test_backward_passes_per_step_accumulates_into_the_views():
    ops = device.FakeOps()
    model, opt, twin, twin_opt = make(ops, backward_passes_per_step=2)
    buckets = list(opt.reducer.device_buckets.values())
    for _ in range(3):
        train(model, opt, twin, twin_opt, set_to_none=False, passes=2)
    assert counts(ops, buckets, "pack") == [1] * len(buckets) and ops.count("unpack") == 0


def test_fp16_compression_keeps_its_own_gradients_and_unpacks_on_the_completer():
    ops = device.FakeOps()
    model, opt, twin, twin_opt = make(ops, compression=hvd.Compression.fp16)
    buckets = list(opt.reducer.device_buckets.values())
    n = len(buckets)
    me = threading.current_thread().name
    for step in range(2):
        opt.zero_grad(set_to_none=False)
        model(X).square().mean().backward()
        mark = len(ops.calls)
        opt.step()
        assert [c for c, t in ops.calls[mark:] if t == me] == ["stream_wait"] * n
        assert not any(any(b.views()) for b in buckets)
        assert counts(ops, buckets, "pack") == [step + 1] * n
    assert ops.count("unpack", COMPLETER) == 2 * n and ops.count("unpack") == 2 * n
    twin_opt.zero_grad()
    twin(X).square().mean().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p.grad, q.grad.half().float(), rtol=1e-3, atol=1e-3)


class _Gated:
    """A core handle whose ``wait()`` (and ``done()``) hold until ``gate`` is set."""

    def __init__(self, inner, gate):
        self.inner, self.gate, self.name = inner, gate, inner.name

    def done(self):
        return self.gate.is_set() and self.inner.done()

    def wait(self, timeout=None):
        self.gate.wait()
        return self.inner.wait()


def test_the_hook_returns_while_events_are_held_and_the_results_stay_poison_until_theirs_fires(monkeypatch):
    ops = device.FakeOps()
    model, opt, twin, twin_opt = make(ops)
    buckets = list(opt.reducer.device_buckets.values())
    train(model, opt, twin, twin_opt, set_to_none=False)
    gate = threading.Event()
    real = rc.allreduce_async
    monkeypatch.setattr(rc, "allreduce_async", lambda *a, **k: _Gated(real(*a, **k), gate))
    me = threading.current_thread().name
    opt.zero_grad(set_to_none=False)
    twin_opt.zero_grad(set_to_none=False)
    ops.hold()
    started = time.monotonic()
    model(X).square().mean().backward()  # the hooks queue their copies and return
    twin(X).square().mean().backward()
    assert time.monotonic() - started < 5 and ops.count("wait_event", me) == 0
    assert all(torch.isnan(b._pinned.view(torch.float32)).all() for b in buckets)  # not copied yet
    ops.fire()  # the copies to the host land; the stager starts the core ops, held at the gate
    ops.hold()  # and the way home will be held too
    gate.set()
    mark = len(ops.calls)
    opt.synchronize()  # returns once each bucket's copy home is queued, not done
    assert [c for c, t in ops.calls[mark:] if t == me] == ["stream_wait"] * len(buckets)
    assert all(torch.isnan(p.grad).all() for p in model.parameters())  # the views: poison until it fires
    ops.fire()
    with opt.skip_synchronize():
        opt.step()
    twin_opt.step()
    assert_same(model, twin)
    assert ops.pinned_allocations == len(buckets)


@pytest.mark.parametrize("where", ["start", "wait"])
def test_an_error_of_the_core_op_surfaces_in_synchronize_and_the_next_step_is_right(monkeypatch, where):
    ops = device.FakeOps()
    model, opt, twin, twin_opt = make(ops)
    train(model, opt, twin, twin_opt, set_to_none=True)
    lost = HorovodInternalError("rank 1 left during allreduce (a test)")
    real = rc.allreduce_async

    class Failed:
        def __init__(self, name):
            self.name = name

        def done(self):
            return True

        def wait(self, timeout=None):
            raise lost

    def failing(arr, *args, **kwargs):
        if where == "start":
            raise lost
        return Failed(kwargs.get("name"))

    monkeypatch.setattr(rc, "allreduce_async", failing)
    opt.zero_grad()
    model(X).square().mean().backward()
    with pytest.raises(HorovodInternalError) as caught:
        opt.synchronize()
    assert caught.value is lost
    monkeypatch.setattr(rc, "allreduce_async", real)
    for none in (True, False):
        train(model, opt, twin, twin_opt, set_to_none=none)


def test_the_timeline_shows_each_buckets_unpack(tmp_path):
    ops = device.FakeOps()
    model, opt, twin, twin_opt = make(ops)
    path = tmp_path / "buckets.json"
    hvd.start_timeline(str(path))
    try:
        train(model, opt, twin, twin_opt, set_to_none=True)
    finally:
        hvd.stop_timeline()
    if hvd.rank() != 0:  # under a launcher only rank 0 writes the timeline, as Horovod's does
        return
    events = json.loads(path.read_text())
    for phase in ("BUCKET_PACK", "BUCKET_UNPACK"):
        carried = [e["args"]["parameters"] for e in events if e.get("name") == phase]
        assert sorted(n for names in carried for n in names) == sorted(n for n, _ in model.named_parameters())


def test_a_gradient_that_is_not_a_view_stays_poison_until_the_event_fires(monkeypatch):
    ops = device.FakeOps()
    w = torch.nn.Parameter(torch.randn(8, 32, generator=torch.Generator().manual_seed(2)).t())  # not contiguous
    tw = torch.nn.Parameter(w.detach().clone())
    with device.override(ops):
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)])
    gate = threading.Event()
    real = rc.allreduce_async
    monkeypatch.setattr(rc, "allreduce_async", lambda *a, **k: _Gated(real(*a, **k), gate))
    (X @ w).square().sum().backward()
    (X @ tw).square().sum().backward()
    ops.hold()
    gate.set()
    opt.synchronize()  # the copy home and the unpack are queued behind a held event
    assert torch.isnan(w.grad).all() and ops.count("unpack", COMPLETER) == 1
    ops.fire()
    assert torch.equal(w.grad, tw.grad)


def test_gradients_that_swapped_places_in_a_bucket_are_packed_from_copies():
    ops = device.FakeOps()
    model, opt, twin, twin_opt = make(ops)
    train(model, opt, twin, twin_opt, set_to_none=False)
    bucket = next(iter(opt.reducer.device_buckets.values()))
    i, j = [k for k, p in enumerate(bucket.params) if p.dim() == 2][:2]
    names = {id(p): n for n, p in model.named_parameters()}
    twins = dict(twin.named_parameters())
    a, b = bucket.params[i], bucket.params[j]
    ta, tb = twins[names[id(a)]], twins[names[id(b)]]
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        twin_opt.zero_grad(set_to_none=False)
        a.grad, b.grad = b.grad, a.grad  # each now lies where the other's belongs
        ta.grad, tb.grad = tb.grad, ta.grad
        model(X).square().mean().backward()
        twin(X).square().mean().backward()
        opt.step()
        twin_opt.step()
        assert_same(model, twin)
        assert all(bucket.views())
