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

The reductions themselves (the buckets, the ready counts, the handles in flight, submit and
write-back) belong to the optimizer's :class:`~.reducer.Reducer` (``opt.reducer``); the
optimizer keeps Horovod's surface and delegates to it.

What each rank sees (size 2, the same model; rank r's batch gives grad g_r)::

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    loss.backward()       # reductions start during backward
    opt.step()            # every rank: p.grad == (g_0 + g_1) / 2, then p -= 0.1 * p.grad
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ringcomm.errors import InvalidInputError, InvalidTypeError

from .basics import check_process_set, global_process_set, size
from .collectives import Adasum, Average, synchronize
from .compression import Compression
from .reducer import GradientsPendingError, Reducer

__all__ = ["DistributedOptimizer", "GradientsPendingError"]

_ZERO_GRAD_MSG = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_ADASUM_SKIP_MSG = "Skipping synchronization is not supported when using Adasum optimizer."
_STEP_AFTER_SYNC_MSG = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
    "This can cause training slowdown. You may want to consider using optimizer.skip_synchronize() "
    "context if you use optimizer.synchronize() in your code."
)



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
        self._names = self._name_parameters(named_parameters)
        self._synchronized = False
        self._should_synchronize = True
        self.reducer = Reducer(self._names, compression, op, self.gradient_predivide_factor, sparse_as_dense,
                               process_set, self.backward_passes_per_step, self._check_groups(groups),
                               self._adasum, _step_alone_of(weakref.ref(self)))
        self.reducer.watch(self._all_params())
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
        self.reducer.clear()
        self._synchronized = False
        self._should_synchronize = True
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        before = {id(p) for p in self._all_params()}
        self._optimizer.add_param_group(param_group)
        new = [p for p in self._all_params() if id(p) not in before]
        gi = len(self.param_groups) - 1
        for j, p in enumerate(new):
            self._names.setdefault(p, f"noname.{gi}.{j}")
        self.reducer.watch(new)
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

    def _register_hooks(self, params: list[torch.Tensor]) -> None:
        if not self._included:
            return
        trainable = [p for p in params if p.requires_grad]
        self.reducer.add(trainable)
        ref = weakref.ref(self)
        for p in trainable:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref)))

    # ------------------------------------------------------------ reductions

    def _step_alone(self, p: torch.Tensor) -> torch.Tensor:
        """Adasum: step the wrapped optimizer on ``p`` alone and leave the change it made in ``p``;
        returns the starting value (``step()`` sets ``p`` to it plus the reduced change)."""
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
        return start

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
        self.reducer.synchronize()
        self._synchronized = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before each reduction."""
        self.backward_passes_per_step = int(passes)
        self.reducer.set_passes(passes)

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
        handles = self.reducer.take_deltas()
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
        if self.reducer.pending():
            raise GradientsPendingError(_ZERO_GRAD_MSG)
        self._optimizer.zero_grad(set_to_none=set_to_none)


def _make_hook(ref: "weakref.ReferenceType[DistributedOptimizer]") -> Any:
    def hook(p: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt.reducer.grad_ready(p)
    return hook


def _step_alone_of(ref: "weakref.ReferenceType[DistributedOptimizer]") -> Any:
    """The optimizer's ``_step_alone``, held weakly by its reducer (the hooks hold the optimizer
    weakly too, so that dropping it removes them at once)."""
    def step_alone(p: torch.Tensor) -> torch.Tensor:
        opt = ref()
        if opt is None:
            raise ReferenceError("DistributedOptimizer: the optimizer was dropped during an Adasum step")
        return opt._step_alone(p)
    return step_alone


def _remove_hooks(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
