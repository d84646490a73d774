"""The ``"ringcomm"`` process group: torch.distributed's collectives on ringcomm's engine.

Every collective stages its tensors as host arrays (:mod:`ringcomm_torch.tensors`: a
contiguous CPU tensor *is* the array, no copy; CUDA tensors go through the pinned buffers
and side stream of their device's one service, :mod:`ringcomm_torch.device`),
submits them to the core under a name counted per group (every rank calls a group's
collectives in the same order, as torch requires), and returns a
:class:`~.work.RingcommWork` that completes when the core's handles do.

Group ranks (``rootRank``, split order) are ranks within the group; the core's roots are
global ranks, translated through the group's global ranks.  A group over every rank runs on
ringcomm's global process set; a smaller one on the process set registered for it
(:func:`ringcomm_torch.distributed.new_group`).

Under ``torch.compile`` the collectives run as they are, never traced: torch calls them from its
C++ side (DDP's reducer, the functional collectives), and TorchDynamo, once loaded, would
otherwise try to compile each such Python frame, and it cannot read a process group's
attributes (:mod:`ringcomm_torch.tracing`).
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ringcomm as rc
from ringcomm.core import ops as _ops
from ringcomm.errors import InvalidInputError

from .. import device_arena_ops
from ..collectives import staged_allreduce, staged_broadcast, staged_op
from ..device_arena import Arena, arena_for, one_host_arena_for
from ..tensors import Staged, begin, host_memory, stage
from ..tracing import untraced_methods
from .arguments import check_root, check_tensors, reduce_op, refusing
from .exchange_counts import gather_counts, scatter_counts, single_receipts
from .work import RingcommWork, as_backend_error, completer, sync_calls_wait

__all__ = ["RingcommProcessGroup", "NAME"]

NAME = "ringcomm"


def _flat(s: Staged) -> np.ndarray:
    return s.array.reshape(-1)


def _allgather_kind(tensors: int) -> str:
    """The core op that gathers ``tensors`` tensors (:meth:`RingcommProcessGroup._allgather_rows`)."""
    return "allgather" if tensors == 1 else "grouped_allgather"


def _release(staged: Sequence[Staged]) -> None:
    for s in staged:
        s.release()


class RingcommProcessGroup(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose collectives run on ringcomm (see the module docstring)."""

    def __init__(self, rank: int, size: int, global_ranks: Sequence[int], process_set: Any,
                 timeout: datetime.timedelta | None = None, owns_runtime: bool = False) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank = rank
        self._size = size
        self._ranks = tuple(global_ranks)
        self._pset = process_set
        self._timeout = timeout
        self._owns_runtime = owns_runtime
        self._seq = itertools.count()
        self._mb = itertools.count()
        self._store: Any = None  # torch's store for this group (monitored_barrier)
        self._group_name = self._group_desc = ""  # set by torch once it has made the group
        self._tag = "g" if process_set is rc.global_process_set else f"s{process_set.process_set_id}"

    # -- identity -------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    # torch names a group after creating it (``_set_group_name``) and reads the name back through its
    # backends (``group_name``), which a Python group has none of: DeviceMesh, FSDP2 and DTensor read it
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]  # torch's GroupName is a str
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"<RingcommProcessGroup rank {self._rank} of {self._size}, global ranks {list(self._ranks)}>"

    def shutdown(self) -> None:
        if self._owns_runtime:
            from . import init

            init.leave()

    def abort(self) -> None:
        self.shutdown()

    # -- helpers --------------------------------------------------------------

    def _name(self, kind: str) -> str:
        return f"tdist.{self._tag}.{kind}.{next(self._seq)}"

    def _refusing(self, what: str, kind: str, *names: str, parts: int = 1) -> Any:
        """The checks of ``what`` (the core's ``kind`` op, submitted under ``names``): one that fails
        refuses the op on every rank of the group (:func:`.arguments.refusing`)."""
        return refusing(self._rank, self._pset, what, kind, names, parts)

    def _arena_work(self, what: str, start: Callable[[], Any], result: Callable[[], Any]) -> RingcommWork:
        """The work of an op on the host's shared arenas (:mod:`ringcomm_torch.device_arena_ops`):
        ``start()`` returns its handle; the work completes with ``result()``."""
        try:
            handle = start()
        except BaseException as exc:
            raise as_backend_error(f"{what} on rank {self._rank}", exc) from exc
        return completer.submit(f"{what} on rank {self._rank}", [handle], lambda _results: result())

    def _start(self, what: str, submit: Callable[[], list[Any]], finish: Callable[[list[Any]], Any],
               staged: Sequence[Staged] = ()) -> RingcommWork:
        """Submit the core ops (``submit`` returns their handles); the work completes with ``finish``.

        Device tensors go through their device's service (:mod:`ringcomm_torch.device`): the
        results are copied home on the stream that is current here, at the call, in its order
        (the completer thread's own current stream is another)."""
        for s in staged:
            if s.service is not None:
                s.consumer = s.service.current()
        ready = [s.ready for s in staged if s.ready is not None]
        try:
            # CUDA tensors: the stager submits once their copies to the host are done (the names
            # are explicit, so the order the core sees them in does not matter); the completer
            # takes the handles from it
            handles: Any = submit() if not ready else begin(staged, submit, what)
        except BaseException as exc:
            _release(staged)
            raise as_backend_error(f"{what} on rank {self._rank}", exc) from exc

        def done(results: list[Any]) -> Any:
            try:
                return finish(results)
            finally:
                _release(staged)
        return completer.submit(f"{what} on rank {self._rank}", handles, done)

    # -- reductions -------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RingcommWork:  # type: ignore[override]
        return self._allreduce_list(tensors, opts, "allreduce")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> RingcommWork:
        return self._allreduce_list(tensors, opts, "allreduce_coalesced")

    def _allreduce_list(self, tensors: list[torch.Tensor], opts: Any, what: str) -> RingcommWork:
        name = self._name("ar")
        with self._refusing(what, "allreduce" if len(tensors) == 1 else "grouped_allreduce", name):
            op = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, what)
            check_tensors(tensors, what)
        arena = arena_for(tensors[0], op, self._pset) if len(tensors) == 1 else None
        if arena is not None:  # one CUDA tensor (a DDP bucket), on one host: reduced on the GPUs
            return self._device_allreduce(arena, tensors[0], op, what, name)
        staged = [stage(t, reduce=True, what=what) for t in tensors]

        def submit() -> list[Any]:
            if len(staged) == 1:
                a = staged[0].array
                return [rc.allreduce_async(a, op=op, name=name, out=a, process_set=self._pset)]
            arrays = [s.array for s in staged]
            return [rc.grouped_allreduce_async(arrays, op=op, name=name, outs=arrays, process_set=self._pset)]

        def finish(_: list[Any]) -> list[torch.Tensor]:
            for s, t in zip(staged, tensors):
                s.write_back(t)
            return tensors
        return self._start(what, submit, finish, staged)

    def _device_allreduce(self, arena: Arena, t: torch.Tensor, op: _ops.ReduceOp, what: str,
                          name: str) -> RingcommWork:
        """:meth:`allreduce` of one device tensor through the host's shared arenas
        (:mod:`ringcomm_torch.device_arena`); the result is ordered before later work of the
        stream current here, as on the pinned path."""
        consumer = arena.service.current()
        return self._arena_work(what, lambda: device_arena_ops.allreduce(
            arena, t, in_place=True, core_name=name, name=name, average=op is rc.Average, prescale=1.0, postscale=1.0,
            consumer=consumer,
            fallback=lambda nm: staged_allreduce(t, stage(t, reduce=True, what=what), True, name, nm, op, 1.0,
                                                 1.0, self._pset, consumer)), lambda: [t])

    def _device_broadcast(self, arena: Arena, t: torch.Tensor, root: int, name: str) -> RingcommWork:
        """:meth:`broadcast` of one device tensor from the root's arena (``root``: a global rank),
        ordered before later work of the stream current here, as on the pinned path."""
        consumer = arena.service.current()
        return self._arena_work("broadcast", lambda: device_arena_ops.broadcast(
            arena, t, root=root, in_place=True, core_name=name, name=name, consumer=consumer,
            fallback=lambda nm: staged_broadcast(
                t, stage(t, reduce=False, what="broadcast", values=root == self._ranks[self._rank]), root, True,
                name, nm, self._pset, consumer)), lambda: [t])

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> RingcommWork:  # type: ignore[override]
        name = self._name("reduce")
        with self._refusing("reduce", "allreduce", name):
            op = reduce_op(opts.reduceOp, "reduce")
            check_root(opts.rootRank, self._size, "reduce")
            check_tensors(tensors[:1], "reduce")
        t = tensors[0]
        s = stage(t, reduce=True, what="reduce")
        mine = self._rank == opts.rootRank
        out = s.array if mine else np.empty_like(s.array)  # only the root's tensor changes

        def finish(_: list[Any]) -> list[torch.Tensor]:
            if mine:
                s.write_back(t)
            return tensors
        return self._start("reduce", lambda: [rc.allreduce_async(s.array, op=op, name=name, out=out,
                                                                process_set=self._pset)], finish, [s])

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> RingcommWork:
        what = "reduce_scatter"
        name = self._name("rs")
        out, parts = outputs[0], input_lists[0]
        with self._refusing(what, "reducescatter", name):
            op = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, what)
            if len(parts) != self._size:
                raise InvalidInputError(f"{what}: {len(parts)} input tensors for a group of {self._size}; "
                                        "pass one per rank")
            check_tensors(parts, what)
        whole = torch.cat([p.detach().reshape(1, -1) for p in parts])
        return self._reduce_scatter(out, whole, op, what, name)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RingcommWork:
        what = "reduce_scatter_tensor"
        name = self._name("rs")
        with self._refusing(what, "reducescatter", name):
            op = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, what)
            if input.numel() != output.numel() * self._size:
                raise InvalidInputError(f"{what}: the input has {input.numel()} elements, the output "
                                        f"{output.numel()}; the input must hold group size ({self._size}) x the "
                                        "output's elements")
            check_tensors([input], what)
        return self._reduce_scatter(output, input, op, what, name)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def _reduce_scatter(self, out: torch.Tensor, whole: torch.Tensor, op: _ops.ReduceOp, what: str,
                        name: str) -> RingcommWork:
        arena = one_host_arena_for(whole, self._pset, op)
        if arena is not None:  # a CUDA tensor (FSDP's gradients), every rank on one host: summed on the GPUs
            return self._device_reduce_scatter(arena, out, whole, op, what, name)
        s = stage(whole, reduce=True, what=what)
        rows = s.array.reshape(self._size, -1)

        def finish(results: list[Any]) -> list[torch.Tensor]:
            s.write_back(out, results[0].reshape(-1))
            return [out]
        return self._start(what, lambda: [rc.reducescatter_async(rows, op=op, name=name, process_set=self._pset)],
                           finish, [s])

    def _device_reduce_scatter(self, arena: Arena, out: torch.Tensor, whole: torch.Tensor, op: _ops.ReduceOp,
                               what: str, name: str) -> RingcommWork:
        """:meth:`_reduce_scatter` of a device tensor through the host's shared arenas, ordered before
        later work of the stream current here, as on the pinned path."""
        consumer = arena.service.current()

        def pinned(nm: str) -> Any:
            s = stage(whole, reduce=True, what=what)
            return staged_op("reducescatter", s, nm, self._pset,
                             lambda n: rc.reducescatter_async(s.array.reshape(self._size, -1), op=op, name=n,
                                                              process_set=self._pset),
                             lambda raw: s.write_back(out, np.asarray(raw).reshape(-1)), consumer)
        return self._arena_work(what, lambda: device_arena_ops.reduce_scatter(
            arena, whole, out, average=op is rc.Average, core_name=name, name=name, consumer=consumer,
            fallback=pinned), lambda: [out])

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> RingcommWork:
        what = "reduce_scatter_tensor_coalesced"
        name = self._name("rsc")
        with self._refusing(what, "grouped_reducescatter", name, parts=len(inputs)):
            op = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, what)
            check_tensors(inputs, what)
        staged = [stage(t, reduce=True, what=what) for t in inputs]

        def submit() -> list[Any]:
            arrays = [s.array.reshape(self._size, -1) for s in staged]
            return [rc.grouped_reducescatter_async(arrays, op=op, name=name, process_set=self._pset)]

        def finish(results: list[Any]) -> list[torch.Tensor]:
            for s, o, r in zip(staged, outputs, results[0]):
                s.write_back(o, r.reshape(-1))
            return outputs
        return self._start(what, submit, finish, staged)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    # -- data movement ------------------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> RingcommWork:  # type: ignore[override]
        name = self._name("bc")
        # an op per tensor: one tensor's is named as on the arena (below), several are name.i
        names = [name] if len(tensors) == 1 else [f"{name}.{i}" for i in range(len(tensors))]
        with self._refusing("broadcast", "broadcast", *names):
            check_root(opts.rootRank, self._size, "broadcast")
            check_tensors(tensors, "broadcast")
        root = self._ranks[opts.rootRank]
        arena = one_host_arena_for(tensors[0], self._pset) if len(tensors) == 1 else None
        if arena is not None:  # one CUDA tensor (DDP's buffers), every rank on one host: copied on the GPUs
            return self._device_broadcast(arena, tensors[0], root, name)
        at_root = self._rank == opts.rootRank  # the other ranks' values are not read: not copied to the host
        staged = [stage(t, reduce=False, what="broadcast", values=at_root) for t in tensors]

        def submit() -> list[Any]:
            return [rc.broadcast_async(s.array, root, name=n, out=s.array, process_set=self._pset)
                    for n, s in zip(names, staged)]

        def finish(_: list[Any]) -> list[torch.Tensor]:
            if not at_root:  # the root's tensors hold the result already
                for s, t in zip(staged, tensors):
                    s.write_back(t)
            return tensors
        return self._start("broadcast", submit, finish, staged)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> RingcommWork:
        return self._allgather_lists(output_lists, inputs, "allgather")

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> RingcommWork:
        return self._allgather_lists(output_lists, inputs, "allgather_coalesced")

    def _allgather_lists(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                         what: str) -> RingcommWork:
        name = self._name("ag")
        with self._refusing(what, _allgather_kind(len(inputs)), name, parts=len(inputs)):
            for outs in output_lists:
                if len(outs) != self._size:
                    raise InvalidInputError(f"{what}: {len(outs)} output tensors for a group of {self._size}; "
                                            "pass one per rank")
            check_tensors(inputs, what)
        if len(inputs) == 1 and all(o.numel() == inputs[0].numel() for o in output_lists[0]):
            arena = one_host_arena_for(inputs[0], self._pset)
            if arena is not None:  # one CUDA tensor, every rank on one host: copied on the GPUs
                return self._device_allgather(arena, inputs[0], output_lists[0], None, what, name,
                                              lambda: output_lists)
        staged = [stage(t, reduce=False, what=what) for t in inputs]

        def submit() -> list[Any]:
            return self._allgather_rows(staged, name)

        def finish(results: list[Any]) -> list[list[torch.Tensor]]:
            gathered = results[0] if len(staged) == 1 else None
            for i, (s, outs) in enumerate(zip(staged, output_lists)):
                rows = gathered if gathered is not None else results[0][i]
                for r, o in enumerate(outs):
                    s.write_back(o, rows[r])
            return output_lists
        return self._start(what, submit, finish, staged)

    def _device_allgather(self, arena: Arena, t: torch.Tensor, parts: list[torch.Tensor],
                          copy_into: tuple[torch.Tensor, torch.Tensor] | None, what: str, name: str,
                          result: Callable[[], Any]) -> RingcommWork:
        """An allgather of one device tensor through the host's shared arenas into ``parts`` (one
        per rank; with ``copy_into``, ``(output, gathered)``, rows of ``gathered``, copied into
        ``output`` after), ordered before later work of the stream current here, as on the pinned path."""
        consumer = arena.service.current()

        def pinned(nm: str) -> Any:
            s = stage(t, reduce=False, what=what)

            def finish(raw: Any) -> Any:
                rows = np.asarray(raw).reshape(self._size, -1)
                if copy_into is not None:
                    s.write_back(copy_into[0], rows.reshape(-1))
                else:
                    for r, part in enumerate(parts):
                        s.write_back(part, rows[r])
                return parts
            return staged_op("allgather", s, nm, self._pset,
                             lambda n: rc.allgather_async(s.array.reshape(1, -1), name=n, process_set=self._pset),
                             finish, consumer)
        return self._arena_work(what, lambda: device_arena_ops.allgather(
            arena, t, parts, copy_into=copy_into, core_name=name, name=name, consumer=consumer, fallback=pinned),
            result)

    def _allgather_rows(self, staged: list[Any], name: str, out: np.ndarray | None = None) -> list[Any]:
        """Start the allgather of each staged tensor as one row per rank: one op, or one grouped op.
        ``out``: where one tensor's rows may be gathered (an output tensor's own memory), or None."""
        rows = [s.array.reshape(1, -1) for s in staged]
        if len(rows) == 1:
            return [rc.allgather_async(rows[0], name=name, process_set=self._pset, out=out)]
        return [rc.grouped_allgather_async(rows, name=name, process_set=self._pset)]

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RingcommWork:
        return self._allgather_tensors([output], [input], "allgather_into_tensor")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> RingcommWork:
        return self._allgather_tensors(outputs, inputs, "allgather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def _allgather_tensors(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], what: str) -> RingcommWork:
        name = self._name("agt")
        with self._refusing(what, _allgather_kind(len(inputs)), name, parts=len(inputs)):
            for o, i in zip(outputs, inputs):
                if o.numel() != i.numel() * self._size:
                    raise InvalidInputError(f"{what}: the output has {o.numel()} elements, the input {i.numel()}; "
                                            f"the output must hold group size ({self._size}) x the input's elements")
            check_tensors(inputs, what)
        arena = one_host_arena_for(inputs[0], self._pset) if len(inputs) == 1 else None
        if arena is not None:  # a CUDA tensor (FSDP's parameters), every rank on one host: copied on the GPUs
            # gathered into the output, or, where it is not contiguous, beside it and copied in after
            output = outputs[0]
            gathered = output if output.is_contiguous() else torch.empty(output.shape, dtype=output.dtype,
                                                                          device=output.device)
            rows = list(gathered.view(self._size, -1).unbind(0))
            return self._device_allgather(arena, inputs[0], rows, None if gathered is output else (output, gathered),
                                          what, name, lambda: outputs)
        staged = [stage(t, reduce=False, what=what) for t in inputs]
        # one tensor into a CPU output of its dtype: gathered straight into the output's memory
        mem = host_memory(outputs[0], staged[0].wire) if len(staged) == 1 else None
        into = None if mem is None else mem.reshape(self._size, -1)

        def submit() -> list[Any]:
            return self._allgather_rows(staged, name, into)

        def finish(results: list[Any]) -> list[torch.Tensor]:
            res = [results[0]] if len(staged) == 1 else results[0]
            for s, o, r in zip(staged, outputs, res):
                if r is not into:
                    s.write_back(o, r.reshape(-1))
            return outputs
        return self._start(what, submit, finish, staged)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> RingcommWork:
        what = "all_to_all_single"
        name = self._name("a2a")
        with self._refusing(what, "alltoall", name):
            received = single_receipts(self._size, output.shape, input.shape, output_split_sizes)
            if isinstance(received, str):
                raise InvalidInputError(f"{what}: {received}")
            check_tensors([input], what)
        splits = list(input_split_sizes) if len(input_split_sizes) else None
        s = stage(input, reduce=False, what=what)
        # a CPU output of the wire dtype: the rows arrive straight in its memory
        mem = host_memory(output, s.wire)
        if mem is not None and (not mem.size or np.may_share_memory(mem, s.array)):
            mem = None
        into = None if mem is None else mem.reshape(-1, *s.array.shape[1:])

        def finish(results: list[Any]) -> list[torch.Tensor]:
            rows = results[0][0]
            if rows is not into:
                s.write_back(output, rows)
            return [output]
        # the core checks, on every rank, that each rank sends the rows the others expect from it
        return self._start(what, lambda: [rc.alltoall_async(s.array, splits, name=name, process_set=self._pset,
                                                            out=into, received_splits=received)], finish, [s])

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> RingcommWork:
        what = "alltoall"
        name = self._name("x")
        with self._refusing(what, "alltoall", name):
            if len(inputs) != self._size or len(outputs) != self._size:
                raise InvalidInputError(f"{what}: {len(inputs)} inputs and {len(outputs)} outputs for a group of "
                                        f"{self._size}; pass one of each per rank")
            check_tensors(inputs, what)
        return self._exchange(what, name, list(inputs), list(outputs), [o.numel() for o in outputs], inputs[0])

    def _exchange(self, what: str, name: str, sends: list[torch.Tensor | None], outputs: list[torch.Tensor | None],
                  received: list[int], like: torch.Tensor) -> RingcommWork:
        """The alltoall ``name`` of tensors taken flat: ``sends[j]`` goes to rank j, ``outputs[i]``
        takes what rank i sends (None: nothing), each sent from its own memory and, when every output
        is a contiguous CPU tensor of the wire dtype, received straight into it.  ``received``: the
        elements this rank takes from each rank; the op fails on every rank unless each sends them.
        ``like``: a tensor of the op's dtype (every tensor checked by the caller)."""
        empty = stage(torch.empty(0, dtype=like.dtype), reduce=False, what=what)
        staged = [empty if t is None else stage(t, reduce=False, what=what) for t in sends]  # sent flat: _flat
        nothing = empty.array
        mems = [nothing if o is None else host_memory(o, empty.wire) for o in outputs]
        direct = all(m is not None for m in mems) and not any(
            np.may_share_memory(m, s.array) for m in mems for s in staged if m is not None and m.size and s.array.size)

        def finish(results: list[Any]) -> list[torch.Tensor | None]:
            if direct:
                return outputs
            rows = results[0][0]
            writer = next((s for s in staged if s.service is not None), empty)  # a device tensor's: its stream
            at = 0
            for o, n in zip(outputs, received):
                if o is not None:
                    writer.write_back(o, rows[at:at + n])
                at += n
            return outputs

        def submit() -> list[Any]:
            return [rc.alltoall_async([_flat(s) for s in staged], name=name, process_set=self._pset,
                                      out=mems if direct else None, received_splits=received)]
        return self._start(what, submit, finish, staged)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> RingcommWork:  # type: ignore[override]
        name = self._name("x")
        root, t = opts.rootRank, inputs[0]
        outs = output_lists[0] if self._rank == root else []
        with self._refusing("gather", "alltoall", name):
            check_root(root, self._size, "gather")
            if self._rank == root and len(outs) != self._size:
                raise InvalidInputError(f"gather: {len(outs)} output tensors at the root for a group of "
                                        f"{self._size}; pass one per rank")
            check_tensors([t], "gather")
        counts = gather_counts(self._rank, root, self._size, t.numel(), [o.numel() for o in outs])
        sends: list[torch.Tensor | None] = [t if n else None for n in counts.splits]
        return self._exchange("gather", name, sends, list(outs) if outs else [None] * self._size, counts.received, t)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> RingcommWork:  # type: ignore[override]
        name = self._name("x")
        root, out = opts.rootRank, outputs[0]
        parts = input_lists[0] if self._rank == root else []
        with self._refusing("scatter", "alltoall", name):
            check_root(root, self._size, "scatter")
            if self._rank == root and len(parts) != self._size:
                raise InvalidInputError(f"scatter: {len(parts)} input tensors at the root for a group of "
                                        f"{self._size}; pass one per rank")
            check_tensors([out, *parts], "scatter")
        counts = scatter_counts(self._rank, root, self._size, out.numel(),
                                [p.numel() for p in parts] if self._rank == root else None)
        if counts.keeps_own:  # the root's own part: copied into its output here, not sent
            with torch.no_grad():
                out.copy_(parts[root].reshape(out.shape))
        sends: list[torch.Tensor | None] = [p if counts.splits[j] else None for j, p in enumerate(parts)] \
            if parts else [None] * self._size
        takes: list[torch.Tensor | None] = [out if j == root and counts.received[j] else None
                                            for j in range(self._size)]
        return self._exchange("scatter", name, sends, takes, counts.received, out)

    def barrier(self, opts: Any = None) -> RingcommWork:
        token = np.zeros(1, dtype=np.int32)
        name = self._name("barrier")
        return self._start("barrier", lambda: [rc.allreduce_async(token, op=rc.Sum, name=name, out=token,
                                                                  process_set=self._pset)], lambda _: None)

    # -- point to point -----------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> RingcommWork:
        raise as_backend_error(f"send on rank {self._rank}", InvalidInputError(
            "send/isend is not supported by the ringcomm backend (it runs collectives only); use a gloo group "
            "for point-to-point traffic: dist.new_group(backend='gloo')"))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> RingcommWork:
        raise as_backend_error(f"recv on rank {self._rank}", InvalidInputError(
            "recv/irecv is not supported by the ringcomm backend (it runs collectives only); use a gloo group "
            "for point-to-point traffic: dist.new_group(backend='gloo')"))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> RingcommWork:
        return self.recv(tensors, -1, tag)

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier through torch's store that names the ranks missing after ``timeout`` (rank 0 checks)."""
        from .monitor import monitored_barrier

        secs = (timeout or self._timeout or datetime.timedelta(minutes=30)).total_seconds()
        monitored_barrier(self._store, self._tag, next(self._mb), self._rank, self._size, secs, wait_all_ranks)


#: The methods torch calls on a process group that run ringcomm's code.
ENTRY_POINTS = ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_single",
                "_reduce_scatter_base", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
                "broadcast", "allgather", "allgather_coalesced", "all_gather_single", "_allgather_base",
                "all_gather_single_coalesced", "allgather_into_tensor_coalesced", "all_to_all_single",
                "alltoall_base", "alltoall", "gather", "scatter", "barrier", "send", "recv", "recv_anysource",
                "monitored_barrier", "shutdown", "abort")
sync_calls_wait(RingcommProcessGroup, ENTRY_POINTS)
untraced_methods(RingcommProcessGroup, ENTRY_POINTS)
