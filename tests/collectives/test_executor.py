"""The executor on its own: built from its links and settings, it returns results and timeline phases."""

from __future__ import annotations

import numpy as np
import pytest
from test_algorithms_inprocess import queue_links, run_ranks

from ringcomm.job.config import Settings
from ringcomm.core import wire
from ringcomm.core.ops import ReduceOp
from ringcomm.collectives.executor import Executor
from ringcomm.handles import Entry, Handle
from ringcomm.core.wire import Request, Response

SUM = int(ReduceOp.SUM)


def _entry(name: str, *arrays: np.ndarray) -> Entry:
    req = Request(name, wire.ALLREDUCE, "float32", tuple(a.shape for a in arrays), SUM)
    return Entry(req, list(arrays), Handle(name), grouped=len(arrays) > 1)


@pytest.mark.timeout(60)
def test_a_fused_allreduce_over_three_ranks_returns_each_entrys_sum_and_its_phases() -> None:
    size, settings = 3, Settings(segment_bytes=64)
    links = queue_links(size)
    resp = Response(wire.ALLREDUCE, ("a", "b"), "float32", SUM, numels=(5, 7))

    def rank(link, r):  # type: ignore[no-untyped-def]
        ex = Executor(r, size, settings, link)
        entries = [_entry("a", np.full(5, r + 1.0, np.float32)),
                   _entry("b", np.arange(3, dtype=np.float32) + r, np.full(4, 2.0 * r, np.float32))]
        return ex.execute(resp, entries, seq=4, members=(0, 1, 2), timed=True)

    for results, phases in run_ranks(links, rank):
        a, (b0, b1) = results
        assert a.tolist() == [6.0] * 5
        assert b0.tolist() == [3.0, 6.0, 9.0] and b1.tolist() == [6.0] * 4
        names = [p[0] for p in phases]
        assert names[0] == "MEMCPY_IN_FUSION_BUFFER" and names[-1] == "MEMCPY_OUT_FUSION_BUFFER"
        assert all(start <= end for _, start, end in phases)


def test_a_result_rank_0_reduced_is_unpacked_without_the_ring() -> None:
    class NoLink:  # any use of the data plane fails the test
        rank, size = 1, 2

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            raise AssertionError(f"the data plane was used ({name})")

    ex = Executor(1, 2, Settings(), NoLink())
    done = np.array([4.0, 6.0], np.float32)
    resp = Response(wire.ALLREDUCE, ("s",), "float32", SUM, numels=(2,), data=done.tobytes())
    results, phases = ex.execute(resp, [_entry("s", np.ones(2, np.float32))], seq=0, members=(0, 1),
                                 timed=True, reduced_at=1.5)
    assert results[0].tolist() == [4.0, 6.0]
    assert phases[0][0] == "RANK0_REDUCE" and phases[0][1] == 1.5
    untimed = ex.execute(resp, [_entry("s", np.ones(2, np.float32))], seq=1, members=(0, 1))
    assert untimed.phases == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts,segment", [(["a", "b", "c"], 128), (["a", "a", "b"], 64), (None, 64)])
def test_a_job_with_each_rank_on_a_host_of_its_own_cuts_its_ring_into_stream_segments(hosts, segment) -> None:
    """Every link joins two hosts there (streams): segments of ``stream_segment_bytes``, else ``segment_bytes``."""
    size, n = 3, 3 * 64  # float32: chunks of 256 B
    settings = Settings(segment_bytes=64, stream_segment_bytes=128, doubling_allreduce_bytes=0)
    links = queue_links(size)
    sent: list[list[int]] = [[] for _ in range(size)]
    for link in links:
        send = link.send

        def record(dst, seq, tag, arr, send=send, log=sent[link.rank]):  # type: ignore[no-untyped-def]
            log.append(arr.nbytes)
            send(dst, seq, tag, arr)

        link.send = record  # type: ignore[method-assign]
    resp = Response(wire.ALLREDUCE, ("big",), "float32", SUM, numels=(n,))

    def rank(link, r):  # type: ignore[no-untyped-def]
        ex = Executor(r, size, settings, link, hosts=hosts)
        return ex.execute(resp, [_entry("big", np.arange(n, dtype=np.float32) * (r + 1))], seq=0, members=(0, 1, 2))

    for results, _ in run_ranks(links, rank):
        assert results[0].tolist() == (np.arange(n, dtype=np.float32) * 6).tolist()
    # 2 ring steps of one scatter-reduce and 2 of allgather, each a chunk of 256 B in segments
    assert [sorted(set(s)) for s in sent] == [[segment]] * size
    assert [len(s) for s in sent] == [4 * 256 // segment] * size
