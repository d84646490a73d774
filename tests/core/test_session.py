"""A whole job in memory: N sessions and rank 0's service wired by lists, no sockets, no threads.

Hypothesis picks the ops (names, sizes, a process set, a repeat that hits the
response caches, join and shutdown at the end) and the interleaving: which rank
submits next, which rank's frames rank 0 reads next, when rank 0 answers (also
from inside a transfer of its own, where it answers only the sets without
itself) and when each rank reads its answers.  After every answer, an op left
ready must not make the loop wait for a timer.  Whatever the interleaving, every member of a
set must execute the same responses in the same order with the same sequence
numbers, and every allreduce (small ones finished at rank 0, fused ones, ring
ones computed here from every rank's contribution) must give the sum.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.core import wire
from ringcomm.handles import Entry, Handle
from ringcomm.core.ops import ReduceOp
from ringcomm.core.service import Service
from ringcomm.core.session import Session
from ringcomm.core.wire import Request

pytestmark = pytest.mark.pure

SECRET = b"c" * 32
SMALL = 64  # allreduces up to 16 float32 go with their requests
SUM = int(ReduceOp.SUM)


class Cluster:
    """The job: ``size`` sessions, rank 0's service, and the frames in flight between them."""

    def __init__(self, size: int, set_ranks: tuple[int, ...]) -> None:
        self.size = size
        self.service = Service(size, SECRET, fusion_threshold=256, small_bytes=SMALL, cache_capacity=8)
        self.sessions = [Session(r, size, SECRET, 8, SMALL, SMALL // size, phases=4, records=r != 0)
                         for r in range(size)]
        self.to_root: dict[int, collections.deque[bytes]] = {r: collections.deque() for r in range(1, size)}
        self.inbox: dict[int, collections.deque[Any]] = {r: collections.deque() for r in range(size)}
        self.executed: dict[int, list[tuple]] = {r: [] for r in range(size)}  # (set, kind, names, seq)
        self.results: dict[tuple[int, str], list[Any]] = collections.defaultdict(list)  # per rank and name
        self.contrib: dict[tuple[int, str], dict[int, list[np.ndarray]]] = collections.defaultdict(dict)
        self.runs: dict[tuple[int, int, str], int] = collections.Counter()
        self.set_ranks = set_ranks
        self.announced: list[bytes] = []  # every frame the other ranks sent

    def submit(self, rank: int, req: Request, arrays: list[np.ndarray]) -> None:
        entry = Entry(req, arrays, Handle(req.name))
        if arrays:
            self.contrib[(req.pset, req.name)].setdefault(rank, []).append(arrays[0])
        if rank == 0:
            self.sessions[0].track(entry)
            self.service.submit_local(req, arrays, 0.0)
        else:
            frames = self.sessions[rank].announce([entry])
            self.announced += frames
            self.to_root[rank].extend(frames)

    def serve(self, rank: int, nested: bool = False) -> None:
        """Rank 0 reads what ``rank`` sent, then answers whatever is ready (``nested``: as it does
        while it waits inside a transfer of its own, only the sets without rank 0)."""
        while self.to_root.get(rank):
            self.service.receive(self.to_root[rank].popleft(), 0.0)
        out = self.service.take(0.0, nested)
        # the engine loop sleeps for next_wake() after every turn: an op left ready must not wait
        assert not self.service.has_ready() or self.service.next_wake(0.0) == 0, "a ready op waits for a timer"
        if out is None:
            return
        for r, frames in out.frames.items():
            self.inbox[r].extend(("frame", f) for f in frames)
        self.inbox[0].extend(("resp", resp) for resp in out.local)

    def step(self, rank: int) -> None:
        """``rank`` executes the next answer it has."""
        kind, item = self.inbox[rank].popleft()
        session = self.sessions[rank]
        for resp in [item] if kind == "resp" else session.receive(item):
            step = session.begin(resp)
            self.executed[rank].append((resp.pset, resp.kind, resp.names, step.seq, bool(step.error)))
            assert step.error is None, step.error
            if resp.kind == wire.ALLREDUCE:
                self._allreduce(rank, resp, step.entries)
            else:
                result = session.complete(resp)
                for e in step.entries:
                    self.results[(rank, e.req.name)].append(result)

    def _allreduce(self, rank: int, resp: wire.Response, entries: list[Entry]) -> None:
        if resp.data:  # finished at rank 0
            flat = np.frombuffer(resp.data, dtype=np.float32)
            offsets = np.cumsum((0, *resp.numels))
            got = {n: flat[offsets[i]:offsets[i + 1]] for i, n in enumerate(resp.names)}
        else:  # the ring's result: every member's contribution to this run of the op
            members = self.sessions[rank].set_ranks(resp.pset) or ()
            got = {}
            for n in resp.names:
                run = self.runs[(rank, resp.pset, n)]
                got[n] = sum(self.contrib[(resp.pset, n)][m][run] for m in members)
        for n in resp.names:
            self.runs[(rank, resp.pset, n)] += 1
        for e in entries:
            self.results[(rank, e.req.name)].append(np.asarray(got[e.req.name]).copy())


def _script(sizes: list[int]) -> list[tuple[str, int, int]]:
    """The ops of every rank: (name, elements, set), twice (the second time from the caches)."""
    ops = [(f"g{i}", n, 0) for i, n in enumerate(sizes)] + [(f"s{i}", n, 1) for i, n in enumerate(sizes[:3])]
    return ops + ops


@settings(max_examples=60, deadline=None)
@given(size=st.integers(2, 4), sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), data=st.data())
def test_any_interleaving_gives_every_rank_the_same_order_and_the_sum(size: int, sizes: list[int], data) -> None:
    set_ranks = tuple(sorted(data.draw(st.sets(st.integers(0, size - 1), min_size=1, max_size=size - 1),
                                         label="set 1")))
    cluster = Cluster(size, set_ranks)
    script = _script(sizes)
    # each rank runs each round of ops in its own order (names make them meet), after the set is added
    rounds = (script[:len(script) // 2], script[len(script) // 2:])
    todo: dict[int, collections.deque[Any]] = {}
    for r in range(size):
        mine = [op for ops in rounds for op in data.draw(st.permutations(ops), label=f"order of rank {r}")
                if op[2] == 0 or r in set_ranks]
        todo[r] = collections.deque([("add",), *mine, ("join",), ("shutdown",)])
    value = {r: float(r + 1) for r in range(size)}

    def can_submit(r: int) -> bool:
        if not todo[r]:
            return False
        op = todo[r][0]
        session = cluster.sessions[r]
        if op[0] == "add":
            return True
        if op[0] in ("join", "shutdown"):  # after this rank's ops are done
            return not session.pending()
        name, _, pset = op
        return session.set_ranks(pset) is not None and not session.in_flight((pset, name))

    def submit(r: int) -> None:
        op = todo[r].popleft()
        if op[0] == "add":
            cluster.submit(r, Request("add", wire.ADD_PSET, set_ranks=set_ranks), [])
        elif op[0] == "join":
            cluster.submit(r, Request("join", wire.JOIN), [])
        elif op[0] == "shutdown":
            cluster.submit(r, Request("shutdown", wire.SHUTDOWN), [])
        else:
            name, n, pset = op
            arr = np.full(n, value[r], dtype=np.float32) + np.arange(n, dtype=np.float32)
            cluster.submit(r, Request(name, wire.ALLREDUCE, "float32", ((n,),), SUM, pset=pset), [arr])

    actions = st.sampled_from(["submit", "serve", "nested", "step"])
    for _ in range(data.draw(st.integers(0, 200), label="steps")):
        what, r = data.draw(actions), data.draw(st.integers(0, size - 1))
        if what == "submit" and can_submit(r):
            submit(r)
        elif what == "serve":
            cluster.serve(r)
        elif what == "nested":  # rank 0 serves the control socket from inside a transfer
            cluster.serve(r, nested=True)
        elif what == "step" and cluster.inbox[r]:
            cluster.step(r)
    # then run to the end in a fixed order
    for _ in range(10_000):
        moved = False
        for r in range(size):
            while can_submit(r):
                submit(r)
                moved = True
            cluster.serve(r)
            while cluster.inbox[r]:
                cluster.step(r)
                moved = True
        if not moved and not any(todo.values()):
            break
    assert not any(todo.values()), f"ops never submitted: {todo}"
    assert all(not s.pending() for s in cluster.sessions), "ops never completed"

    # every member of a set executes that set's responses in one order, with one numbering
    for pset, members in ((0, tuple(range(size))), (1, set_ranks)):
        seen = [[x for x in cluster.executed[r] if x[0] == pset] for r in members]
        assert all(s == seen[0] for s in seen), f"set {pset}: ranks disagree on the order"
    # and two ranks order their common ops alike, across sets
    for a in range(size):
        for b in range(a + 1, size):
            both = {0} | ({1} if a in set_ranks and b in set_ranks else set())
            assert ([x for x in cluster.executed[a] if x[0] in both]
                    == [x for x in cluster.executed[b] if x[0] in both])
    # every allreduce is the sum of its members' contributions; the set ids and join agree
    for r in range(size):
        assert cluster.results[(r, "add")] == [1]
        for name, n, pset in script:
            if pset == 1 and r not in set_ranks:
                continue
            members = set_ranks if pset else range(size)
            want = sum(value[m] for m in members) + len(members) * np.arange(n, dtype=np.float32)
            got = cluster.results[(r, name)]
            assert len(got) == 2  # the op ran twice
            for g in got:
                np.testing.assert_array_equal(g, want)
        assert cluster.executed[r][-1][1] == wire.SHUTDOWN
    # every rank learns the same last rank to join
    joins = {r: cluster.results[(r, "join")] for r in range(size)}
    assert len({tuple(j) for j in joins.values()}) == 1 and joins[0][0] in range(size), joins
    # the second run of each global op went to rank 0 as a response-cache id
    ids = [it for frame in cluster.announced for it, _, _ in wire.parse_request_batch(
        wire.unpack_control(SECRET, frame), size)[1] if not isinstance(it, Request)]
    assert len(ids) >= len(sizes), "the repeated ops never hit the response cache"


def test_a_small_allreduce_is_answered_with_its_result_and_a_large_one_without() -> None:
    cluster = Cluster(2, (0, 1))
    for r in (0, 1):
        cluster.submit(r, Request("small", wire.ALLREDUCE, "float32", ((4,),), SUM), [np.ones(4, np.float32)])
        cluster.submit(r, Request("large", wire.ALLREDUCE, "float32", ((64,),), SUM), [np.ones(64, np.float32)])
    cluster.serve(1)
    resps = [resp for kind, item in cluster.inbox[1] for resp in cluster.sessions[1].receive(item)]
    by_name = {resp.names: resp for resp in resps}
    assert np.frombuffer(by_name[("small",)].data, np.float32).tolist() == [2.0] * 4
    assert by_name[("large",)].data == b""
