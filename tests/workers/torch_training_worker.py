"""Worker for tests/torch/test_torch_jobs.py: DistributedOptimizer and the broadcast helpers at any size.

Each rank also trains a one-process reference on the global batch (N ranks x b rows), so
"N ranks with Average == one process with batch N*b" is checked without another job.
Prints ``WORKER OK rank=R`` on success.
"""

from __future__ import annotations

import copy
import hashlib
import sys
import warnings
from collections.abc import Callable

import torch

import ringcomm_torch as hvd
from ringcomm_torch import device

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
B = 4  # rows per rank


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(N * B, 6, generator=g), torch.randn(N * B, 3, generator=g)


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def assert_identical_across_ranks(model: torch.nn.Module, what: str) -> None:
    hashes = hvd.allgather_object(digest(list(model.parameters())))
    assert len(set(hashes)) == 1, f"rank {R}: {what}: parameters differ across ranks: {hashes}"


def assert_close(model: torch.nn.Module, ref: torch.nn.Module, tol: float, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p - q).abs().max().item()
        assert err <= tol, f"rank {R}: {what}: {name} differs from the 1-process reference by {err}"


def check_equivalence(make_opt: Callable, what: str, tol: float = 1e-5, steps: int = 10, passes: int = 1,
                      ops: device.DeviceOps | None = None, set_to_none: Callable[[int], bool] = lambda step: True,
                      **dist_kwargs) -> hvd.DistributedOptimizer:
    """Train ``steps`` steps at every rank and one process on the global batch, and compare; with
    ``ops``, every parameter takes the device (CUDA) path through those device operations."""
    model = make_model(seed=R)  # different on every rank until broadcast
    ref = make_model(seed=0)
    with device.override(ops):
        opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                       backward_passes_per_step=passes, **dist_kwargs)
    ref_opt = make_opt(ref.parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert_close(model, ref, 0.0, f"{what} after broadcast_parameters")
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none(step))
        ref_opt.zero_grad(set_to_none=set_to_none(step))
        for micro in range(passes):
            x, y = batch(step, micro)
            loss_fn(model, x[R * B:(R + 1) * B], y[R * B:(R + 1) * B]).backward()
            loss_fn(ref, x, y).backward()
        opt.step()
        ref_opt.step()
        assert_identical_across_ranks(model, f"{what} step {step}")
    assert_close(model, ref, tol, what)
    return opt


def check_device_buckets(sgd: Callable) -> None:
    """The CUDA bucket path, on the fake device: results right at every size whether the
    gradients are set to None between steps or zeroed in place (then they stay views of the
    buckets: packed only on the steps after a set_to_none, never unpacked); with fp16 compression
    they keep their own memory and the results are copied back once per bucket and step."""
    ops = device.FakeOps()
    opt = check_equivalence(sgd, "device buckets (fake device)", steps=6, ops=ops, groups=2,
                            set_to_none=lambda step: step % 3 == 0)
    buckets = list(opt.reducer.device_buckets.values())
    assert len(buckets) == 2 and all(all(b.views()) for b in buckets), f"rank {R}: gradients are not bucket views"
    packs = [ops.count("pack", buffer=b._flat) for b in buckets]
    assert packs == [2, 2] and ops.count("unpack") == 0, f"rank {R}: packs {packs}, unpacks {ops.count('unpack')}"
    ops = device.FakeOps()
    opt = check_equivalence(sgd, "device buckets, fp16 (fake device)", tol=1e-2, steps=3, ops=ops,
                            compression=hvd.Compression.fp16)
    assert ops.count("unpack", "ringcomm-torch-device-return") == 3 * len(opt.reducer.device_buckets)


def check_unused_parameter() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = make_model(0)
            self.extra = torch.nn.Linear(6, 3)  # only rank 0 uses it
            self.use_extra = R == 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.body(x)
            return out + self.extra(x) if self.use_extra else out

    torch.manual_seed(0)
    net = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    for step in range(3):
        x, y = batch(step)
        ref = copy.deepcopy(net)  # rank 0's local gradient of the unused-elsewhere layer, on every rank
        ref.use_extra = True
        loss_fn(ref, x[:B], y[:B]).backward()
        opt.zero_grad()
        loss_fn(net, x[R * B:(R + 1) * B], y[R * B:(R + 1) * B]).backward()
        opt.step()
        assert torch.allclose(net.extra.weight.grad, ref.extra.weight.grad / N, atol=1e-6), \
            f"rank {R}: unused parameter gradient is not rank 0's / {N}"
        assert_identical_across_ranks(net, f"unused parameter step {step}")


def state_digest(opt: torch.optim.Optimizer) -> str:
    sd = opt.state_dict()
    h = hashlib.sha256()
    for pid in sorted(sd["state"]):
        for key in sorted(sd["state"][pid]):
            v = sd["state"][pid][key]
            h.update(f"{pid}.{key}".encode())
            h.update(v.numpy().tobytes() + repr((v.dtype, tuple(v.shape))).encode()
                     if isinstance(v, torch.Tensor) else repr(v).encode())
    h.update(repr(sd["param_groups"]).encode())
    return h.hexdigest()


def check_broadcast_optimizer_state() -> None:
    makers = {
        "SGD": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True),
        "Adam": lambda ps, lr: torch.optim.Adam(ps, lr=lr, betas=(0.8 + 0.01 * R, 0.99)),
        "AdamW": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1 * (R + 1)),
        "RMSprop": lambda ps, lr: torch.optim.RMSprop(ps, lr=lr, momentum=0.5, centered=True),
        "Adagrad": lambda ps, lr: torch.optim.Adagrad(ps, lr=lr),
    }
    for name, make in makers.items():
        model = make_model(seed=R)
        opt = make(model.parameters(), 0.01 * (R + 1))
        # rank 0 has trained 2 steps (as if resumed from a checkpoint); the last rank once; others are fresh
        local_steps = 2 if R == 0 else (1 if R == N - 1 else 0)
        for step in range(local_steps):
            opt.zero_grad()
            x, y = batch(step)
            loss_fn(model, x, y).backward()
            opt.step()
        if name == "SGD":  # also through the wrapper
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1) if R == 0 else None
        assert sched is None or "initial_lr" in opt.param_groups[0]
        params_before = digest(list(model.parameters()))
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        assert digest(list(model.parameters())) == params_before, f"{name}: parameters changed"
        digests = hvd.allgather_object(state_digest(opt))
        assert len(set(digests)) == 1, f"rank {R}: {name}: optimizer state differs after broadcast"
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt.zero_grad()
        x, y = batch(7)
        loss_fn(model, x[R * B:(R + 1) * B] if name == "SGD" else x, y[R * B:(R + 1) * B] if name == "SGD" else y).backward()
        opt.step()
        assert_identical_across_ranks(model, f"{name} step after broadcast_optimizer_state")


def check_mismatched_param_groups_fail_on_every_rank() -> None:
    model = make_model(seed=0)
    params = list(model.parameters())
    # the last rank splits its parameters into two groups: every rank raises, naming it
    groups = [{"params": params}] if R != N - 1 else [{"params": params[:1]}, {"params": params[1:]}]
    opt = torch.optim.SGD(groups, lr=0.1)
    try:
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    except ValueError as exc:
        text = str(exc)
        assert f"rank {N - 1} has [1, {len(params) - 1}]" in text and f"sizes [{len(params)}]" in text, text
        assert f"rank {R}:" in text, text
    else:
        raise AssertionError(f"rank {R}: mismatched param groups were accepted")
    hvd.barrier()  # every rank is still in step


def run() -> None:
    """Every check of this module (raises on the first failure)."""
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    adam = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731
    check_equivalence(sgd, "SGD+momentum")
    check_equivalence(adam, "Adam")
    check_equivalence(sgd, "SGD backward_passes_per_step=2", steps=4, passes=2)
    check_equivalence(sgd, "SGD groups=2", steps=3, groups=2)
    check_equivalence(sgd, "SGD gradient_predivide_factor", steps=3, gradient_predivide_factor=float(N))
    check_equivalence(sgd, "SGD fp16", tol=1e-2, steps=3, compression=hvd.Compression.fp16)
    check_device_buckets(sgd)
    check_unused_parameter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # lr_scheduler order warnings
        check_broadcast_optimizer_state()
    check_mismatched_param_groups_fail_on_every_rank()


if __name__ == "__main__":
    run()
    print(f"WORKER OK rank={R}", flush=True)
    hvd.shutdown()
    sys.exit(0)
