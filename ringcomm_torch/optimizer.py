"""``DistributedOptimizer``: averages gradients over ranks while ``loss.backward()`` runs.

It wraps any ``torch.optim.Optimizer`` by delegation (no dynamic subclass):
``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own
objects, so ``state_dict()``, ``load_state_dict()``, LR schedulers and
``isinstance(opt, torch.optim.Optimizer)`` keep working.

Each parameter gets a ``register_post_accumulate_grad_hook``.  Host parameters are
cut into DDP's buckets, one dtype each (a first bucket of at most 1 MiB, then about
``RINGCOMM_BUCKET_BYTES``, 25 MiB), in reverse order, the order backward produces
their gradients; the moment the last gradient of a bucket is accumulated, its hook
starts one in-place allreduce of the bucket, named after its first parameter
(``"allreduce." + name``).  As DDP's ``gradient_as_bucket_view``, the gradients
become views of the bucket's flat buffer (:class:`.buckets.HostBucket`), so the
core reduces them where they lie, with no fusion buffer to copy into and out of.
One op per bucket rather than per parameter saves a negotiation round and the
engine's per-op work for every small gradient (biases, norms); a parameter larger
than a bucket is reduced on its own, where it lies.  ``groups=`` replaces the buckets with your own
grouping, and ``RINGCOMM_BUCKET_BYTES=0`` gives one op per parameter (Horovod's
default).  ``step()`` waits for every reduction (``synchronize()``) and then
runs the wrapped optimizer's step.  CUDA parameters go into DDP-sized buckets that
live as long as the optimizer (:mod:`.buckets`): the hook only queues one device-to-host
copy per bucket on a side stream, the results are copied back as each bucket's reduction
finishes, and the gradients become views of the buckets (nothing to pack or unpack).

What each rank sees (size 2, the same model; rank r's batch gives grad g_r)::

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    loss.backward()       # reductions start during backward
    opt.step()            # every rank: p.grad == (g_0 + g_1) / 2, then p -= 0.1 * p.grad
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ringcomm import api as _core_api
from ringcomm.errors import InvalidInputError, InvalidTypeError, RingcommError

from .basics import check_process_set, global_process_set, size
from .buckets import DEVICE_DTYPES, DeviceBucket, GroupKey, HostBucket, bucket_caps, plan_buckets, split_list
from .collectives import Adasum, Average, Several, allreduce_async_, grouped_allreduce_async_, synchronize
from .compression import Compression
from .device import ops_for, service
from .handles import Handle
from .sparse import sparse_allreduce_async

__all__ = ["DistributedOptimizer", "GradientsPendingError"]

_ZERO_GRAD_MSG = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_TOO_MANY_PASSES_MSG = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
_ADASUM_SKIP_MSG = "Skipping synchronization is not supported when using Adasum optimizer."
_STEP_AFTER_SYNC_MSG = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
    "This can cause training slowdown. You may want to consider using optimizer.skip_synchronize() "
    "context if you use optimizer.synchronize() in your code."
)


_WRITTEN = object()  # a device bucket's handle wrote the reduced values into the gradients itself


class GradientsPendingError(RingcommError, AssertionError):
    """Gradients were touched while their reductions were in flight (Horovod raises AssertionError)."""


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Arguments follow Horovod's ``hvd.DistributedOptimizer``:

    named_parameters: ``(name, param)`` pairs, usually ``model.named_parameters()``; names
        key the reductions, so every rank must use the same ones.
    compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
    backward_passes_per_step: reduce every k-th backward, after accumulating k locally.
    op: ``hvd.Average`` (default) or ``hvd.Sum`` (and Min/Max/Product).  ``hvd.Adasum`` (on more
        than one rank, a power of two) works as Horovod's: during backward each parameter is
        stepped by the wrapped optimizer alone, the change is reduced with Adasum, and ``step()``
        applies the reduced change to the starting value (``synchronize()`` does nothing then).
    gradient_predivide_factor: with Average, scale by ``1/f`` before the sum and ``f/size`` after.
    groups: an int (that many fused groups) or a list of lists of parameters to reduce together.
    sparse_as_dense: densify sparse gradients before reducing; otherwise a sparse gradient
        (``nn.Embedding(sparse=True)``) is reduced by allgathering its indices and values
        (``hvd.sparse_allreduce_async``) and ``p.grad`` becomes the coalesced sparse result.
    process_set: reduce over the ranks of this ``hvd.ProcessSet`` only (default: every rank);
        only its members may create the optimizer (others get a ``ValueError``), e.g. with
        ``ps = hvd.ProcessSet([0, 2])`` ranks 0 and 2 average their gradients between themselves.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 sparse_as_dense: bool = False, process_set: Any = global_process_set) -> None:
        # torch.optim.Optimizer.__init__ is deliberately not called: the wrapped optimizer owns the state.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidTypeError(
                f"DistributedOptimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise InvalidInputError("DistributedOptimizer: the optimizer is already a DistributedOptimizer")
        # a rank outside the process set keeps its own gradients (Horovod registers no hooks there)
        self._included = process_set is None or process_set is global_process_set or bool(process_set.included())
        if self._included:
            check_process_set(process_set, "DistributedOptimizer")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise InvalidInputError("gradient_predivide_factor not supported with op != Average")
        if int(backward_passes_per_step) < 1:
            raise InvalidInputError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if num_groups:
            warnings.warn("Parameter `num_groups` has been replaced by `groups`.", DeprecationWarning, stacklevel=2)
            if groups is None:
                groups = num_groups

        self.__dict__["_optimizer"] = optimizer
        self._compression = compression
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        members = size() if process_set is None or process_set is global_process_set else process_set.size()
        # Adasum over more than one rank reduces the optimizer's steps (deltas), not the gradients
        self._adasum = op == Adasum and (members or 1) > 1
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._lock = threading.RLock()
        self._names = self._name_parameters(named_parameters)
        self._delay = {p: self.backward_passes_per_step for p in self._all_params()}
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._requires_update: list[torch.Tensor] = []
        self._group_of: dict[torch.Tensor, tuple[torch.Tensor, ...]] = {}
        self._group_counts: dict[tuple[torch.Tensor, ...], int] = {}
        self._device_buckets: dict[tuple[torch.Tensor, ...], DeviceBucket] = {}
        self._host_buckets: dict[tuple[torch.Tensor, ...], HostBucket] = {}
        self._groups_spec = self._check_groups(groups)
        self._hook_handles: list[Any] = []
        self._register_hooks(self._all_params())
        weakref.finalize(self, _remove_hooks, self._hook_handles)

    # ------------------------------------------------------------ delegation

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """``{param: name}`` for every parameter, as Horovod's optimizer keeps it (the names the
        allreduces use; ``noname.<group>.<index>`` where no ``named_parameters`` were given)."""
        return self._names

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: fall through to the wrapped optimizer
        inner = self.__dict__.get("_optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer cannot be pickled; save optimizer.state_dict() instead")

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self._lock:
            self._handles.clear()
            self._synchronized = False
            self._should_synchronize = True
            self._reset_delays()
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        before = {id(p) for p in self._all_params()}
        self._optimizer.add_param_group(param_group)
        new = [p for p in self._all_params() if id(p) not in before]
        gi = len(self.param_groups) - 1
        for j, p in enumerate(new):
            self._names.setdefault(p, f"noname.{gi}.{j}")
            self._delay[p] = self.backward_passes_per_step
        self._register_hooks(new)

    # ------------------------------------------------------------ setup

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _name_parameters(self, named_parameters: Any) -> dict[torch.Tensor, str]:
        if named_parameters is None:
            return {p: f"noname.{i}.{j}" for i, group in enumerate(self.param_groups)
                    for j, p in enumerate(group["params"])}
        named = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
            raise InvalidInputError("named_parameters should be a sequence of tuples (name, parameter), "
                                    "usually produced by model.named_parameters().")
        seen: set[str] = set()
        dups: list[str] = []
        for name, _ in named:
            if name in seen and name not in dups:
                dups.append(name)
            seen.add(name)
        if dups:
            raise InvalidInputError("Parameter names in named_parameters must be unique. "
                                    f"Found duplicates: {', '.join(sorted(dups))}")
        names = {p: str(n) for n, p in named}
        missing = [f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})"
                   for i, group in enumerate(self.param_groups)
                   for j, p in enumerate(group["params"]) if p not in names]
        if missing:
            raise InvalidInputError("named_parameters was specified, but one or more model parameters were not "
                                    f"named: {', '.join(missing)}. Pass model.named_parameters() of the model "
                                    "whose parameters the optimizer holds.")
        return names

    def _check_groups(self, groups: Any) -> Any:
        if groups is None:
            return None
        if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise InvalidInputError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        if isinstance(groups, list):
            seen: set[int] = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise InvalidInputError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise InvalidInputError("A parameter can only appear once in groups.")
                    seen.add(id(p))
        return groups

    def _form_groups(self, params: list[torch.Tensor]) -> None:
        spec = self._groups_spec
        if self._adasum:
            return  # each parameter steps and reduces its delta on its own
        if spec is None:
            settings = _core_api.current_settings()
            # DDP's buckets per (device, dtype); a lone host parameter is reduced where it lies
            formed = [b for b in self._buckets_by_kind(params, *bucket_caps(settings.fusion_threshold,
                                                                             settings.bucket_bytes))
                      if len(b) > 1 or self._device_ops(b[0]) is not None]
        elif isinstance(spec, list):
            ids = {id(p) for p in params}
            formed = [[p for p in group if id(p) in ids] for group in spec]
            grouped = {id(p) for g in formed for p in g}
            formed += [[p] for p in params if id(p) not in grouped]
        else:
            formed = split_list(params, spec)
        for group in formed:
            if not group:
                continue
            key = GroupKey(group)
            for p in key:
                self._group_of[p] = key
            self._group_counts[key] = 0
            ops = self._device_ops(key[0])
            if ops is not None and all(self._device_ops(p) is ops and p.dtype is key[0].dtype
                                       and p.device == key[0].device for p in key):
                self._device_buckets[key] = DeviceBucket(key, [self._names[p] for p in key], service(ops, key[0].device))
            elif ops is None and self._flat_on_host(key):
                self._host_buckets[key] = HostBucket(key, [self._names[p] for p in key])

    def _device_ops(self, p: torch.Tensor) -> Any:
        """The device operations that stage ``p``'s bucket, or None (host, or a dtype the core
        reduces through another wire dtype: those take the per-tensor path)."""
        return ops_for(p) if p.dtype in DEVICE_DTYPES and p.layout is torch.strided else None

    def _flat_on_host(self, group: tuple[torch.Tensor, ...]) -> bool:
        """Whether a group of host parameters is reduced as one flat buffer (:class:`HostBucket`):
        more than one, all of one dtype a bucket carries, on the CPU, with a compression that leaves
        a tensor of that dtype as it is."""
        first = group[0]
        if len(group) < 2 or first.dtype not in DEVICE_DTYPES or first.device.type != "cpu":
            return False
        if any(p.dtype is not first.dtype or p.layout is not torch.strided or p.device != first.device for p in group):
            return False
        probe = torch.zeros(1, dtype=first.dtype)
        return bool(self._compression.compress(probe)[0] is probe)

    def _buckets_by_kind(self, params: list[torch.Tensor], first: int, cap: int) -> list[list[torch.Tensor]]:
        """Parameters in reverse order, one bucket list per (device, dtype), DDP's sizes."""
        by_kind: dict[tuple[Any, torch.dtype], list[torch.Tensor]] = {}
        for p in reversed(params):
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        out = []
        for group in by_kind.values():
            plan = plan_buckets([p.numel() * p.element_size() for p in group], first, cap)
            out += [[group[i] for i in b] for b in plan]
        return out

    def _register_hooks(self, params: list[torch.Tensor]) -> None:
        if not self._included:
            return
        trainable = [p for p in params if p.requires_grad]
        self._requires_update.extend(trainable)
        self._form_groups(trainable)
        ref = weakref.ref(self)
        for p in trainable:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref)))

    # ------------------------------------------------------------ reductions

    def _scales(self) -> tuple[float, float]:
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _dense_grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:
            # no gradient this step (unused parameter): reduce zeros so that no rank waits for it
            p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
        grad = p.grad
        return grad.to_dense() if grad.is_sparse else grad

    def _sparse(self, p: torch.Tensor) -> bool:
        """Reduced as a sparse tensor (indices and values allgathered), as Horovod does without sparse_as_dense."""
        return p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense

    def _submit(self, p: torch.Tensor) -> tuple[Any, Any]:
        if self._adasum:
            return self._submit_delta(p)
        if self._sparse(p):
            assert p.grad is not None
            return sparse_allreduce_async(p.grad, name=self._names[p], op=self.op, process_set=self.process_set), None
        tensor = self._dense_grad(p)
        compressed, ctx = self._compression.compress(tensor)
        pre, post = self._scales()
        handle = allreduce_async_(compressed, name=self._names[p], op=self.op,
                                  prescale_factor=pre, postscale_factor=post, process_set=self.process_set)
        return handle, (ctx, compressed)

    def _submit_delta(self, p: torch.Tensor) -> tuple[Any, Any]:
        """Adasum: step the wrapped optimizer on ``p`` alone, reduce the change it made (Adasum), and
        keep the starting value; ``step()`` sets ``p`` to the start plus the reduced change."""
        start = p.detach().clone()
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [q for q in group["params"] if q is p]
            self._optimizer.step()
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        with torch.no_grad():
            p.sub_(start)  # p holds the delta until step()
        compressed, cctx = self._compression.compress(p.detach())
        handle = allreduce_async_(compressed, name=self._names[p], op=Adasum, process_set=self.process_set)
        return handle, (start, cctx)

    def _submit_group(self, group: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        if any(self._sparse(p) for p in group):
            # a sparse gradient cannot share a fused buffer: each member is reduced on its own
            parts = [self._submit(p) for p in group]
            handle = Handle("allreduce", self._names[group[0]], Several([h for h, _ in parts]), lambda raw: raw)
            return handle, [c for _, c in parts]
        # a sparse gradient reduced as dense (sparse_as_dense) is a copy: it is written back below
        all_dense = not any(p.grad is not None and p.grad.is_sparse for p in group)
        tensors = [self._dense_grad(p) for p in group]
        pre, post = self._scales()
        bucket = self._device_buckets.get(group) if all_dense else None
        if bucket is not None:  # results land in the gradients themselves: nothing to write back
            handle = bucket.start(tensors, name=self._names[group[0]], op=self.op, compression=self._compression,
                                  prescale=pre, postscale=post, process_set=self.process_set)
            return handle, _WRITTEN
        on_host = self._host_buckets.get(group) if all_dense else None
        if on_host is not None:
            return on_host.start(tensors, name=self._names[group[0]], op=self.op, prescale=pre, postscale=post,
                                 process_set=self.process_set), _WRITTEN
        pairs = [self._compression.compress(t) for t in tensors]
        handle = grouped_allreduce_async_([c for c, _ in pairs], name=self._names[group[0]],
                                          op=self.op, prescale_factor=pre, postscale_factor=post,
                                          process_set=self.process_set)
        return handle, [(ctx, c) for c, ctx in pairs]

    def _grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate hook body: count the pass and start the reduction on the k-th."""
        with self._lock:
            if p not in self._delay:
                return
            if self._delay[p] <= 0:
                raise GradientsPendingError(_TOO_MANY_PASSES_MSG)
            self._delay[p] -= 1
            group = self._group_of.get(p)
            if self._delay[p] > 0:
                # accumulating locally; the entry makes zero_grad() refuse until step()
                self._handles.setdefault(p if group is None else group, (None, None))
                return
            if group is None:
                self._handles[p] = self._submit(p)
                return
            self._group_counts[group] += 1
            if self._group_counts[group] == len(group):
                self._handles[group] = self._submit_group(group)
                self._group_counts[group] = 0
            else:
                self._handles.setdefault(group, (None, None))

    def _write_back(self, p: torch.Tensor, output: torch.Tensor, ctx: Any) -> None:
        if ctx is None:  # a sparse reduction: every rank's entries, summed per index
            p.grad = output.coalesce()
            return
        cctx, sent = ctx
        value = self._compression.decompress(output, cctx)
        assert p.grad is not None  # only parameters with a gradient are written back
        with torch.no_grad():
            if p.grad.is_sparse:
                p.grad = value.to_sparse()
            elif value is not p.grad:
                p.grad.copy_(value)

    def synchronize(self) -> None:
        """Finish every gradient reduction of this step; ``p.grad`` then holds the reduced values.

        Parameters that received no gradient are reduced as zeros, so ranks whose
        forward pass skipped a layer do not leave the others waiting.  With ``op=Adasum``
        (more than one rank) there is nothing to do here: ``step()`` finishes the reductions.
        """
        if self._adasum:
            return
        if not self._included:  # outside the process set: the local gradients stay as they are
            self._synchronized = True
            return
        with self._lock:
            # start whatever has not been started: parameters without gradients and delayed passes
            for group in list(self._group_counts):
                handle = self._handles.get(group)
                if handle is None or handle[0] is None:
                    self._handles[group] = self._submit_group(group)
                    self._group_counts[group] = 0
            for p in self._requires_update:
                if p in self._group_of:
                    continue
                entry = self._handles.get(p)
                if entry is None or entry[0] is None:
                    self._handles[p] = self._submit(p)
            handles, self._handles = self._handles, {}
            self._reset_delays()
        error: BaseException | None = None
        for key, (handle, ctx) in handles.items():
            try:
                outputs = synchronize(handle)
            except BaseException as exc:  # finish the others, then raise the first failure
                error = error or exc
                continue
            if ctx is _WRITTEN:
                continue
            if isinstance(key, tuple):
                for p, out, c in zip(key, outputs, ctx):
                    self._write_back(p, out, c)
            else:
                self._write_back(key, outputs, ctx)
        if error is not None:
            raise error
        self._synchronized = True

    def _reset_delays(self) -> None:
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        for group in self._group_counts:
            self._group_counts[group] = 0

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before each reduction."""
        with self._lock:
            self.backward_passes_per_step = int(passes)
            self._reset_delays()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make ``step()`` skip ``synchronize()``, for when you called it yourself (e.g. to clip)::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        if self._adasum:
            raise GradientsPendingError(_ADASUM_SKIP_MSG)
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """``synchronize()`` (unless inside ``skip_synchronize()``), then the wrapped optimizer's step."""
        if self._adasum:
            return self._adasum_step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC_MSG, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._optimizer.step() if closure is None else self._optimizer.step(closure)

    def _adasum_step(self, closure: Any) -> Any:
        """Adasum: every parameter's delta (stepped during backward, or now if it had no gradient) is
        reduced with Adasum, and the parameter becomes its starting value plus the reduced delta."""
        loss = closure() if closure is not None else None
        with self._lock:
            for p in self._requires_update:
                entry = self._handles.get(p)
                if entry is None or entry[0] is None:
                    self._handles[p] = self._submit_delta(p)
            handles, self._handles = self._handles, {}
            self._reset_delays()
        error: BaseException | None = None
        for p, (handle, (start, cctx)) in handles.items():
            try:
                delta = self._compression.decompress(synchronize(handle), cctx)
            except BaseException as exc:  # finish the others, then raise the first failure
                error = error or exc
                continue
            with torch.no_grad():
                p.copy_(start.add_(delta))
        if error is not None:
            raise error
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; refused while reductions are pending."""
        if self._handles:
            raise GradientsPendingError(_ZERO_GRAD_MSG)
        self._optimizer.zero_grad(set_to_none=set_to_none)


def _make_hook(ref: "weakref.ReferenceType[DistributedOptimizer]") -> Any:
    def hook(p: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt._grad_ready(p)
    return hook


def _remove_hooks(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
