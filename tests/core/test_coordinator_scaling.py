"""What grows with the job size on rank 0: pure checks of the coordinator and the small-op bound."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.core import wire
from ringcomm.bench import coordination
from ringcomm.job.config import SMALL_ALLREDUCE_RANK0_BYTES, Settings
from ringcomm.core.controller import Controller
from ringcomm.core.wire import Request

pytestmark = pytest.mark.pure


@given(st.integers(min_value=1, max_value=100_000))
def test_rank0_takes_in_at_most_a_fixed_amount_per_small_op(size):
    bound = Settings().small_allreduce_bytes_for(size)
    assert bound >= 0
    assert bound * size <= SMALL_ALLREDUCE_RANK0_BYTES


def test_small_op_bound_keeps_the_measured_one_host_rule():
    s = Settings()
    assert [s.small_allreduce_bytes_for(n) for n in (2, 3, 4, 5, 8)] == [16384, 32768, 65536, 131072, 131072]
    assert s.small_allreduce_bytes_for(64) == 16384
    assert s.small_allreduce_bytes_for(4096) == 256


@given(st.integers(min_value=2, max_value=300), st.integers(min_value=1, max_value=5))
def test_an_op_is_released_exactly_when_the_last_member_announces_it(size, tensors):
    ctrl = Controller(size, 1 << 30)
    reqs = [Request(f"t{i}", wire.ALLREDUCE, "float32", ((4,),), 1) for i in range(tensors)]
    for rank in range(size - 1):
        for q in reqs:
            ctrl.submit(rank, q)
        assert not ctrl.has_ready()
    for q in reqs:
        ctrl.submit(size - 1, q)
    out = ctrl.take_responses()
    assert [r.names for r, _ in out] == [tuple(q.name for q in reqs)]
    assert out[0][1] == tuple(range(size))


def test_coordination_simulation_reports_every_size():
    rows = coordination.run([4, 16], tensors=3, ops=2)
    assert [r["ranks"] for r in rows] == [4, 16]
    assert all(r["cold_us_per_request"] > 0 and r["cached_us_per_request"] > 0 for r in rows)
    assert "| 16 |" in coordination.format_table(rows)
