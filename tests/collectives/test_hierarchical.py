"""The hierarchical allreduce: its plan (pure) and the algorithm, one thread per rank over in-process links."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.collectives import algorithms, hierarchical
from ringcomm.core.ops import ReduceOp
from test_algorithms_inprocess import queue_links, run_ranks, zmq_links  # noqa: F401 (a fixture)


@given(st.integers(2, 5), st.integers(2, 4), st.randoms(use_true_random=False))
def test_plans_partition_the_ranks_consistently(hosts: int, per_host: int, rnd) -> None:
    names = [f"h{h}" for h in range(hosts) for _ in range(per_host)]
    rnd.shuffle(names)  # ranks need not be placed host by host
    plans = [hierarchical.plan(names, r) for r in range(len(names))]
    assert all(p is not None for p in plans)
    for r, p in enumerate(plans):
        assert r in p.local and r in p.cross
        assert {names[x] for x in p.local} == {names[r]} and len(p.local) == per_host
        assert sorted(names[x] for x in p.cross) == sorted(set(names)) and len(p.cross) == hosts
        for x in p.local:  # every member of a group has the same view of it
            assert plans[x].local == p.local
        for x in p.cross:
            assert plans[x].cross == p.cross
    # local groups partition the ranks; so do cross groups
    assert sorted(x for p in {q.local for q in plans} for x in p) == list(range(len(names)))
    assert sorted(x for p in {q.cross for q in plans} for x in p) == list(range(len(names)))


def test_layouts_without_a_plan() -> None:
    assert hierarchical.plan(["a", "a", "a"], 0) is None  # one host
    assert hierarchical.plan(["a", "b", "c"], 0) is None  # one rank per host
    assert hierarchical.plan(["a", "a", "b"], 2) is None  # uneven
    assert hierarchical.plan(["a", "a", "b", "b"], 3) == hierarchical.HostPlan((2, 3), (1, 3))


def test_the_rule() -> None:
    p = hierarchical.plan(["a", "a", "b", "b"], 0)
    assert hierarchical.choose(-1, 1 << 20, p, ReduceOp.SUM)
    assert not hierarchical.choose(-1, (1 << 20) - 1, p, ReduceOp.SUM)
    assert hierarchical.choose(1, 4, p, ReduceOp.SUM)
    assert not hierarchical.choose(0, 1 << 30, p, ReduceOp.SUM)
    assert not hierarchical.choose(1, 1 << 30, None, ReduceOp.SUM)


@settings(max_examples=25)
@given(layout=st.sampled_from([("a", "a", "b", "b"), ("a", "b", "a", "b"), ("x", "x", "x", "y", "y", "y"),
                               ("a", "b", "c", "a", "b", "c")]),
       n=st.integers(0, 300), seg=st.integers(1, 64),
       op=st.sampled_from([ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]),
       dtype=st.sampled_from(["float32", "float64", "int32"]), post=st.sampled_from([1.0, 0.5]),
       pieces=st.integers(1, hierarchical.MAX_PIECES), use_src=st.booleans())
def test_every_rank_gets_the_reduction_bitwise_alike(layout, n, seg, op, dtype, post, pieces, use_src) -> None:
    if op is ReduceOp.AVERAGE and dtype == "int32":
        return
    size = len(layout)
    rng = np.random.default_rng(n + size)
    inputs = [(rng.integers(-3, 4, n) if dtype == "int32" else rng.standard_normal(n)).astype(dtype)
              for _ in range(size)]
    post_eff = post / size if op is ReduceOp.AVERAGE else post

    def body(link, r):
        buf = np.full_like(inputs[r], 77) if use_src else inputs[r].copy()  # with src_buf, buf is only written
        hierarchical.allreduce(link, hierarchical.plan(list(layout), r), buf, op, 64, seg,
                               post_eff if dtype != "int32" else 1.0, src_buf=inputs[r] if use_src else None,
                               pieces=pieces)
        return buf

    out = run_ranks(queue_links(size), body)
    for r in range(1, size):
        assert out[r].tobytes() == out[0].tobytes()  # bitwise the same on every rank
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
             ReduceOp.PRODUCT: np.multiply}[op]
    want = inputs[0].astype("float64")
    for x in inputs[1:]:
        want = ufunc(want, x.astype("float64"))
    if dtype != "int32":
        want = want * post_eff
    np.testing.assert_allclose(out[0].astype("float64"), want, rtol=1e-4, atol=1e-4)


def test_src_buf_is_read_and_left_alone() -> None:
    layout = ["a", "a", "b", "b"]
    src = [np.full(10, r + 1.0, dtype=np.float32) for r in range(4)]

    def body(link, r):
        buf = np.empty(10, dtype=np.float32)
        hierarchical.allreduce(link, hierarchical.plan(layout, r), buf, ReduceOp.SUM, 8, 3, src_buf=src[r])
        return buf

    out = run_ranks(queue_links(4), body)
    assert all(o.tolist() == [10.0] * 10 for o in out)
    assert [s[0] for s in src] == [1.0, 2.0, 3.0, 4.0]


def test_setting_is_checked() -> None:
    from ringcomm.job.config import Settings
    from ringcomm.errors import InvalidInputError

    assert Settings.from_env({"RINGCOMM_HIERARCHICAL_ALLREDUCE": "1"}).hierarchical_allreduce == 1
    with pytest.raises(InvalidInputError):
        Settings.from_env({"RINGCOMM_HIERARCHICAL_ALLREDUCE": "2"})
    assert Settings.from_env({"RINGCOMM_HIERARCHICAL_PIECE_BYTES": "0"}).hierarchical_piece_bytes == 0
    with pytest.raises(InvalidInputError, match="HIERARCHICAL_PIECE_BYTES"):
        Settings.from_env({"RINGCOMM_HIERARCHICAL_PIECE_BYTES": "-1"})


def test_pieces_rule() -> None:
    assert hierarchical.pieces_for(64 << 20, 8 << 20) == 8
    assert hierarchical.pieces_for(64 << 20, 1 << 20) == hierarchical.MAX_PIECES
    assert hierarchical.pieces_for(12 << 20, 8 << 20) == 1
    assert hierarchical.pieces_for(1 << 30, 0) == 1
    assert hierarchical.PHASES >= 3 * hierarchical.MAX_PIECES  # every pass of an op has a sequence number


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm_slots,seg", [(0, 100), (4, 512)])
def test_pipelined_over_the_data_plane_back_to_back_with_flat_rings(zmq_links, shm_slots: int,  # noqa: F811
                                                                   seg: int) -> None:
    """Real data planes (several passes of one op open towards one peer at once), hierarchical ops of
    1 to 8 pieces between flat rings: every result right and bitwise alike on every rank."""
    layout = ["a", "a", "b", "b"]
    links = zmq_links(4, zero_copy_min=256, shm_slots=shm_slots, seq_stride=hierarchical.PHASES)
    sizes = [(5000, 1), (5000, 8), (3, 8), (20_000, 5), (777, 3)]

    def fn(link, r):
        outs = []
        for i, (n, pieces) in enumerate(sizes):
            rng = np.random.default_rng(1000 * i + r)
            buf = rng.standard_normal(n).astype(np.float32)
            hierarchical.allreduce(link, hierarchical.plan(layout, r), buf, ReduceOp.SUM, (2 * i) * hierarchical.PHASES,
                                   seg, pieces=pieces)  # 400 B segments inline, 2 KiB ones in shared memory
            outs.append(buf)
            flat = np.full(1000, r + 1.0)
            algorithms.ring_allreduce(link, flat, ReduceOp.SUM, (2 * i + 1) * hierarchical.PHASES, 64)
            outs.append(flat)
        return outs

    out = run_ranks(links, fn)
    for i, (n, _) in enumerate(sizes):
        want = sum(np.random.default_rng(1000 * i + r).standard_normal(n).astype(np.float32).astype(np.float64)
                   for r in range(4))
        np.testing.assert_allclose(out[0][2 * i], want, rtol=1e-5, atol=1e-5)
        assert all(out[r][2 * i].tobytes() == out[0][2 * i].tobytes() for r in range(4))
        assert all(o[2 * i + 1].tolist() == [10.0] * 1000 for o in out)
