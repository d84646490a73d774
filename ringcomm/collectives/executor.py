"""Execution: what every rank does with one response once rank 0 has ordered it.

An :class:`Executor` moves the data of one ordered response: it picks the link
of the op's process set, packs fused allreduces into the fusion buffer (or
reduces a single array where it lies), runs the algorithm (the shared-memory
allreduce on one host, else the ring; rank 0's result for a small allreduce),
unpacks, and measures the timeline phases.  It is built from what it needs
(this rank's links, settings and peers), runs only on the engine thread and
returns an :class:`Outcome`; it never reaches back into the engine, which
negotiates, orders, keeps the process-set registry and completes the handles.

What a rank sees, np = 2, one fused allreduce of ``a`` (3 floats) and ``b`` (2)::

    fusion buffer  [a0 a1 a2 b0 b1]   -> ring / shared memory ->   [sum of both ranks]
    results        a = buf[0:3], b = buf[3:5]   (new arrays, or the callers' out=)
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import algorithms, hierarchical, shm_allreduce
from ..core import ops, ring, routing, wire
from ..errors import HorovodInternalError
from ..core.ops import ReduceOp
from ..net.transport import DataPlane
from ..core.wire import Response

if TYPE_CHECKING:
    from ..job.config import Settings
    from ..handles import Entry

log = logging.getLogger("ringcomm.collectives.executor")

#: Kinds that move data; the others (barrier, join, shutdown, set management) complete on their response.
#: How the DEBUG log names an allreduce's path.
_PATH_TEXT = {routing.Path.RANK0: "reduced at rank 0 (small)", routing.Path.SHM: "shared memory",
              routing.Path.HIERARCHICAL: "hierarchical (host, then across hosts)",
              routing.Path.DOUBLING: "recursive doubling", routing.Path.RING: "ring"}

Phase = tuple[str, float, float]


class Outcome(NamedTuple):
    """What executing one response gave: a result per entry, and the timeline phases it measured
    (empty unless asked for; then the engine records one span of the whole op)."""

    results: list[Any]
    phases: list[Phase]


class Executor:
    """Turns an ordered response into data movement on this rank's links.

    ``link`` is the job's data plane (or a single-process stand-in; on rank 0 it
    keeps negotiating while it waits, see :meth:`DataPlane.serve_while_waiting`), ``shm_ar`` the shared-memory allreduce when every rank is on
    this host, ``hosts`` each global rank's host name, ``limits`` the sizes that pick an allreduce's
    path (:func:`routing.limits_for` of ``settings`` when not given).
    """

    def __init__(self, rank: int, size: int, settings: Settings, link: Any,
                 shm_ar: shm_allreduce.ShmAllreduce | None = None, hosts: list[str] | None = None,
                 limits: routing.RouteLimits | None = None) -> None:
        self.rank, self.size, self.settings = rank, size, settings
        self._link = link
        self._shm_ar = shm_ar
        self._limits = limits if limits is not None else routing.limits_for(settings, size)
        self._hosts = hosts if hosts is not None else [""] * size
        self._fusion = np.empty(0, dtype=np.uint8)
        self._links: dict[int, Any] = {}  # process set -> its SubLink
        self._host_plans: dict[int, hierarchical.HostPlan | None] = {}
        self._apart: dict[int, bool] = {}  # process set -> whether each member is on a host of its own
        # the phases of the op being executed, and how to measure them (set by execute())
        self._phases: list[Phase] = []
        self._timed = False
        self._reduced_at: float | None = None

    def forget_set(self, pset: int) -> None:
        """Drop what was cached for process set ``pset`` (it was removed)."""
        self._links.pop(pset, None)
        self._host_plans.pop(pset, None)
        self._apart.pop(pset, None)

    def execute(self, resp: Response, entries: list[Entry], seq: int, members: tuple[int, ...],
                timed: bool = False, reduced_at: float | None = None) -> Outcome:
        """Move the data of ``resp`` (a kind of :data:`ringcomm.core.routing.DATA_KINDS`) for this rank's ``entries``.

        ``members`` are the global ranks of the op's set; ``seq`` numbers its data-plane
        messages.  ``timed``: measure the phases; ``reduced_at``: when rank 0 began the
        reduction or gather it answered with (the start of that phase).
        """
        self._phases = []
        self._timed, self._reduced_at = timed, reduced_at
        results = self._dispatch(resp, entries, seq, members)
        phases, self._phases = self._phases, []
        return Outcome(results, phases)

    def _watch_peer(self, peer: int) -> None:
        """Raises if ``peer`` (awaited at a shared-memory barrier) or any other peer is known gone."""
        if isinstance(self._link, DataPlane):
            self._link.raise_if_lost(peer, "a shared-memory barrier")

    def _hosts_of(self, members: tuple[int, ...]) -> list[str]:
        """The host of each of ``members`` (global ranks; "" where unknown)."""
        return [self._hosts[g] if g < len(self._hosts) else "" for g in members]

    def _seg_elems(self, dtype: np.dtype, pset: int, members: tuple[int, ...]) -> int:
        """Elements per pipelined segment of an op of set ``pset``: ``stream_segment_bytes`` where each
        member is on a host of its own (every link is a stream across hosts), else ``segment_bytes``."""
        apart = self._apart.get(pset)
        if apart is None:
            apart = self._apart[pset] = ring.one_per_host(self._hosts_of(members))
        st = self.settings
        return max(1, (st.stream_segment_bytes if apart else st.segment_bytes) // dtype.itemsize)

    def _scratch(self, dtype: np.dtype, n: int) -> np.ndarray:
        need = n * dtype.itemsize
        if self._fusion.nbytes < need:
            self._fusion = np.empty(need, dtype=np.uint8)
        return self._fusion[:need].view(dtype)

    def _link_for(self, pset: int, members: tuple[int, ...]) -> Any:
        """The link of a process set: the job's own for the global set, else a view with set ranks."""
        if pset == 0:
            return self._link
        link = self._links.get(pset)
        if link is None:
            link = self._links[pset] = algorithms.SubLink(self._link, members)
        return link

    def _host_plan(self, pset: int, members: tuple[int, ...]) -> hierarchical.HostPlan | None:
        """This rank's hierarchical plan in process set ``pset`` (None: one host, or uneven hosts)."""
        if pset not in self._host_plans:
            self._host_plans[pset] = (hierarchical.plan(self._hosts_of(members), members.index(self.rank))
                                      if self.rank in members else None)
        return self._host_plans[pset]

    def _dispatch(self, resp: Response, entries: list[Entry], seq: int, members: tuple[int, ...]) -> list[Any]:
        kind = resp.kind
        link = self._link_for(resp.pset, members)
        rank, size = link.rank, link.size
        dtype = np.dtype(resp.dtype)
        seg = self._seg_elems(dtype, resp.pset, members)
        if kind == wire.ALLREDUCE:
            return self._allreduce(resp, entries, seq, dtype, seg, link, members)
        (entry,) = entries
        arr = entry.arrays[0]
        if kind == wire.BROADCAST:
            out = entry.outs[0] if entry.outs and entry.outs[0] is not None else None
            if out is None:
                out = arr.copy() if self.rank == resp.root else np.empty_like(arr)
            elif self.rank == resp.root and out is not arr:
                np.copyto(out, arr)
            root = members.index(resp.root)  # a global rank: its index in the set
            log.debug("rank %d: broadcast %s: %d B from rank %d, process set %d: %s", self.rank, resp.names,
                      out.nbytes, resp.root, resp.pset, "straight from the root" if
                      out.nbytes <= algorithms.DIRECT_BROADCAST_BYTES else "pipelined along the ring")
            algorithms.broadcast(link, out.reshape(-1), root, seq, seg)
            return [out]
        if kind == wire.ALLGATHER:
            rest = arr.shape[1:]
            row = int(np.prod(rest, dtype=np.int64))
            counts = [d * row for d in resp.first_dims]
            if resp.data:  # rank 0 gathered it from the payloads sent with the requests
                got = np.frombuffer(resp.data, dtype=dtype)
                if got.size != sum(counts):
                    raise HorovodInternalError(f"allgather {list(resp.names)}: result of {got.size} elements, "
                                               f"expected {sum(counts)}")
                log.debug("rank %d: allgather %s: %d B, process set %d: gathered at rank 0 (small)", self.rank,
                          resp.names, got.nbytes, resp.pset)
                if self._timed:
                    now = time.perf_counter()
                    self._phases = [("RANK0_GATHER", now if self._reduced_at is None else self._reduced_at, now)]
                out = ops.result_array(entry.outs[0] if entry.outs else None, (sum(resp.first_dims), *rest), dtype)
                out[...] = got.reshape(out.shape)
                return [out]
            out = ops.result_array(entry.outs[0] if entry.outs else None, (sum(resp.first_dims), *rest), dtype)
            flat = out.reshape(-1)
            start = sum(counts[:rank])
            flat[start:start + counts[rank]] = arr.reshape(-1)
            log.debug("rank %d: allgather %s: %d B, process set %d: ring", self.rank, resp.names, out.nbytes,
                      resp.pset)
            algorithms.ring_allgatherv(link, flat, counts, seq, seg)
            return [out]
        if kind == wire.ALLTOALL:
            rest = arr.shape[1:]
            row = int(np.prod(rest, dtype=np.int64))
            recv_rows = [resp.splits[i][rank] for i in range(size)]
            got = np.asarray(recv_rows, dtype=np.int64)
            if ops.per_rank(entry.arrays, size):  # one array for each rank: sent as they are
                sends = [a.reshape(-1) for a in entry.arrays]
            else:
                sends = [arr.reshape(-1)[a:b] for a, b in ring.offsets([s * row for s in resp.splits[rank]])]
            given = [o for o in entry.outs if o is not None]
            if ops.per_rank(given, size):  # one output for each rank: each receives its rows in place
                algorithms.alltoall(link, sends, [o.reshape(-1) for o in given], seq, seg)
                return [(given, got)]
            out = ops.result_array(entry.outs[0] if entry.outs else None, (sum(recv_rows), *rest), dtype)
            flat = out.reshape(-1)
            outs = [flat[a:b] for a, b in ring.offsets([r * row for r in recv_rows])]
            algorithms.alltoall(link, sends, outs, seq, seg)
            return [(out, got)]
        if kind == wire.REDUCESCATTER:
            rest = arr.shape[1:]
            row = int(np.prod(rest, dtype=np.int64))
            rows = ring.split_sizes(arr.shape[0], size)
            op = ReduceOp(resp.op)
            block = algorithms.direct_reducescatter(
                link, np.ascontiguousarray(arr).reshape(-1), [r * row for r in rows], op, seq, seg, resp.prescale,
                ops.postscale(op, size, resp.postscale))
            return [block.reshape(rows[rank], *rest)]
        raise HorovodInternalError(f"unknown collective {kind!r}")  # pragma: no cover

    def _allreduce(self, resp: Response, entries: list[Entry], seq: int, dtype: np.dtype, seg: int,
                   link: Any, members: tuple[int, ...]) -> list[Any]:
        op = ReduceOp(resp.op)
        post = ops.postscale(op, link.size, resp.postscale)
        total = sum(resp.numels)
        arrays = [a for e in entries for a in e.arrays]
        single = len(arrays) == 1 and len(entries) == 1 and total == arrays[0].size
        src: np.ndarray | None = None
        t0 = time.perf_counter()
        if resp.data:  # rank 0 already reduced it
            buf = np.frombuffer(resp.data, dtype=dtype)
            if buf.size != total:
                raise HorovodInternalError(f"allreduce {list(resp.names)}: result of {buf.size} elements, expected {total}")
            single = False
        elif single:
            entry = entries[0]
            out = entry.outs[0] if entry.outs and entry.outs[0] is not None else np.empty_like(arrays[0])
            buf = out.reshape(-1)
            if resp.prescale != 1.0:
                np.copyto(out, arrays[0])
            elif out is not arrays[0]:
                src = arrays[0].reshape(-1)  # the ring reads the input directly: no copy-in
        else:
            buf = self._scratch(dtype, total)
            by_name = {e.req.name: e for e in entries}
            pos = 0
            for name, n in zip(resp.names, resp.numels):
                e = by_name.get(name)
                if e is None:  # this rank has joined: contribute the identity
                    ops.identity_fill(op, buf[pos:pos + n])
                    pos += n
                    continue
                for a in e.arrays:
                    buf[pos:pos + a.size] = a.reshape(-1)
                    pos += a.size
        t1 = time.perf_counter()
        marks: list[float] | None = [] if self._timed else None
        shm_ar = self._shm_ar  # the whole job on one host: large allreduces of the global set
        plan = self._host_plan(resp.pset, members)  # several hosts: reduce within each host first
        facts = routing.PathFacts(routing.Where.EXECUTE, resp.pset, op, carried=bool(resp.data),
                                  shm=shm_ar is not None, host_plan=plan is not None)
        path = routing.route(wire.ALLREDUCE, buf.nbytes, facts, self._limits)
        if path is not routing.Path.RANK0:
            ops.scale_inplace(buf, resp.prescale)
            if path is routing.Path.SHM:
                assert shm_ar is not None
                if not shm_ar.allreduce(link, buf, op, seq, post, src_buf=src, marks=marks, watch=self._watch_peer):
                    # the region is unavailable on some rank: the path without it
                    path = routing.route(wire.ALLREDUCE, buf.nbytes, facts._replace(shm=False), self._limits)
            if path is routing.Path.HIERARCHICAL:
                assert plan is not None
                hierarchical.allreduce(link, plan, buf, op, seq, seg, post, src_buf=src, pieces=hierarchical.pieces_for(
                    buf.nbytes, self.settings.hierarchical_piece_bytes))
                if isinstance(self._link, DataPlane):
                    self._link.stats["hierarchical_allreduce"] += 1
            elif path is routing.Path.DOUBLING:
                algorithms.doubling_allreduce(link, buf, op, seq, seg, post, src_buf=src)
            elif path is routing.Path.RING:
                algorithms.ring_allreduce(link, buf, op, seq, seg, post, src_buf=src, marks=marks)
        t2 = time.perf_counter()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d: allreduce %s: %d B in %d op(s), process set %d: %s", self.rank, resp.names,
                      buf.nbytes, len(resp.names), resp.pset, _PATH_TEXT[path])
        if marks is not None:
            phases = [("MEMCPY_IN_FUSION_BUFFER", t0, t1)] if not single and not resp.data else []
            if resp.data:
                phases.append(("RANK0_REDUCE", t0 if self._reduced_at is None else self._reduced_at, t2))
            elif path is routing.Path.HIERARCHICAL:
                phases.append(("HIERARCHICAL_ALLREDUCE", t1, t2))
            elif path is routing.Path.DOUBLING:
                phases.append(("DOUBLING_ALLREDUCE", t1, t2))
            elif marks:
                phases += [("RING_REDUCE_SCATTER", t1, marks[0]), ("RING_ALLGATHER", marks[0], t2)]
            else:  # one rank, or nothing to move
                phases.append(("RING", t1, t2))
            self._phases = phases
        if single:
            return [out if not entries[0].grouped else [out]]
        offsets = dict(zip(resp.names, itertools.accumulate(resp.numels[:-1], initial=0)))
        results = []
        for e in entries:
            pos = offsets[e.req.name]
            outs = []
            for i, a in enumerate(e.arrays):
                given = e.outs[i] if i < len(e.outs) else None
                dst = given if given is not None else np.empty_like(a)
                dst.reshape(-1)[...] = buf[pos:pos + a.size]
                pos += a.size
                outs.append(dst)
            results.append(outs if e.grouped else outs[0])
        if self._timed:
            self._phases.append(("MEMCPY_OUT_FUSION_BUFFER", t2, time.perf_counter()))
        return results
