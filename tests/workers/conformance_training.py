"""Conformance job: Horovod's optimizer and state helpers (broadcast_optimizer_state, objects,
compression, DistributedOptimizer's naming, synchronize/skip_synchronize, dynamic requires_grad).

Run by ``python -m ringcomm.launch.launcher -np N python conformance_training.py``; prints
``CONFORMANCE OK rank=R`` when every check passed.
"""

from __future__ import annotations

import inspect
import itertools
import os
import tempfile
import warnings

import torch
import torch.nn.functional as F

import ringcomm_torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
D_IN, H, D_OUT = 20, 10, 10


def optimizer_classes() -> list[type]:
    """Every torch.optim optimizer Horovod's suite exercises (not LBFGS, not SparseAdam), sorted by name.

    Muon is left out: torch only builds it over 2-D parameters, and these models have biases."""
    skip = {torch.optim.LBFGS, torch.optim.SparseAdam, getattr(torch.optim, "Muon", None)}
    found = [c for c in torch.optim.Optimizer.__subclasses__()
             if c.__module__.startswith("torch.optim") and c not in skip]
    return sorted(found, key=lambda c: c.__name__)


def accepted(cls: type, options: dict) -> dict:
    names = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in options.items() if k in names}


def model_and_optimizer(cls: type, options: dict) -> tuple[torch.nn.Module, hvd.DistributedOptimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, H), torch.nn.ReLU(), torch.nn.Linear(H, D_OUT))
    opt = cls(model.parameters(), **accepted(cls, options))
    return model, hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(R)
    x, y = torch.randn(8, D_IN), torch.randn(8, D_OUT)
    opt.zero_grad()
    F.mse_loss(model(x), y, reduction="sum").backward()
    opt.step()


def state_values(opt: torch.optim.Optimizer) -> list[tuple[str, object]]:
    sd = opt.state_dict()
    return [(k, v.clone() if torch.is_tensor(v) else v)
            for g in sd["param_groups"] for pid in g["params"] if pid in sd["state"]
            for k, v in sorted(sd["state"][pid].items())]


def check_broadcast_state_from_checkpoint() -> None:
    """Rank 0 resumes from a checkpoint, the others start fresh: after the broadcasts every rank
    holds rank 0's parameters and optimizer state, with the same Python types."""
    for cls, options in itertools.product(optimizer_classes(),
                                          (dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True),
                                           dict(lr=0.2))):
        model, opt = model_and_optimizer(cls, options)
        train_step(model, opt)
        params = [(k, hvd.broadcast(v, 0)) for k, v in sorted(model.state_dict().items())]
        states = []
        for k, v in state_values(opt):
            if torch.is_tensor(v):
                states.append((k, hvd.broadcast(v, 0)))
            else:
                states.append((k, hvd.broadcast_object(v, 0)))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ckpt.pt")
            if R == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
            model, opt = model_and_optimizer(cls, options)
            if R == 0:
                ckpt = torch.load(path)
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for (k, want), (k2, got) in zip(params, sorted(model.state_dict().items())):
            assert k == k2 and torch.equal(want, got), f"rank {R}: {cls.__name__}: parameter {k} differs"
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        expected = 0 if cls is torch.optim.SGD and "momentum" not in options else 4
        assert len(opt.state_dict()["state"]) == expected, \
            f"rank {R}: {cls.__name__}: {len(opt.state_dict()['state'])} state entries, expected {expected}"
        for (k, want), (k2, got) in zip(states, state_values(opt)):
            assert k == k2 and type(want) is type(got), f"rank {R}: {cls.__name__}: state {k} type differs"
            assert torch.equal(want, got) if torch.is_tensor(want) else want == got, \
                f"rank {R}: {cls.__name__}: state {k} differs"


def check_broadcast_state_options() -> None:
    """Hyper-parameters (floats, tuples, bools) come from the root with their types, and train after."""
    mine = (dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999),
                 etas=(0.8, 2.4), step_sizes=(1e-5, 100)) if R == 0 else
            dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9),
                 etas=(0.25, 1.75), step_sizes=(1e-7, 5)))
    root = hvd.broadcast_object(mine, 0)
    for cls in optimizer_classes():
        model, opt = model_and_optimizer(cls, mine)
        train_step(model, opt)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        for k, want in accepted(cls, root).items():
            got = opt.param_groups[0][k]
            pairs = zip(got, want) if isinstance(want, tuple) else [(got, want)]
            for g, w in pairs:
                assert type(g) is type(w) and abs(g - w) <= 1e-5, f"rank {R}: {cls.__name__}.{k}: {got!r} != {want!r}"
        train_step(model, opt)


def check_broadcast_state_no_grad() -> None:
    """A fresh optimizer with a frozen integer parameter: trainable ones get a zero gradient, the
    frozen one none, and nothing fails."""
    class Frozen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
            self.b = torch.nn.Parameter(torch.rand(4))

    model = Frozen()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    assert opt.param_groups[0]["params"][0].grad is None
    assert torch.equal(hvd.broadcast(grad, root_rank=0), grad) and not grad.any()


def check_objects_and_compression() -> None:
    obj = hvd.broadcast_object({"hello": 123, 0: [1, 2]} if R == 0 else {}, root_rank=0)
    assert obj == {"hello": 123, 0: [1, 2]}
    d = {"metric_val_1": R}
    if R == 1:
        d["metric_val_2"] = 42
    want = [{"metric_val_1": i} for i in range(N)]
    want[1] = {"metric_val_1": 1, "metric_val_2": 42}
    assert hvd.allgather_object(d) == want
    for dtype in (torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        t = torch.ones(5, 5, 5, dtype=dtype)
        packed, ctx = hvd.Compression.fp16.compress(t)
        assert packed.dtype == (torch.float16 if dtype.is_floating_point else dtype)
        back = hvd.Compression.fp16.decompress(packed, ctx)
        assert back.dtype == dtype and torch.equal(back, t)


def check_optimizer_naming() -> None:
    a, b = torch.nn.Conv2d(1, 1, 1), torch.nn.Conv2d(1, 1, 1)
    opt = torch.optim.SGD(itertools.chain(a.parameters(), b.parameters()), lr=0.1)
    try:
        hvd.DistributedOptimizer(opt, named_parameters=itertools.chain(a.named_parameters(), b.named_parameters()))
        raise AssertionError("duplicate names accepted")
    except ValueError:
        pass
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 1), torch.nn.Conv2d(4, 1, 1))
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:1])
        raise AssertionError("missing names accepted")
    except ValueError:
        pass
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    assert named._parameter_names == {p: n for n, p in model.named_parameters()}
    unnamed = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert set(unnamed._parameter_names) == set(model.parameters())
    assert len(set(unnamed._parameter_names.values())) == len(list(model.parameters()))
    unnamed.zero_grad()
    model(torch.rand(1, 1, 8, 8)).sum().backward()
    unnamed.step()


def check_force_allreduce_and_dynamic_requires_grad() -> None:
    """Ranks whose losses touch different parameters still step together; parameters can be frozen
    and thawed between steps."""
    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(D_IN, H), torch.nn.Linear(H, D_OUT),
                                            torch.nn.Linear(D_OUT, D_OUT))

        def forward(self, x):
            h = self.fc2(F.relu(self.fc1(x)))
            return h, self.fc3(F.relu(h))

    for cls, options in itertools.product(optimizer_classes(), (dict(lr=0.2, momentum=0.9), dict(lr=0.2))):
        model = Two()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(cls(model.parameters(), **accepted(cls, options)),
                                       named_parameters=model.named_parameters())
        y1, y2 = model(torch.randn(8, D_IN))
        opt.zero_grad()
        F.mse_loss(y1 if R == 0 else y2, torch.randn(8, D_OUT)).backward()
        opt.step()
    gen, disc = torch.nn.Conv2d(1, 4, 1), torch.nn.Conv2d(4, 1, 1)
    gen_opt = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1),
                                       named_parameters=gen.named_parameters())
    disc_opt = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                        named_parameters=disc.named_parameters())
    inp = torch.rand(1, 1, 16, 16)
    for _ in range(3):
        for train_gen in (True, False):
            for p in gen.parameters():
                p.requires_grad_(train_gen)
            for p in disc.parameters():
                p.requires_grad_(not train_gen)
            gen_opt.zero_grad()
            disc_opt.zero_grad()
            disc(gen(inp)).sum().backward()
            for p in gen.parameters():  # frozen: no gradient (torch 2's zero_grad sets it to None) or zeros
                assert train_gen == (p.grad is not None and bool(p.grad.abs().max() > 0))
            for p in disc.parameters():
                assert train_gen != (p.grad is not None and bool(p.grad.abs().max() > 0))
            (gen_opt if train_gen else disc_opt).step()


def check_clipping_and_step_warning() -> None:
    model = torch.nn.Linear(1, 1)
    model.weight = torch.nn.Parameter(torch.full((1, 1), 0.5))
    model.bias = torch.nn.Parameter(torch.zeros(1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    opt.zero_grad()
    F.mse_loss(model(torch.ones(1, 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    before = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert abs(model.weight.grad.item()) < abs(before)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    F.mse_loss(model(torch.zeros(1, 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("optimizer.step() called without optimizer.skip_synchronize()" in str(w.message) for w in caught)


if __name__ == "__main__":
    warnings.simplefilter("ignore", DeprecationWarning)
    for check in (check_broadcast_state_from_checkpoint, check_broadcast_state_options,
                  check_broadcast_state_no_grad, check_objects_and_compression, check_optimizer_naming,
                  check_force_allreduce_and_dynamic_requires_grad, check_clipping_and_step_warning):
        check()
        hvd.barrier()
    print(f"CONFORMANCE OK rank={R}", flush=True)
    hvd.shutdown()
