"""The gradient reductions behind ``DistributedOptimizer``: buckets, ready counts, handles, submit
and write-back.

A :class:`Reducer` owns what the hooks and ``synchronize()`` share: which parameters form each
group (DDP's buckets, or ``groups=``), how many of a group's gradients are ready in this pass,
how many backward passes each parameter still accumulates, and the handles of the reductions in
flight.  The optimizer (:mod:`.optimizer`) keeps Horovod's surface and delegates to it::

    r = Reducer(names, Compression.none, Average, 1.0, False, global_process_set, 1, None, step_alone)
    r.add(trainable)          # forms the buckets
    r.grad_ready(p)           # a hook: counts the pass, starts a bucket's allreduce on its last gradient
    r.synchronize()           # waits for every reduction; p.grad holds the result
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ringcomm import api as _core_api
from ringcomm.elastic.worker import current_world
from ringcomm.errors import RingcommError
from ringcomm.handles import GroupHandle

from .basics import global_process_set, rank, size
from .buckets import DEVICE_DTYPES, DeviceBucket, GroupKey, HostBucket, bucket_caps, plan_buckets, split_list
from .collectives import Adasum, Average, Sum, allreduce_async_, grouped_allreduce_async_, synchronize
from .device import ops_for, service
from .device_ipc import IpcBucket, log_once, refusal, share_buckets
from .handles import Handle
from .sparse import sparse_allreduce_async

__all__ = ["Reducer", "GradientsPendingError"]

_log = logging.getLogger(__name__)

_TOO_MANY_PASSES_MSG = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)

_WRITTEN = object()  # a bucket's handle wrote the reduced values into the gradients itself


class GradientsPendingError(RingcommError, AssertionError):
    """Gradients were touched while their reductions were in flight (Horovod raises AssertionError)."""


class Reducer:
    """The reductions of one optimizer's gradients (see the module docstring).

    ``step_alone(p)`` is Adasum's: it steps the wrapped optimizer on ``p`` alone, leaves the
    change in ``p`` and returns the starting value (``adasum``: reduce those changes instead of
    the gradients, one parameter per op)."""

    def __init__(self, names: dict[torch.Tensor, str], compression: Any, op: Any, predivide: float,
                 sparse_as_dense: bool, process_set: Any, passes: int, groups: Any, adasum: bool,
                 step_alone: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.names = names
        self.compression = compression
        self.op = op
        self.predivide = predivide
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.passes = passes
        self.adasum = adasum
        self._groups_spec = groups
        self._step_alone = step_alone
        self.lock = threading.RLock()
        self.delay: dict[torch.Tensor, int] = {}
        self.handles: dict[Any, tuple[Any, Any]] = {}
        self.requires_update: list[torch.Tensor] = []
        self.group_of: dict[torch.Tensor, tuple[torch.Tensor, ...]] = {}
        self.group_counts: dict[tuple[torch.Tensor, ...], int] = {}
        self.device_buckets: dict[tuple[torch.Tensor, ...], DeviceBucket] = {}
        self.host_buckets: dict[tuple[torch.Tensor, ...], HostBucket] = {}

    # ------------------------------------------------------------ setup

    def watch(self, params: list[torch.Tensor]) -> None:
        """Count backward passes for ``params`` (every parameter of the optimizer)."""
        for p in params:
            self.delay[p] = self.passes

    def add(self, trainable: list[torch.Tensor]) -> None:
        """Reduce these parameters' gradients from now on, in the groups formed for them."""
        self.requires_update.extend(trainable)
        before = set(self.device_buckets)
        self._form_groups(trainable)
        self._on_device([k for k in self.device_buckets if k not in before])

    def _on_device(self, keys: list[Any]) -> None:
        """Where the ranks of each host can reach each other's GPUs (some host with two ranks or more),
        the new device buckets ``keys`` become :class:`IpcBucket` (on every rank, or on none; the
        reason is logged once).  A collective of the job: every rank forms the same buckets."""
        if not keys:
            return
        enabled = _core_api.current_settings().device_ipc
        n = size()
        if self.process_set not in (None, global_process_set):
            log_once(False, "the optimizer reduces over a process set")
            return
        why = refusal(enabled, n, current_world() is not None)
        if why is not None:
            log_once(False, why)
            return
        probes = [torch.zeros(1, dtype=dt) for dt in {k[0].dtype for k in keys}]
        flat_ok = all(self.compression.compress(probe)[0] is probe for probe in probes)
        candidates = [IpcBucket(k, [self.names[p] for p in k], self.device_buckets[k].service) for k in keys]
        if share_buckets(candidates, rank(), n, self.op in (Sum, Average), flat_ok, self.process_set):
            for k, bucket in zip(keys, candidates):
                self.device_buckets[k] = bucket

    def _unshared(self, key: Any, bucket: IpcBucket) -> DeviceBucket:
        """A bucket shared in a job that has since ended (``shutdown()`` and ``init()`` again): its
        peers' buffers and events belong to that job, so from now on it goes through pinned host
        memory, on every rank alike (each sees the new job)."""
        if all(isinstance(b, IpcBucket) for b in self.device_buckets.values()):  # the first one: say it once
            _log.warning("rank %d: DistributedOptimizer's CUDA buckets were shared with the ranks of an earlier "
                         "job; they go through pinned host memory from now on (make the optimizer again to share "
                         "them with this job's ranks)", rank())
        plain = self.device_buckets[key] = DeviceBucket(key, bucket.names, bucket.service)
        return plain

    def _form_groups(self, params: list[torch.Tensor]) -> None:
        spec = self._groups_spec
        if self.adasum:
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
                self.group_of[p] = key
            self.group_counts[key] = 0
            ops = self._device_ops(key[0])
            if ops is not None and all(self._device_ops(p) is ops and p.dtype is key[0].dtype
                                       and p.device == key[0].device for p in key):
                self.device_buckets[key] = DeviceBucket(key, [self.names[p] for p in key],
                                                        service(ops, key[0].device))
            elif ops is None and self._flat_on_host(key):
                self.host_buckets[key] = HostBucket(key, [self.names[p] for p in key])

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
        return bool(self.compression.compress(probe)[0] is probe)

    @staticmethod
    def _buckets_by_kind(params: list[torch.Tensor], first: int, cap: int) -> list[list[torch.Tensor]]:
        """Parameters in reverse order, one bucket list per (device, dtype), DDP's sizes."""
        by_kind: dict[tuple[Any, torch.dtype], list[torch.Tensor]] = {}
        for p in reversed(params):
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        out = []
        for group in by_kind.values():
            plan = plan_buckets([p.numel() * p.element_size() for p in group], first, cap)
            out += [[group[i] for i in b] for b in plan]
        return out

    # ------------------------------------------------------------ submit

    def _scales(self) -> tuple[float, float]:
        if self.op == Average:
            return 1.0 / self.predivide, self.predivide
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

    def submit(self, p: torch.Tensor) -> tuple[Any, Any]:
        """Start the reduction of one parameter that is in no group; returns (handle, context)."""
        if self.adasum:
            return self.submit_delta(p)
        if self._sparse(p):
            assert p.grad is not None
            return sparse_allreduce_async(p.grad, name=self.names[p], op=self.op, process_set=self.process_set), None
        tensor = self._dense_grad(p)
        compressed, ctx = self.compression.compress(tensor)
        pre, post = self._scales()
        handle = allreduce_async_(compressed, name=self.names[p], op=self.op,
                                  prescale_factor=pre, postscale_factor=post, process_set=self.process_set)
        return handle, (ctx, compressed)

    def submit_delta(self, p: torch.Tensor) -> tuple[Any, Any]:
        """Adasum: step ``p`` alone, reduce the change it made (Adasum), keep the starting value."""
        start = self._step_alone(p)
        compressed, cctx = self.compression.compress(p.detach())
        handle = allreduce_async_(compressed, name=self.names[p], op=Adasum, process_set=self.process_set)
        return handle, (start, cctx)

    def submit_group(self, group: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        """Start the reduction of one group (a bucket, where it has one); returns (handle, context)."""
        if any(self._sparse(p) for p in group):
            # a sparse gradient cannot share a fused buffer: each member is reduced on its own
            parts = [self.submit(p) for p in group]
            handle = Handle("allreduce", self.names[group[0]], GroupHandle(None, [h for h, _ in parts]), lambda raw: raw)
            return handle, [c for _, c in parts]
        # a sparse gradient reduced as dense (sparse_as_dense) is a copy: it is written back below
        all_dense = not any(p.grad is not None and p.grad.is_sparse for p in group)
        tensors = [self._dense_grad(p) for p in group]
        pre, post = self._scales()
        bucket = self.device_buckets.get(group) if all_dense else None
        if isinstance(bucket, IpcBucket) and bucket.job is not _core_api.current_settings():
            bucket = self._unshared(group, bucket)
        if bucket is not None:  # results land in the gradients themselves: nothing to write back
            handle = bucket.start(tensors, name=self.names[group[0]], op=self.op, compression=self.compression,
                                  prescale=pre, postscale=post, process_set=self.process_set)
            return handle, _WRITTEN
        on_host = self.host_buckets.get(group) if all_dense else None
        if on_host is not None:
            return on_host.start(tensors, name=self.names[group[0]], op=self.op, prescale=pre, postscale=post,
                                 process_set=self.process_set), _WRITTEN
        pairs = [self.compression.compress(t) for t in tensors]
        handle = grouped_allreduce_async_([c for c, _ in pairs], name=self.names[group[0]],
                                          op=self.op, prescale_factor=pre, postscale_factor=post,
                                          process_set=self.process_set)
        return handle, [(ctx, c) for c, ctx in pairs]

    def grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate hook body: count the pass and start the reduction on the k-th."""
        with self.lock:
            if p not in self.delay:
                return
            if self.delay[p] <= 0:
                raise GradientsPendingError(_TOO_MANY_PASSES_MSG)
            self.delay[p] -= 1
            group = self.group_of.get(p)
            if self.delay[p] > 0:
                # accumulating locally; the entry makes zero_grad() refuse until step()
                self.handles.setdefault(p if group is None else group, (None, None))
                return
            if group is None:
                self.handles[p] = self.submit(p)
                return
            self.group_counts[group] += 1
            if self.group_counts[group] == len(group):
                self.handles[group] = self.submit_group(group)
                self.group_counts[group] = 0
            else:
                self.handles.setdefault(group, (None, None))

    # ------------------------------------------------------------ finish

    def _write_back(self, p: torch.Tensor, output: torch.Tensor, ctx: Any) -> None:
        if ctx is None:  # a sparse reduction: every rank's entries, summed per index
            p.grad = output.coalesce()
            return
        cctx, sent = ctx
        value = self.compression.decompress(output, cctx)
        assert p.grad is not None  # only parameters with a gradient are written back
        with torch.no_grad():
            if p.grad.is_sparse:
                p.grad = value.to_sparse()
            elif value is not p.grad:
                p.grad.copy_(value)

    def synchronize(self) -> None:
        """Start what has not been started (parameters without gradients, delayed passes), wait for
        every reduction and write the results back; raises the first failure once all are done."""
        with self.lock:
            for group in list(self.group_counts):
                handle = self.handles.get(group)
                if handle is None or handle[0] is None:
                    self.handles[group] = self.submit_group(group)
                    self.group_counts[group] = 0
            for p in self.requires_update:
                if p in self.group_of:
                    continue
                entry = self.handles.get(p)
                if entry is None or entry[0] is None:
                    self.handles[p] = self.submit(p)
            handles, self.handles = self.handles, {}
            self.reset_delays()
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

    def take_deltas(self) -> dict[Any, tuple[Any, Any]]:
        """Adasum: start the delta of every parameter that has none in flight; returns every
        (handle, (start, compression context)) and forgets them."""
        with self.lock:
            for p in self.requires_update:
                entry = self.handles.get(p)
                if entry is None or entry[0] is None:
                    self.handles[p] = self.submit_delta(p)
            handles, self.handles = self.handles, {}
            self.reset_delays()
        return handles

    def reset_delays(self) -> None:
        for p in self.delay:
            self.delay[p] = self.passes
        for group in self.group_counts:
            self.group_counts[group] = 0

    def set_passes(self, passes: int) -> None:
        with self.lock:
            self.passes = int(passes)
            self.reset_delays()

    def clear(self) -> None:
        """Forget the reductions in flight and the passes counted (``load_state_dict``)."""
        with self.lock:
            self.handles.clear()
            self.reset_delays()

    def pending(self) -> bool:
        """Whether any reduction was started or any pass accumulated since the last synchronize."""
        return bool(self.handles)
