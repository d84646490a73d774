"""The small-op lane in real jobs: same results as the engine, and every way ranks can disagree.

Each job runs a scenario of ``workers/lane_worker.py`` under ringcomm-run.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import WORKERS, launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

WORKER = str(WORKERS / "lane_worker.py")
OFF = {"RINGCOMM_SHM_LANE_BYTES": "0", "RINGCOMM_NET_LANE_BYTES": "0"}


@pytest.fixture(params=["one host", "two hosts"], autouse=True)
def hosts(request, monkeypatch):
    """Every scenario runs with the lane in shared memory (one host) and over TCP (two hosts)."""
    monkeypatch.setenv("LANE_TEST_HOSTS", "1" if request.param == "one host" else "2")
    return request.param


def run(scenario: str, np_: int, out, **env: str):
    out.mkdir(exist_ok=True)
    proc = launch(np_, [WORKER, scenario, str(out)], timeout=180, **env)
    assert proc.returncode == 0, f"{scenario} np={np_} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def results(out, np_: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(np_)]


@pytest.mark.parametrize("np_", [2, 3])
def test_every_small_op_gives_bitwise_what_the_engine_gives(tmp_path, np_):
    run("digests", np_, tmp_path / "lane")
    run("digests", np_, tmp_path / "engine", **OFF)
    lane, engine = results(tmp_path / "lane", np_), results(tmp_path / "engine", np_)
    for r in range(np_):
        assert lane[r] == engine[r], f"rank {r}: " + ", ".join(k for k in lane[r] if lane[r][k] != engine[r].get(k))
    # an allreduce's result is the same on every rank (broadcasts and allgathers too; a reducescatter's
    # block and an alltoall's rows are each rank's own)
    for key, value in lane[0].items():
        assert key.startswith(("rs ", "a2a ")) or all(res[key] == value for res in lane), key


def test_an_unwaited_fast_op_reaches_the_engine_when_a_peer_diverted_it(tmp_path):
    proc = run("sweep", 2, tmp_path)
    assert proc.stdout.count("SWEEP OK") == 2


@pytest.mark.parametrize("np_", [2, 4])
def test_async_ops_submitted_in_different_orders_complete(tmp_path, np_):
    proc = run("reorder", np_, tmp_path)
    assert proc.stdout.count("REORDER OK") == np_


def test_a_small_op_behind_a_large_one_every_rank_started_takes_the_lane(tmp_path):
    proc = run("behind", 2, tmp_path, RINGCOMM_LOG_LEVEL="DEBUG")
    assert proc.stdout.count("BEHIND in flight") == 2
    assert "BEHIND in flight 0" not in proc.stdout  # the large op was still running each time
    fast = sum(proc.stderr.count(f"allreduce 'y{i}': 32 B, process set 0: small-op lane") for i in range(5))
    assert fast >= 2, proc.stderr[-3000:]  # on both ranks at least once (both decide alike)


def test_a_small_op_behind_a_large_one_a_peer_has_not_started_goes_to_the_engine(tmp_path):
    # rank 1 blocks on the small op before it starts the large one: had rank 0 posted its small op
    # fast, it would wait for rank 1's next post while rank 1 waits for it in the engine
    proc = run("crossed", 2, tmp_path, RINGCOMM_SHM_LANE_BYTES="65536", RINGCOMM_NET_LANE_BYTES="65536")
    assert proc.stdout.count("CROSSED OK") == 2


@pytest.mark.parametrize("np_", [2, 3])
def test_alltoalls_whose_ranks_split_differently_take_the_lane(tmp_path, np_):
    proc = run("uneven", np_, tmp_path, RINGCOMM_LOG_LEVEL="DEBUG")
    assert proc.stdout.count("UNEVEN OK") == np_
    # every op on every rank, a scatter's ranks that send nothing included (they post their splits)
    for i in range(6):
        fast = re.findall(rf"alltoall 'u{i}': \d+ B, process set 0: small-op lane", proc.stderr)
        assert len(fast) == np_, (i, proc.stderr[-3000:])
    # rows of another width on one rank: the op goes to the engine, which fails it on every rank
    assert proc.stdout.count("UNEVEN alltoall 'wide': ranks disagree") == np_, proc.stdout[-3000:]


def test_a_mismatch_raises_on_every_rank_and_the_next_op_works(tmp_path):
    proc = run("mismatch", 2, tmp_path)
    assert proc.stdout.count("MISMATCH allreduce 'bad': ranks disagree on shape") == 2
    assert proc.stdout.count("MISMATCH OK") == 2


def test_join_gives_what_the_engine_gives_and_the_lane_starts_again_after_it(tmp_path):
    proc = run("join", 3, tmp_path / "lane", RINGCOMM_LOG_LEVEL="DEBUG")
    run("join", 3, tmp_path / "engine", **OFF)
    assert results(tmp_path / "lane", 3) == results(tmp_path / "engine", 3)
    for epoch in (0, 1):  # after each join, every rank's small ops take the lane again
        for i in range(5):
            assert proc.stderr.count(f"allreduce 'e{epoch}.after{i}': 16 B, process set 0: small-op lane") == 3


def test_small_ops_appear_on_rank_0s_timeline(tmp_path):
    run("timeline", 2, tmp_path)
    text = (tmp_path / "timeline.json").read_text()
    assert text.count('"t1') >= 1 and "NEGOTIATE_ALLREDUCE" in text


@pytest.mark.parametrize("np_", [2, 3])
def test_threads_of_one_rank_running_small_ops_at_once(tmp_path, np_):
    proc = run("threads", np_, tmp_path)
    assert proc.stdout.count("THREADS OK") == np_


def test_a_rank_that_gave_up_an_op_on_a_stall_joins_and_goes_on_with_the_others(tmp_path):
    proc = run("stalljoin", 3, tmp_path, RINGCOMM_STALL_CHECK_SECONDS="1", RINGCOMM_STALL_SHUTDOWN_SECONDS="2")
    assert "[0]<stdout>:STALLED StallError" in proc.stdout
    assert proc.stdout.count("STALLJOIN OK") == 3
