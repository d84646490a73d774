"""The small-op lane's decisions and arithmetic, in memory (no processes, no shared memory).

What must hold for the lane to be safe: every rank resolves an index the same
way, whatever it has seen so far (a divert seen early stays a divert once every
entry is in; fast needs every entry); the key ignores only what may differ
between ranks; and a fast result is bitwise the same on every rank and the same
as rank 0's small path.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.core import lane, ops, ring, wire
from ringcomm.core.coordinator import check_agreement
from ringcomm.core.ops import ReduceOp
from ringcomm.core.service import Service
from ringcomm.errors import MismatchError

pytestmark = pytest.mark.pure


# -- decide ------------------------------------------------------------------------------

entry = st.builds(lambda fast, key, off: (fast, key, off), st.booleans(), st.integers(0, 2), st.booleans())


def seen_all(entries):
    return [lane.Seen(True, off, fast, key, 0) for fast, key, off in entries]


@given(st.lists(entry, min_size=1, max_size=6), st.data())
def test_every_rank_resolves_an_index_alike_and_early_diverts_stand(entries, data):
    full = seen_all(entries)
    # each rank decides with its own key; when all entries are in, they must all agree
    verdicts = {lane.decide(key, full) for fast, key, off in entries if fast}
    assert len(verdicts) <= 1
    if verdicts:
        (verdict,) = verdicts
        keys = {key for _, key, _ in entries}
        assert verdict == (lane.FAST if all(f for f, _, _ in entries) and len(keys) == 1 else lane.DIVERT)
        # a rank that has seen only some entries (the rest not posted, not off) either waits or
        # diverts; a divert then must be the final verdict
        shown = data.draw(st.lists(st.booleans(), min_size=len(entries), max_size=len(entries)))
        partial = [s if show else lane.Seen(False, False, False, 0, 0) for s, show in zip(full, shown)]
        mine = next(key for fast, key, _ in entries if fast)
        early = lane.decide(mine, partial)
        assert early in (lane.WAIT, verdict) if not all(shown) else early == verdict
        if early == lane.DIVERT:
            assert verdict == lane.DIVERT


def test_a_rank_that_posts_no_more_makes_the_index_divert_but_its_posted_entries_still_count():
    mine = lane.Seen(True, False, True, 5, 8)
    assert lane.decide(5, [mine, lane.Seen(False, True, False, 0, 0)]) == lane.DIVERT
    assert lane.decide(5, [mine, lane.Seen(False, False, False, 0, 0)]) == lane.WAIT
    assert lane.decide(5, [mine, lane.Seen(True, True, True, 5, 8)]) == lane.FAST


@pytest.mark.parametrize(("count", "index", "expected"), [(5, 4, True), (4, 4, False), (0, 2**32 - 1, True),
                                                         (2**32 - 1, 2**32 - 1, False), (3, 2**32 + 1, True)])
def test_post_counters_wrap_at_32_bits(count, index, expected):
    assert lane.reached(count, index) is expected


# -- keys and eligibility ----------------------------------------------------------------


def req(**kw):
    base = dict(name="x", kind=wire.ALLREDUCE, dtype="float32", shapes=((4,),), op=int(ReduceOp.SUM))
    base.update(kw)
    return wire.Request(**base)


def test_the_key_holds_everything_ranks_must_share_and_an_allgathers_rows_may_differ():
    k = lane.op_key(req())
    assert k == lane.op_key(req()) and 0 <= k < 2**63
    for change in (dict(name="y"), dict(dtype="float64"), dict(shapes=((5,),)), dict(op=int(ReduceOp.MAX)),
                   dict(prescale=2.0), dict(postscale=0.5), dict(kind=wire.BROADCAST, root=1)):
        assert lane.op_key(req(**change)) != k, change
    g = dict(kind=wire.ALLGATHER, op=0)
    assert lane.op_key(req(shapes=((1, 3),), **g)) == lane.op_key(req(shapes=((7, 3),), **g))
    assert lane.op_key(req(shapes=((1, 3),), **g)) != lane.op_key(req(shapes=((1, 4),), **g))


def test_what_a_rank_asks_to_run_fast():
    a = [np.zeros(4, np.float32)]
    assert lane.eligible(req(), a, 0, 16) and not lane.eligible(req(), a, 0, 15)
    assert not lane.eligible(req(pset=1), a, 0, 1 << 20)
    assert not lane.eligible(req(op=int(ReduceOp.ADASUM)), a, 0, 1 << 20)
    assert not lane.eligible(req(refused="rank 1: bad"), a, 0, 1 << 20)
    # an alltoall posts its head (its splits and the rows it expects: 16 bytes per rank) and its whole array
    a2a = dict(kind=wire.ALLTOALL, splits=(2, 2))
    assert lane.eligible(req(**a2a), a, 0, 48) and not lane.eligible(req(**a2a), a, 0, 47)
    assert lane.payload_nbytes(req(**a2a), a, 0) == 48
    assert lane.payload_nbytes(req(**a2a, received_splits=(1, 3)), a, 0) == 48
    # ranks that split differently, or send other numbers of rows, still run it fast; other rows do not
    assert lane.op_key(req(kind=wire.ALLTOALL, splits=(1, 3))) == lane.op_key(req(**a2a))
    assert lane.op_key(req(kind=wire.ALLTOALL, shapes=((9,),), splits=(9, 0))) == lane.op_key(req(**a2a))
    assert lane.op_key(req(kind=wire.ALLTOALL, shapes=((4, 2),), splits=(2, 2))) != lane.op_key(req(**a2a))
    assert lane.eligible(req(kind=wire.BARRIER, shapes=()), [], 0, 1)
    # a broadcast posts the root's buffer only, but every rank checks that it fits
    b = req(kind=wire.BROADCAST, root=1)
    assert lane.payload_nbytes(b, a, 0) == 0 and lane.payload_nbytes(b, a, 1) == 16
    assert not lane.eligible(b, a, 0, 15)
    # rows of zero bytes: the payloads could not say how many rows each rank sent
    assert not lane.eligible(req(kind=wire.ALLGATHER, shapes=((2, 0),)), [np.zeros((2, 0))], 0, 1 << 20)


# -- results -----------------------------------------------------------------------------

FLOATS = ["float16", "float32", "float64"]


@given(st.integers(1, 5), st.sampled_from(FLOATS + ["int32", "uint8", "bool"]),
       st.sampled_from(list(ReduceOp)), st.integers(0, 40), st.sampled_from([1.0, 0.5, 3.0]),
       st.sampled_from([1.0, 0.25]), st.integers(0, 2**31))
def test_a_fast_allreduce_is_bitwise_rank_0s_small_reduction_on_every_rank(size, dtype, op, n, pre, post, seed):
    if op is ReduceOp.ADASUM or (dtype == "bool" and op is ReduceOp.AVERAGE):
        return
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        arrays = [rng.integers(0, 2, n).astype(bool) for _ in range(size)]
    elif dtype in FLOATS:
        arrays = [rng.standard_normal(n).astype(dtype) for _ in range(size)]
    else:
        arrays = [rng.integers(0, 50, n).astype(dtype) for _ in range(size)]
    r = req(dtype=dtype, shapes=((n,),), op=int(op), prescale=pre, postscale=post)
    parts = [a.view(np.uint8).view(lane.dtype_of(r)) for a in arrays]  # as the lane reads them: raw bytes, typed
    before = [a.tobytes() for a in arrays]
    results = [lane.finish(r, [arrays[i]], [None], False, parts, size, rank=i) for i in range(size)]
    assert [a.tobytes() for a in arrays] == before  # the posted payloads are left as they are
    for res in results:
        assert res.dtype == np.dtype(dtype) and res.shape == (n,)
        assert res.tobytes() == results[0].tobytes()
    # reduced into the caller's buffer (here in place: the buffer is the rank's input): the same bytes
    mine = arrays[0].copy()
    assert lane.finish(r, [mine], [mine], False, parts, size, rank=0) is mine
    assert mine.tobytes() == results[0].tobytes()
    # rank 0's small path through the service, fed the same payloads
    svc = Service(size, b"s" * 32, 1 << 26, 1 << 20, 0)
    reference = _service_reduce(svc, r, arrays)
    assert results[0].tobytes() == reference.tobytes()
    # and a plain left fold says the same
    if dtype in FLOATS and op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        acc = None
        for a in arrays:
            c = a.copy()
            ops.scale_inplace(c, pre)
            acc = c if acc is None else acc + c
        ops.scale_inplace(acc, ops.postscale(op, size, post))
        assert acc.tobytes() == results[0].tobytes()


@given(st.integers(1, 5), st.sampled_from(FLOATS + ["int32"]), st.sampled_from(list(ReduceOp)),
       st.integers(0, 9), st.integers(1, 4), st.sampled_from([1.0, 0.5]), st.sampled_from([1.0, 0.25]),
       st.integers(0, 2**31))
def test_a_fast_reducescatter_gives_each_rank_its_rows_of_the_fast_allreduce(size, dtype, op, first, width, pre,
                                                                             post, seed):
    """Each rank's block: its rows of the first dimension as the engine splits them (the first
    ranks take one more where they do not divide), bitwise the same rows of the lane's allreduce
    of the same payloads; the blocks in rank order are that allreduce."""
    if op is ReduceOp.ADASUM:
        return
    rng = np.random.default_rng(seed)
    arrays = [(rng.standard_normal((first, width)) * 10).astype(dtype) for _ in range(size)]
    rs = req(kind=wire.REDUCESCATTER, dtype=dtype, shapes=((first, width),), op=int(op), prescale=pre,
             postscale=post)
    parts = [a.reshape(-1) for a in arrays]
    blocks = [lane.finish(rs, [arrays[i]], [None], False, parts, size, rank=i) for i in range(size)]
    whole = lane.finish(req(dtype=dtype, shapes=((first, width),), op=int(op), prescale=pre, postscale=post),
                        [arrays[0]], [None], False, parts, size, rank=0)
    assert [b.shape for b in blocks] == [(n, width) for n in ring.split_sizes(first, size)]
    assert all(not np.shares_memory(b, p) for b in blocks for p in parts)
    assert np.concatenate(blocks).tobytes() == whole.tobytes()


@given(st.integers(1, 5), st.integers(0, 4), st.integers(0, 3), st.integers(0, 2**31),
       st.sampled_from(["int32", "float64", "uint8", "bool"]))
def test_a_fast_alltoall_gives_each_rank_its_block_of_every_ranks_array(size, most, width, seed, dtype):
    """Each rank splits its own way and posts its splits ahead of its rows (``payload``): rank r
    gets block r of each rank's array in rank order, and how many rows it got from each."""
    rng = np.random.default_rng(seed)
    splits = [tuple(int(v) for v in rng.integers(0, most + 1, size)) for _ in range(size)]
    arrays = [rng.integers(0, 2, (sum(s), width)).astype(dtype) for s in splits]
    reqs = [req(kind=wire.ALLTOALL, dtype=dtype, shapes=(a.shape,), splits=s) for a, s in zip(arrays, splits)]
    assert len({lane.op_key(r) for r in reqs}) == 1
    parts = [np.concatenate([np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in lane.payload(r, [a])])
             for r, a in zip(reqs, arrays)]
    assert [p.nbytes for p in parts] == [lane.payload_nbytes(r, [a], 0) for r, a in zip(reqs, arrays)]
    assert all(lane.posted_dtype(r) == np.uint8 for r in reqs)
    for r in range(size):
        out, got = lane.finish(reqs[r], [arrays[r]], [None], False, parts, size, rank=r)
        want = np.concatenate([a[sum(s[:r]):sum(s[:r + 1])] for a, s in zip(arrays, splits)])
        assert out.dtype == np.dtype(dtype) and out.shape == want.shape and (out == want).all()
        assert got.tolist() == [s[r] for s in splits]
        assert not any(np.shares_memory(out, p) for p in parts)
        # one output for each rank: each takes that rank's block, in place
        each = [np.empty((s[r], width), dtype) for s in splits]
        if size > 1:
            res, _ = lane.finish(reqs[r], [arrays[r]], each, False, parts, size, rank=r)
            assert all(a is b for a, b in zip(res, each)) and (np.concatenate(each) == want).all()


@given(st.integers(2, 5), st.integers(0, 2**31), st.data())
def test_a_fast_alltoall_whose_ranks_expect_other_rows_fails_on_every_rank_as_the_engine_fails_it(size, seed, data):
    """Ranks that say what they expect from each rank (``received_splits``): every rank reads
    every rank's head, so each one fails, with the engine's words (``check_agreement``), or none does."""
    rng = np.random.default_rng(seed)
    splits = [tuple(int(v) for v in rng.integers(0, 3, size)) for _ in range(size)]
    expected = []
    for r in range(size):
        sent = [s[r] for s in splits]
        how = data.draw(st.sampled_from(["none", "right", "wrong"]))
        if how == "wrong":
            sent[data.draw(st.integers(0, size - 1))] += data.draw(st.integers(1, 2))
        expected.append(None if how == "none" else tuple(sent))
    arrays = [np.arange(sum(s), dtype=np.int32) for s in splits]
    reqs = [req(kind=wire.ALLTOALL, dtype="int32", shapes=(a.shape,), splits=s, received_splits=e)
            for a, s, e in zip(arrays, splits, expected)]
    parts = [np.concatenate([np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in lane.payload(r, [a])])
             for r, a in zip(reqs, arrays)]
    engine = check_agreement("x", dict(enumerate(reqs)))
    outcomes = []
    for r in range(size):
        try:
            out, got = lane.finish(reqs[r], [arrays[r]], [None], False, parts, size, rank=r)
            assert got.tolist() == [s[r] for s in splits] and out.size == sum(got)
            outcomes.append("")
        except MismatchError as exc:
            assert str(exc).endswith(f" [raised on rank {r}]")
            outcomes.append(str(exc).removesuffix(f" [raised on rank {r}]"))
    assert outcomes == [engine] * size
    wrong = [r for r, e in enumerate(expected) if e is not None and list(e) != [s[r] for s in splits]]
    assert bool(engine) == bool(wrong)
    if wrong:
        assert f"rank {wrong[0]} expects {list(expected[wrong[0]])} rows" in engine


def _service_reduce(svc, r, arrays):
    """What the service's small path computes for these per-rank arrays (its private step, fed directly)."""
    size = len(arrays)
    resp = wire.Response(kind=wire.ALLREDUCE, names=(r.name,), dtype=r.dtype, numels=(arrays[0].size,), op=r.op,
                         prescale=r.prescale, postscale=r.postscale)
    svc._local[(0, r.name)] = [arrays[0]]  # noqa: SLF001 - rank 0's own contribution, as submit_local keeps it
    payloads = [{rank: arrays[rank].tobytes() for rank in range(1, size)}]
    done = svc._reduce(resp, tuple(range(size)), payloads)  # noqa: SLF001
    return np.frombuffer(done.data, dtype=r.dtype)


def test_fast_broadcast_allgather_barrier_and_grouped_results():
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    two_d = req(dtype="int64", shapes=((2, 3),), op=int(ReduceOp.SUM))
    out2 = np.empty_like(a)  # a 2-D out= is reduced into through a flat view of it
    flat = a.reshape(-1)
    assert lane.finish(two_d, [a], [out2], False, [flat, flat], 2, rank=0) is out2 and (out2 == 2 * a).all()
    zeros = np.zeros_like(a)
    b = req(kind=wire.BROADCAST, dtype="int64", shapes=((2, 3),), root=1, op=0)
    parts = [np.zeros(0, np.int64), a.reshape(-1)]
    assert (lane.finish(b, [zeros], [None], False, parts, 2, rank=0) == a).all()
    out = np.empty_like(a)
    assert lane.finish(b, [zeros], [out], False, parts, 2, rank=0) is out and (out == a).all()
    g = req(kind=wire.ALLGATHER, dtype="int64", shapes=((1, 3),), op=0)
    rows = [a[:1], a[1:], np.zeros((0, 3), np.int64)]
    got = lane.finish(g, [rows[0]], [None], False, [r.reshape(-1) for r in rows], 3, rank=0)
    assert got.shape == (2, 3) and (got == a).all()
    assert lane.finish(req(kind=wire.BARRIER, shapes=()), [], [], False, [np.zeros(0, np.uint8)] * 2, 2, rank=0) is None
    x, y = np.ones(3, np.float32), np.full(2, 2.0, np.float32)
    grouped = req(shapes=((3,), (2,)))
    flat = np.concatenate([x, y])
    res = lane.finish(grouped, [x, y], [None, None], True, [flat] * 2, 2, rank=0)
    assert [r.tolist() for r in res] == [[2, 2, 2], [4, 4]]


def test_the_lane_bound_by_job_size_keeps_the_region_within_16_mib() -> None:
    from ringcomm.job.config import Settings
    from ringcomm.errors import InvalidInputError

    s = Settings()
    assert [s.shm_lane_bytes_for(n) for n in (2, 3, 4, 8, 16, 64, 4096)] == [
        2 << 20, 1398101, 1 << 20, 512 << 10, 256 << 10, 64 << 10, 64 << 10]
    for n in range(2, 65):  # 4 entries per rank
        assert 4 * n * s.shm_lane_bytes_for(n) <= 16 << 20
    assert Settings.from_env({"RINGCOMM_SHM_LANE_BYTES": "4096"}).shm_lane_bytes_for(64) == 4096
    assert Settings.from_env({"RINGCOMM_SHM_LANE_BYTES": "0"}).shm_lane_bytes_for(2) == 0
    with pytest.raises(InvalidInputError, match="by job size"):
        Settings.from_env({"RINGCOMM_SHM_LANE_BYTES": "-2"})


def test_ops_that_only_move_data_take_the_lane_to_a_bound_of_their_own_within_a_64_mib_region() -> None:
    from ringcomm.core import routing
    from ringcomm.job.config import Settings

    s = Settings()
    assert [s.shm_lane_move_bytes_for(n) for n in (2, 3, 4, 8, 16, 64, 4096)] == [
        8 << 20, 5592405, 4 << 20, 2 << 20, 1 << 20, 256 << 10, 64 << 10]
    for n in range(2, 129):
        assert s.shm_lane_bytes_for(n) <= s.shm_lane_move_bytes_for(n)
        assert 4 * n * s.shm_lane_move_bytes_for(n) <= max(64 << 20, 4 * n * s.shm_lane_bytes_for(n))
    assert Settings.from_env({"RINGCOMM_SHM_LANE_BYTES": "4096"}).shm_lane_move_bytes_for(2) == 4096
    assert Settings.from_env({"RINGCOMM_SHM_LANE_BYTES": "0"}).shm_lane_move_bytes_for(2) == 0
    lim = routing.RouteLimits(lane_bytes=1 << 20, lane_move_bytes=4 << 20)
    at_lane = routing.PathFacts(routing.Where.LANE)
    for kind in (wire.BROADCAST, wire.ALLGATHER, wire.ALLTOALL):
        assert routing.route(kind, 4 << 20, at_lane, lim) is routing.Path.LANE
        assert routing.route(kind, (4 << 20) + 1, at_lane, lim) is not routing.Path.LANE
    for kind in (wire.ALLREDUCE, wire.REDUCESCATTER):
        assert routing.route(kind, 1 << 20, at_lane, lim) is routing.Path.LANE
        assert routing.route(kind, 2 << 20, at_lane, lim) is not routing.Path.LANE
    # no lane at all: no kind takes it, whatever the bound for moving data
    off = routing.RouteLimits(lane_bytes=0, lane_move_bytes=4 << 20)
    assert routing.route(wire.BROADCAST, 8, at_lane, off) is not routing.Path.LANE
    # the default (-1): one bound for every kind
    one = routing.RouteLimits(lane_bytes=1 << 20)
    assert routing.route(wire.ALLTOALL, 2 << 20, at_lane, one) is not routing.Path.LANE


def test_the_lane_region_grows_past_its_base_size_only_into_a_quarter_of_the_free_room() -> None:
    from ringcomm.shm import space

    MiB = 1 << 20
    assert space.lane_payload_bytes(8 * MiB, 2 * MiB, 24 << 30, 8) == 8 * MiB  # plenty of room
    assert space.lane_payload_bytes(8 * MiB, 2 * MiB, 192 * MiB, 8) == 6 * MiB  # 48 MiB of 192 for 8 entries
    assert space.lane_payload_bytes(8 * MiB, 2 * MiB, 64 * MiB, 8) == 2 * MiB  # a container's 64 MB: the base
    assert space.lane_payload_bytes(8 * MiB, 2 * MiB, 1 * MiB, 8) == 2 * MiB  # not even that: the base (not made)
    assert space.lane_payload_bytes(8 * MiB, 2 * MiB, None, 8) == 2 * MiB  # unknown room
    assert space.lane_payload_bytes(2 * MiB, 2 * MiB, 1 * MiB, 8) == 2 * MiB  # nothing to grow
    assert space.lane_payload_bytes(8 * MiB, 2 * MiB, 100 * MiB + 12345, 8) % 64 == 0


def test_the_lane_across_hosts_is_off_by_default_and_by_job_size_when_asked_for() -> None:
    from ringcomm.job.config import Settings
    from ringcomm.errors import InvalidInputError

    assert Settings().net_lane_bytes_for(2) == 0
    sized = Settings.from_env({"RINGCOMM_NET_LANE_BYTES": "-1"})
    # each rank sends every payload to each of the others: the bound shrinks with the size, off past 8
    assert [sized.net_lane_bytes_for(n) for n in (1, 2, 4, 8, 9, 64)] == [0, 64 << 10, 32 << 10, 16 << 10, 0, 0]
    assert Settings.from_env({"RINGCOMM_NET_LANE_BYTES": "4096"}).net_lane_bytes_for(64) == 4096
    for bad in ("-2", str(4 * 1024 * 1024 + 1)):
        with pytest.raises(InvalidInputError, match="RINGCOMM_NET_LANE_BYTES must be between 0"):
            Settings.from_env({"RINGCOMM_NET_LANE_BYTES": bad})


def test_still_missing_lists_the_ranks_not_yet_posted_and_gives_up_at_a_mismatch() -> None:
    assert lane.still_missing([1, 2, 3], [-1, 8, -1]) == [1, 3]
    assert lane.still_missing([1, 2], [4, 8]) == []
    assert lane.still_missing([1, 2, 3], [-1, None, -1]) is None
    assert lane.still_missing([], []) == []


def test_a_rank_that_is_off_holds_back_only_the_slots_of_indices_it_posted() -> None:
    # rank 1 joined after posting indices 0..2 and reading them all: index 7's slot is free of it
    assert lane.first_unread(7, [9, 3], [9, 3], [0, 1]) == 9
    # ...but not while it still reads an index it posted (it is resolving index 1 as it closes)
    assert lane.first_unread(1, [9, 1], [9, 3], [0, 1]) == 1
    # a rank that is still on holds back every index it has not finished, posted or not
    assert lane.first_unread(7, [9, 3], [9, 3], [0, 0]) == 7
    assert lane.first_unread(2**32 - 1, [1, 2**32 - 1], [1, 2**32 - 1], [0, 1]) == 2**32 + 1  # counters wrap


@given(st.integers(0, 2**32 - 1), st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.booleans()),
                                          min_size=1, max_size=5))
def test_first_unread_is_the_first_index_some_rank_may_read(index, ranks) -> None:
    """A model: rank r may read index i unless it has finished it (read_below > i) or it is off and
    never posted i.  Counters sit near ``index`` (offsets), and wrap at 32 bits."""
    reads = [(index + rd) & 0xFFFFFFFF for rd, _, _ in ranks]
    posts = [(index + max(rd, ps)) & 0xFFFFFFFF for rd, ps, _ in ranks]
    offs = [int(off) for _, _, off in ranks]

    def may_read(rd: int, ps: int, off: bool, i: int) -> bool:  # offsets from index
        return not (rd > i or (off and ps <= i))

    first = next((i for i in range(42) if any(may_read(rd, max(rd, ps), off, i) for rd, ps, off in ranks)), None)
    ahead = (lane.first_unread(index, reads, posts, offs) - index) % 2**32
    assert first is None or ahead <= first  # safe: no rank may still read an index below the answer
    assert (ahead >= 1) == (first != 0)  # progress: the answer moves past index once nobody reads it
