"""Which path an op takes (``core/routing.py``), in memory: the rule's properties, and that every caller
decides as the conditions it used to hold itself (kept below as reference functions) did."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.collectives import algorithms, executor, hierarchical, shm_allreduce
from ringcomm.core import lane, routing, wire
from ringcomm.core.coordinator import Coordinator
from ringcomm.core.fusion import FusionItem, plan_fusion
from ringcomm.core.ops import ReduceOp
from ringcomm.core.routing import Path, PathFacts, RouteLimits, Where
from ringcomm.core.session import Session
from ringcomm.handles import Entry, Handle
from ringcomm.job.config import Settings

pytestmark = pytest.mark.pure

CONTROL = wire.CONTROL_DATA_BYTES
KINDS = [wire.ALLREDUCE, wire.ALLGATHER, wire.BROADCAST, wire.ALLTOALL, wire.REDUCESCATTER, wire.BARRIER,
         wire.JOIN, wire.SHUTDOWN, wire.ADD_PSET, wire.REMOVE_PSET]
OPS = [int(op) for op in ReduceOp]
ADASUM = int(ReduceOp.ADASUM)

# sizes that straddle every bound: small numbers, powers of two and their neighbours, the control frame
sizes = st.one_of(st.integers(0, 4096), st.integers(0, 40).map(lambda e: 1 << e),
                  st.integers(1, 40).map(lambda e: (1 << e) - 1), st.integers(1, 40).map(lambda e: (1 << e) + 1),
                  st.sampled_from([CONTROL - 1, CONTROL, CONTROL + 1]))
bounds = st.one_of(st.integers(-1, 4096), sizes)
facts_st = st.builds(PathFacts, st.sampled_from(list(Where)), st.integers(0, 3), st.sampled_from(OPS), st.booleans(),
                     st.booleans(), st.booleans(), st.booleans(), st.booleans())
limits_st = st.builds(RouteLimits, st.one_of(st.just(0), sizes), sizes, sizes, st.sampled_from([CONTROL, 4096]),
                      sizes, st.sampled_from([-1, 0, 1]), st.sampled_from([routing.HIERARCHICAL_MIN_BYTES, 1024]),
                      sizes)
job_sizes = st.one_of(st.integers(1, 9), st.sampled_from([16, 64, 1000, 4096, 100_000]))


def settings_st() -> st.SearchStrategy[Settings]:
    return st.builds(lambda small, doubling, shm_min, hier: Settings(
        small_allreduce_bytes=small, doubling_allreduce_bytes=doubling, shm_allreduce_min_bytes=shm_min,
        hierarchical_allreduce=hier), st.one_of(st.just(-1), sizes), st.one_of(st.just(-1), sizes), sizes,
        st.sampled_from([-1, 0, 1]))


# -- the conditions as the callers held them (the reference) -------------------------------------

def old_fast_nbytes(req: wire.Request, arrays: list[np.ndarray], rank: int, max_bytes: int) -> int:
    """``core/lane.fast_nbytes`` as it was, with reducescatters and alltoalls on the lane (each rank
    posts its whole array, an alltoall's splits first, and takes its rows of every rank's)."""
    kind = req.kind
    if req.pset != 0 or kind not in {wire.ALLREDUCE, wire.BROADCAST, wire.ALLGATHER, wire.ALLTOALL,
                                     wire.REDUCESCATTER, wire.BARRIER} \
            or req.refused or max_bytes <= 0:
        return -1
    if kind == wire.ALLREDUCE and req.op == ReduceOp.ADASUM:
        return -1
    if kind == wire.BROADCAST and sum(int(a.nbytes) for a in arrays) > max_bytes:
        return -1
    if kind == wire.ALLGATHER and any(0 in s[1:] for s in req.shapes):
        return -1
    if kind == wire.BARRIER or (kind == wire.BROADCAST and rank != req.root):
        nbytes = 0
    else:
        nbytes = int(arrays[0].nbytes) if len(arrays) == 1 else sum(int(a.nbytes) for a in arrays)
    if kind == wire.ALLTOALL:  # its head goes first: its splits and the rows it expects, 16 bytes per rank
        nbytes += 16 * len(req.splits or ())
    return nbytes if nbytes <= max_bytes else -1


def old_engine_small(s: Settings, size: int) -> tuple[int, int]:
    """``Engine.__init__``'s ``_small`` and ``_small_gather``."""
    small = min(s.small_allreduce_bytes_for(size), CONTROL) if size > 1 else 0
    return small, small // max(1, size)


def old_carries(kind: str, nbytes: int, small: int, small_gather: int) -> bool:
    """``Session.announce``: whether an op's data rides with its request."""
    return 0 < nbytes and (kind == wire.ALLREDUCE and nbytes <= small or kind == wire.ALLGATHER and nbytes <= small_gather)


def old_fusion_flag(nbytes: int, small: int) -> bool:
    """The coordinator's fusion key: whether an allreduce is one of rank 0's."""
    return nbytes <= small


def old_rank0_finishes(kind: str, total: int) -> bool:
    """``Service._reduce``/``_gather``: rank 0 finishes no more than one control frame carries."""
    return not total > CONTROL


def old_choose(setting: int, nbytes: int, has_plan: bool, op: int) -> bool:
    """``hierarchical.choose`` as it was."""
    if not has_plan or setting == 0 or op == ReduceOp.ADASUM:
        return False
    return setting == 1 or nbytes >= 1 << 20


def old_allreduce_path(nbytes: int, pset: int, op: int, carried: bool, shm: bool, shm_works: bool, has_plan: bool,
                       s: Settings, size: int) -> Path:
    """``Executor._allreduce``'s choice as it was (``shm_works``: the region answered on every rank)."""
    if carried:
        return Path.RANK0
    if shm and pset == 0 and nbytes >= s.shm_allreduce_min_bytes and shm_works:
        return Path.SHM
    if old_choose(s.hierarchical_allreduce, nbytes, has_plan, op) and has_plan:
        return Path.HIERARCHICAL
    if nbytes <= s.doubling_allreduce_bytes_for(size):
        return Path.DOUBLING
    return Path.RING


def old_lane_bytes(region_bytes: int | None, net: bool, setting: int) -> int:
    """``Runtime.__init__``'s lane bound."""
    if net:
        assert region_bytes is not None
        return region_bytes
    return 0 if region_bytes is None else min(setting, region_bytes)


# -- properties of the rule ------------------------------------------------------------------------

@given(st.sampled_from(KINDS), sizes, facts_st, limits_st)
def test_each_path_holds_only_where_its_preconditions_do(kind, nbytes, facts, lim):
    path = routing.route(kind, nbytes, facts, lim)
    if path is Path.LANE:
        assert facts.where is Where.LANE and facts.pset == 0 and kind in routing.LANE_KINDS and not facts.refused
        assert lim.lane_bytes > 0 and (kind == wire.BARRIER or nbytes <= lim.lane_bytes)
        assert not (kind == wire.ALLREDUCE and facts.op == ADASUM) and not (kind == wire.ALLGATHER and facts.empty_rows)
    elif path is Path.CONTROL:
        assert kind not in routing.DATA_KINDS
    elif path is Path.RANK0:
        assert kind in (wire.ALLREDUCE, wire.ALLGATHER)
        if facts.where is Where.EXECUTE:
            assert facts.carried
        elif facts.where is Where.RANK0:
            assert nbytes <= lim.control_bytes  # one control frame's worth
        else:
            assert nbytes <= (lim.small_bytes if kind == wire.ALLREDUCE else lim.small_gather_bytes)
    elif path is Path.PEERS:
        assert kind in routing.DATA_KINDS and kind != wire.ALLREDUCE
    else:
        assert kind == wire.ALLREDUCE
        assert path is not Path.SHM or (facts.shm and facts.pset == 0 and nbytes >= lim.shm_min_bytes)
        assert path is not Path.HIERARCHICAL or (facts.host_plan and facts.op != ADASUM and lim.hierarchical != 0)
        assert path is not Path.DOUBLING or nbytes <= lim.doubling_bytes
        assert path is not Path.RING or nbytes > lim.doubling_bytes
    assert (path is Path.CONTROL) == (kind not in routing.DATA_KINDS and path is not Path.LANE)


@given(st.sampled_from(KINDS), sizes, sizes, facts_st, limits_st)
def test_the_lane_and_rank_0_take_smaller_ops_too_and_the_large_paths_larger_ones(kind, a, b, facts, lim):
    small, large = min(a, b), max(a, b)
    p_small, p_large = routing.route(kind, small, facts, lim), routing.route(kind, large, facts, lim)
    if p_large is Path.LANE:
        assert p_small is Path.LANE
    if p_large is Path.RANK0:
        assert p_small in (Path.RANK0, Path.LANE)
    if p_small in (Path.SHM, Path.HIERARCHICAL):
        assert p_large is p_small or (p_small is Path.HIERARCHICAL and p_large is Path.SHM)
    if p_large is Path.DOUBLING:
        assert p_small in (Path.DOUBLING, Path.RANK0, Path.LANE)
    if p_small is Path.RING:
        assert p_large in (Path.RING, Path.SHM, Path.HIERARCHICAL)


@given(st.sampled_from(KINDS), sizes, facts_st, limits_st)
def test_off_the_lane_only_allreduces_and_allgathers_route_by_size(kind, nbytes, facts, lim):
    if facts.where is Where.LANE or kind in (wire.ALLREDUCE, wire.ALLGATHER):
        return
    assert routing.route(kind, nbytes, facts, lim) is routing.route(kind, 0, facts, lim)


@given(job_sizes, settings_st(), st.sampled_from([wire.ALLREDUCE, wire.ALLGATHER]), sizes)
def test_rank_0_never_takes_more_than_one_control_frame_nor_an_allgather_more_than_its_share(size, s, kind, nbytes):
    lim = routing.limits_for(s, size)
    assert lim.small_bytes <= CONTROL and lim.small_gather_bytes * max(1, size) <= lim.small_bytes
    if routing.route(kind, nbytes, routing.ENGINE_FACTS, lim) is Path.RANK0:
        assert nbytes <= CONTROL and (kind == wire.ALLREDUCE or nbytes * size <= CONTROL)
    assert (routing.route(kind, nbytes, routing.RANK0_FACTS, lim) is Path.RANK0) == (nbytes <= CONTROL)
    if size == 1:
        assert lim.small_bytes == 0 and lim.small_gather_bytes == 0


@given(st.integers(1, 8), st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=8), st.integers(0, 1 << 21),
       st.integers(0, 10), st.booleans(), sizes, st.sampled_from([-1, 0, 1]), st.booleans())
def test_shared_memory_only_with_one_host_a_region_and_the_global_set(size, hosts, min_bytes, min_ranks, global_set,
                                                                     nbytes, hier, has_plan):
    hosts = (hosts * size)[:size]
    region = routing.shm_possible(size, hosts, min_bytes, min_ranks)
    assert region == (min_bytes > 0 and size >= max(2, min_ranks) and len(set(hosts)) == 1)
    assert region or not shm_allreduce.usable(size, hosts, min_bytes, min_ranks)  # it also needs shared memory here
    lim = routing.build_limits(size, 0, 0, min_bytes, hier)
    facts = PathFacts(Where.EXECUTE, 0 if global_set else 1, shm=region, host_plan=has_plan)
    if routing.route(wire.ALLREDUCE, nbytes, facts, lim) is Path.SHM:
        assert len(set(hosts)) == 1 and size >= 2 and global_set and nbytes >= min_bytes > 0


# -- every caller decides as it did ---------------------------------------------------------------

shapes_st = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=0, max_size=3)


@settings(max_examples=400)
@given(st.sampled_from(KINDS[:6]), shapes_st, st.sampled_from(["float32", "uint8", "float64", "int16"]),
       st.sampled_from(OPS), st.sampled_from([0, 0, 0, 1]), st.sampled_from(["", "", "", "rank 1: bad"]),
       st.integers(0, 2), st.integers(0, 2), bounds)
def test_the_lane_asks_for_the_fast_path_as_it_did(kind, shapes, dtype, op, pset, refused, root, rank, max_bytes):
    if kind in (wire.BROADCAST, wire.ALLGATHER):
        shapes = shapes[:1] or [(1, 1)]
    arrays = [np.zeros(s, dtype=dtype) for s in shapes]
    req = wire.Request("x", kind, dtype, tuple(a.shape for a in arrays), op, root, pset=pset, refused=refused)
    got = lane.fast_nbytes(req, arrays, rank, max_bytes)
    assert got == old_fast_nbytes(req, arrays, rank, max_bytes)
    assert lane.eligible(req, arrays, rank, max_bytes) == (got >= 0)


@given(job_sizes, settings_st())
def test_the_engine_limits_are_the_bounds_it_computed(size, s):
    lim = routing.limits_for(s, size)
    assert (lim.small_bytes, lim.small_gather_bytes) == old_engine_small(s, size)
    assert lim.doubling_bytes == s.doubling_allreduce_bytes_for(size)
    assert (lim.shm_min_bytes, lim.hierarchical, lim.control_bytes) == (s.shm_allreduce_min_bytes,
                                                                        s.hierarchical_allreduce, CONTROL)


@given(job_sizes, settings_st(), st.sampled_from(KINDS), sizes)
def test_an_announced_op_carries_its_data_and_fuses_as_it_did(size, s, kind, nbytes):
    lim = routing.limits_for(s, size)
    rank0 = routing.route(kind, nbytes, routing.ENGINE_FACTS, lim) is Path.RANK0
    assert (0 < nbytes and rank0) == old_carries(kind, nbytes, lim.small_bytes, lim.small_gather_bytes)
    if kind == wire.ALLREDUCE:
        assert rank0 == old_fusion_flag(nbytes, lim.small_bytes)
    assert (routing.route(kind, nbytes, routing.RANK0_FACTS, lim) is Path.RANK0) == (
        kind in (wire.ALLREDUCE, wire.ALLGATHER) and old_rank0_finishes(kind, nbytes))


@given(job_sizes, settings_st(), st.sampled_from(KINDS), st.data())
def test_at_each_bound_the_callers_decide_as_they_did(size, s, kind, data):
    lim = routing.limits_for(s, size)
    nbytes = data.draw(near(lim.small_bytes, lim.small_gather_bytes, CONTROL))
    rank0 = routing.route(kind, nbytes, routing.ENGINE_FACTS, lim) is Path.RANK0
    assert (0 < nbytes and rank0) == old_carries(kind, nbytes, lim.small_bytes, lim.small_gather_bytes)
    assert kind != wire.ALLREDUCE or rank0 == old_fusion_flag(nbytes, lim.small_bytes)
    assert (routing.route(kind, nbytes, routing.RANK0_FACTS, lim) is Path.RANK0) == (
        kind in (wire.ALLREDUCE, wire.ALLGATHER) and old_rank0_finishes(kind, nbytes))
    op, pset, shm, plan = data.draw(st.sampled_from(OPS)), data.draw(st.integers(0, 1)), data.draw(st.booleans()), \
        data.draw(st.booleans())
    facts = PathFacts(Where.EXECUTE, pset, op, shm=shm and lim.shm_min_bytes > 0, host_plan=plan)
    for n in edges(lim.doubling_bytes, lim.shm_min_bytes, lim.hierarchical_min_bytes):
        assert routing.route(wire.ALLREDUCE, n, facts, lim) is old_allreduce_path(
            n, pset, op, False, facts.shm, True, plan, s, size)


class _Op:
    def __init__(self, req: wire.Request, arrays: list[np.ndarray]) -> None:
        self.req, self.arrays = req, arrays
        self.waited = 0.0

    @property
    def key(self) -> tuple[int, str]:
        return (self.req.pset, self.req.name)


@given(st.integers(2, 6), st.integers(0, 64), st.lists(st.tuples(st.sampled_from([wire.ALLREDUCE, wire.ALLGATHER,
       wire.BROADCAST]), st.integers(0, 24), st.integers(0, 1)), min_size=1, max_size=6))
def test_the_session_sends_data_with_exactly_the_requests_it_did(size, small, ops_):
    secret = b"k" * 32
    session: Session[_Op] = Session(1, size, secret, 0, small, small // size)
    entries = [_Op(wire.Request(f"t{i}", kind, "uint8", ((n,),), pset=pset), [np.arange(n, dtype=np.uint8)])
               for i, (kind, n, pset) in enumerate(ops_)]
    frames = session.announce(entries)
    sent = {}
    for frame in frames:
        _, items = wire.parse_request_batch(wire.unpack_control(secret, frame), size)
        sent.update({req.name: data for req, data, _ in items})
    for e in entries:
        expected = old_carries(e.req.kind, e.arrays[0].nbytes, small, small // size)
        assert (sent[e.req.name] is not None) == expected
        assert not expected or sent[e.req.name] == e.arrays[0].tobytes()


@given(st.integers(0, 48), st.integers(1, 200), st.lists(st.tuples(st.integers(0, 12), st.sampled_from(["uint8",
       "float32"])), min_size=1, max_size=8))
def test_the_coordinator_fuses_rank_0s_allreduces_only_with_each_other_as_it_did(small, threshold, ops_):
    coord = Coordinator(1, threshold, small_bytes=small)
    reqs = [wire.Request(f"t{i}", wire.ALLREDUCE, dtype, ((n,),), int(ReduceOp.SUM)) for i, (n, dtype) in enumerate(ops_)]
    for req in reqs:
        coord.submit(0, req)
    got = [resp.names for resp in coord.take_responses()]
    items = [FusionItem((q.dtype, q.op, q.prescale, q.postscale, old_fusion_flag(q.numel() * np.dtype(q.dtype).itemsize,
                                                                                   small)),
                        q.numel() * np.dtype(q.dtype).itemsize) for q in reqs]
    assert got == [tuple(reqs[i].name for i in group) for group in plan_fusion(items, threshold)]


@given(st.integers(0, 3), st.sampled_from([-1, 0, 1]), st.booleans(), st.sampled_from(OPS))
def test_hierarchical_choose_is_the_rule_it_was(exp, setting, has_plan, op):
    plan = hierarchical.HostPlan((0, 1), (0, 2)) if has_plan else None
    for nbytes in (0, 1, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 1 << (20 + exp)):
        assert hierarchical.choose(setting, nbytes, plan, ReduceOp(op)) == old_choose(setting, nbytes, has_plan, op)
    assert hierarchical.AUTO_MIN_BYTES == routing.HIERARCHICAL_MIN_BYTES
    assert not hasattr(executor, "DATA_KINDS")  # one owner: core/routing.py


@given(st.one_of(st.none(), sizes), st.booleans(), bounds)
def test_the_lane_bound_is_the_one_the_runtime_computed(region, net, setting):
    if net and region is None:
        return  # a lane across hosts always has its bound
    assert routing.lane_bytes(region, None if net else setting) == old_lane_bytes(region, net, setting)


class _FakeShm:
    """The shared-memory allreduce: whether the region worked on every rank, and a record of its runs."""

    def __init__(self, works: bool, called: list[Path]) -> None:
        self.works, self.called = works, called

    def allreduce(self, *args: object, **kwargs: object) -> bool:
        if self.works:
            self.called.append(Path.SHM)
        return self.works


class _NoLink:
    rank, size = 0, 4


LAYOUTS = {"one host": ["a"] * 4, "two hosts": ["a", "a", "b", "b"], "uneven": ["a", "a", "a", "b"]}


def edges(*bounds: int) -> list[int]:
    """Sizes at each of ``bounds`` and one either side (where ``<`` and ``<=`` differ)."""
    return sorted({b + d for b in bounds for d in (-1, 0, 1) if b + d >= 0})


def near(*bounds: int) -> st.SearchStrategy[int]:
    return st.sampled_from(edges(*bounds))


@given(settings_st().filter(lambda s: s.shm_allreduce_min_bytes > 0), st.data(), st.sampled_from(OPS),
       st.integers(0, 1), st.booleans(), st.booleans(), st.sampled_from(sorted(LAYOUTS)), st.booleans())
def test_the_executor_runs_the_allreduce_it_ran(s, data, op, pset, shm, works, layout, carried):
    """The executor against the old choice: which algorithm it called (each one replaced by a recorder)."""
    size = 4
    lim = routing.limits_for(s, size)
    bounds = [b for b in (lim.doubling_bytes, lim.shm_min_bytes, lim.hierarchical_min_bytes) if b < 1 << 22]
    n = data.draw(near(0, 64, *bounds)) // 4 + data.draw(st.integers(0, 1))  # float32: 4 bytes each
    called: list[Path] = []
    ex = executor.Executor(0, size, s, _NoLink(), shm_ar=_FakeShm(works, called) if shm else None,  # type: ignore[arg-type]
                           hosts=LAYOUTS[layout])
    arr = np.ones(n, np.float32)
    data = (arr * size).tobytes() if carried else b""
    resp = wire.Response(wire.ALLREDUCE, ("x",), "float32", op, numels=(n,), pset=pset, data=data)
    req = wire.Request("x", wire.ALLREDUCE, "float32", ((n,),), op, pset=pset)
    with mock.patch.object(algorithms, "ring_allreduce", lambda *a, **k: called.append(Path.RING)), \
            mock.patch.object(algorithms, "doubling_allreduce", lambda *a, **k: called.append(Path.DOUBLING)), \
            mock.patch.object(hierarchical, "allreduce", lambda *a, **k: called.append(Path.HIERARCHICAL)):
        ex.execute(resp, [Entry(req, [arr], Handle("x"))], seq=0, members=tuple(range(size)))
    expected = old_allreduce_path(4 * n, pset, op, bool(data), shm, works, layout == "two hosts", s, size)
    assert called == ([] if expected is Path.RANK0 else [expected])
