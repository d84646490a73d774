"""Reading a same-host peer's payloads from its memory: the protocol's state, in one process, and in jobs."""

from __future__ import annotations

import errno
import os
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.core import wire
from ringcomm.shm import cross_memory
from ringcomm.shm.cross_memory import CrossMemory

pytestmark = pytest.mark.skipif(cross_memory.unavailable_reason() is not None,
                                reason=str(cross_memory.unavailable_reason()))

ME = os.getpid()  # a process may read its own memory: the two "ranks" below are one process


def _pair(min_bytes: int = 1024) -> tuple[CrossMemory, CrossMemory]:
    sender, receiver = CrossMemory(min_bytes), CrossMemory(min_bytes)
    sender.add_peer(1, ME)
    receiver.add_peer(0, ME)
    return sender, receiver


def _introduce(sender: CrossMemory, receiver: CrossMemory, nbytes: int) -> None:
    probe = sender.probe(1, nbytes)
    assert probe is not None
    msg = wire.parse_data(probe, 1, 8, 1 << 20)
    answer = wire.parse_data(receiver.answer(0, msg.address, msg.token), 1, 8, 1 << 20)
    sender.answered(1, answer.ok)


def test_read_into_copies_the_bytes_and_names_a_missing_process() -> None:
    src = np.arange(100_000, dtype=np.float32)
    dest = np.zeros_like(src)
    cross_memory.read_into(ME, cross_memory.address(src), dest)
    assert np.array_equal(src, dest)
    with pytest.raises(OSError) as info:
        cross_memory.read_into(2**22 + 12345, cross_memory.address(src), dest)  # beyond pid_max's default
    assert info.value.errno in (errno.ESRCH, errno.EPERM)


def test_payloads_go_by_reference_only_after_the_peer_read_the_probe_right() -> None:
    sender, receiver = _pair()
    assert not sender.by_reference(1, 4096)
    assert sender.probe(1, 100) is None  # below the bound: no probe
    _introduce(sender, receiver, 4096)
    assert sender.probe(1, 4096) is None  # once per peer
    assert sender.by_reference(1, 4096) and not sender.by_reference(1, 1000)
    assert not sender.by_reference(2, 4096)  # not a same-host peer


def test_a_probe_read_at_the_wrong_place_or_from_another_process_says_no() -> None:
    sender, receiver = _pair()
    msg = wire.parse_data(sender.probe(1, 4096) or b"", 1, 8, 1 << 20)
    wrong_token = wire.parse_data(receiver.answer(0, msg.address, bytes(16)), 1, 8, 1 << 20)
    assert not wrong_token.ok
    other = CrossMemory(1024)
    other.add_peer(0, os.getppid())  # another pid namespace's "same" pid names another process
    assert not wire.parse_data(other.answer(0, msg.address, msg.token), 1, 8, 1 << 20).ok
    sender.answered(1, False)
    assert not sender.by_reference(1, 4096)


def test_a_rank_with_the_setting_off_neither_probes_nor_reads() -> None:
    off = CrossMemory(0)
    off.add_peer(1, ME)
    assert off.probe(1, 1 << 20) is None and not off.by_reference(1, 1 << 20)
    sender, _ = _pair()
    msg = wire.parse_data(sender.probe(1, 4096) or b"", 1, 8, 1 << 20)
    off.add_peer(0, ME)
    assert not wire.parse_data(off.answer(0, msg.address, msg.token), 1, 8, 1 << 20).ok


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1024, 50_000), st.booleans()), min_size=1, max_size=8))
def test_lent_payloads_arrive_whole_where_expected_and_are_held_until_read(sends: list[tuple[int, bool]]) -> None:
    sender, receiver = _pair()
    _introduce(sender, receiver, 1024)
    rng = np.random.default_rng(len(sends))
    outgoing, messages, places = [], [], {}
    for tag, (n, expected) in enumerate(sends):
        payload = rng.integers(0, 256, n, dtype=np.uint8)
        outgoing.append(payload)
        if expected:
            places[tag] = np.zeros(n, np.uint8)
            receiver.expect(0, 7, tag, places[tag])
        messages.append(sender.lend(1, payload, 7, tag))
    assert sender.lent(1) == len(sends) and sender.lent_to() == [1]
    for tag, head in enumerate(messages):
        msg = wire.parse_data(head, 1, 8, 1 << 20)
        got, placed = receiver.read(0, msg.address, msg.nbytes, msg.seq, msg.tag)
        assert placed is (tag in places)
        if placed:
            assert got is places[tag]
        assert np.array_equal(got, outgoing[tag])
        assert sender.returned(1)
    assert sender.lent(1) == 0 and sender.lent_to() == []
    assert not sender.returned(1)  # a stray answer is told apart


def test_expected_places_are_forgotten_when_the_payload_came_another_way_or_the_op_is_over() -> None:
    sender, receiver = _pair()
    _introduce(sender, receiver, 1024)
    place = np.zeros(2048, np.uint8)
    receiver.expect(0, 3, 1, place)
    receiver.settled(0, 3, 1)  # it came through a slot
    payload = np.ones(2048, np.uint8)
    msg = wire.parse_data(sender.lend(1, payload, 3, 1), 1, 8, 1 << 20)
    got, placed = receiver.read(0, msg.address, msg.nbytes, 3, 1)
    assert not placed and not place.any() and got.all()
    receiver.expect(0, 4, 0, place)
    receiver.forget_before(0, 5)
    msg = wire.parse_data(sender.lend(1, payload, 4, 0), 1, 8, 1 << 20)
    assert receiver.read(0, msg.address, msg.nbytes, 4, 0)[1] is False
    receiver.expect(0, 6, 0, place)
    with pytest.raises(ValueError, match="2048 were expected"):
        receiver.read(0, msg.address, 1024, 6, 0)


_JOB = textwrap.dedent("""
    import numpy as np, ringcomm as rc
    from ringcomm import runtime
    rc.init()
    r, n = rc.rank(), rc.size()
    ok = True
    for count in (70_000, 1_000_003):
        datas = [np.random.default_rng(q + count).integers(-50, 50, count).astype(np.float32) for q in range(n)]
        for it in range(2):
            buf = datas[r].copy()
            rc.allreduce(buf, op=rc.Sum, name=f"a{count}.{it}", out=buf)
            ok &= np.array_equal(buf, sum(datas))
            got = rc.allgather(datas[r][: count - r], name=f"g{count}.{it}")
            ok &= np.array_equal(got, np.concatenate([datas[q][: count - q] for q in range(n)]))
            b = datas[r].copy()
            rc.broadcast(b, n - 1, name=f"b{count}.{it}", out=b)
            ok &= np.array_equal(b, datas[n - 1])
    stats = runtime.current("stats").engine._link.stats
    print("RESULT", r, ok, stats.get("cross_memory", 0), stats.get("cross_memory_read", 0), flush=True)
    rc.shutdown()
""")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting,hosts", [("262144", 1), ("0", 1), ("262144", 2)], ids=["on", "off", "two-hosts"])
def test_jobs_read_same_host_payloads_from_the_senders_memory_unless_it_is_off(
        tmp_path, setting: str, hosts: int) -> None:
    from conftest import start_torchrun_job

    script = tmp_path / "job.py"
    script.write_text(_JOB)
    world = 4 if hosts == 2 else 3
    # the 4 MB ops through the engine, whose payloads cross memory (the lane would take the broadcasts
    # and allgathers up to 16 MiB / ranks)
    procs = start_torchrun_job([str(script)], world, [{"RINGCOMM_HOSTNAME": f"host{r * hosts // world}"}
                                                     for r in range(world)],
                               RINGCOMM_CROSS_MEMORY_MIN_BYTES=setting, RINGCOMM_SHM_LANE_BYTES="1048576")
    outs = [p.communicate(timeout=100)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    results = [line.split()[1:] for out in outs for line in out.splitlines() if line.startswith("RESULT")]
    assert len(results) == world and all(ok == "True" for _, ok, _, _ in results), outs
    sent = sum(int(s) for _, _, s, _ in results)
    read = sum(int(x) for _, _, _, x in results)
    assert sent == read  # every payload lent was read once
    assert (sent > 0) == (setting != "0"), results


def test_buffers_read_into_are_reused_once_the_caller_is_done_and_kept_within_a_bound() -> None:
    sender, receiver = _pair()
    _introduce(sender, receiver, 1024)
    payload = np.arange(4096, dtype=np.uint8)
    msg = wire.parse_data(sender.lend(1, payload, 1, 0), 1, 8, 1 << 20)
    first, _ = receiver.read(0, msg.address, msg.nbytes, 1, 0)
    again, _ = receiver.read(0, msg.address, msg.nbytes, 1, 1)
    assert again is not first  # still handed out: never read into twice
    receiver.give_back(first)
    third, _ = receiver.read(0, msg.address, msg.nbytes, 1, 2)
    assert third is first and np.array_equal(third, payload)
    receiver.give_back(third)
    receiver.give_back(again)
    big = np.zeros(cross_memory.SPARE_BYTES, np.uint8)
    receiver.give_back(big)  # over the bound with the two kept: dropped, not kept
    msg = wire.parse_data(sender.lend(1, big, 1, 3), 1, 8, 1 << 30)
    assert receiver.read(0, msg.address, msg.nbytes, 1, 3)[0] is not big


def test_spare_buffers_keep_within_their_bound_or_one_larger_buffer() -> None:
    from ringcomm.core.buffers import SpareBuffers

    pool = SpareBuffers(8192)
    a, b = pool.take(4096), pool.take(4096)
    assert a is not b and a.nbytes == 4096 and a.dtype == np.uint8
    pool.give(a)
    pool.give(b)
    pool.give(pool.take(100))  # 8292 bytes: over the bound, dropped
    assert pool.kept_bytes == 8192
    assert {id(pool.take(4096)), id(pool.take(4096))} == {id(a), id(b)}
    huge = np.empty(1 << 20, np.uint8)
    pool.give(huge)  # larger than the bound, nothing else kept: kept
    assert pool.take(1 << 20) is huge and pool.kept_bytes == 0
