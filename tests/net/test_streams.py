"""Payload streams across hosts (``ringcomm/net/streams.py``) inside the real DataPlane, ranks as threads.

Even ranks count as one host and odd ranks as another, so every ring neighbour is on the other
host and each large payload goes over a TCP stream of its own; small ones stay on ZeroMQ.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.collectives import algorithms
from ringcomm.core import wire
from ringcomm.core.ops import ReduceOp
from ringcomm.errors import PeerLostError, ProtocolError
from ringcomm.net.handshake import Proofs
from ringcomm.net.transport import DataPlane
from test_algorithms_inprocess import run_ranks, zmq_links  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def planes(zmq_links):  # noqa: F811 (the fixture imported above)
    def build(size: int, stream_min: int = 1024, encrypt: bool = False, peer_timeout: float = 5.0,
              segment: int = 1 << 20) -> list[DataPlane]:
        return zmq_links(size, zero_copy_min=256, encrypt=encrypt, stream_min=stream_min, peer_timeout=peer_timeout,
                         max_payload=segment, same_host=lambda r, q: q % 2 == r % 2)

    return build


def on_threads(ps: list[Any], fn: Callable[[Any, int], Any]) -> list[Any]:
    out = run_ranks(ps, fn)
    assert len(out) == len(ps)
    return out


@pytest.mark.parametrize("size", [2, 3, 4])
def test_collectives_across_hosts_go_over_streams_and_are_exact(planes, size: int) -> None:
    ps = planes(size)
    rng = np.random.default_rng(size)
    inputs = [[rng.standard_normal(n) for n in (3, 700, 70_000, 300_000)] for _ in range(size)]

    def fn(p: DataPlane, r: int) -> list[np.ndarray]:
        outs = []
        for seq, x in enumerate(inputs[r]):
            buf = x.copy()
            algorithms.ring_allreduce(p, buf, ReduceOp.SUM, 2 * seq, 16_384)  # 128 KiB segments
            outs.append(buf)
            ag = np.empty(x.size * size)
            ag[r * x.size:(r + 1) * x.size] = x  # the own block is filled in already
            algorithms.ring_allgatherv(p, ag, [x.size] * size, 2 * seq + 1, 16_384)
            outs.append(ag)
        return outs

    results = on_threads(ps, fn)
    for i in range(4):
        total = sum(inputs[r][i] for r in range(size))
        for r in range(size):
            np.testing.assert_allclose(results[r][2 * i], total, rtol=1e-12, atol=1e-12)
            assert results[r][2 * i].tobytes() == results[0][2 * i].tobytes()  # the same bits on every rank
            assert results[r][2 * i + 1].tobytes() == np.concatenate([inputs[q][i] for q in range(size)]).tobytes()
    streamed = sum(p.stats["stream"] for p in ps)
    inline = sum(p.stats["inline"] for p in ps)
    assert streamed > 0 and inline > 0  # large segments streamed, small ones on ZeroMQ
    # the allgather segments were read straight into the results: every large one of them
    placed = sum(p.stats["stream_placed"] for p in ps)
    assert 0 < placed < streamed
    # one connection per direction, and only to peers on the other host
    for p in ps:
        assert all(dst % 2 != p.rank % 2 for dst in p.streams.outgoing)


def test_no_streams_when_off_or_encrypted(planes) -> None:
    for ps in (planes(2, stream_min=0), planes(2, encrypt=True)):
        on_threads(ps, lambda p, r: algorithms.ring_allreduce(p, np.ones(100_000), ReduceOp.SUM, 0, 16_384))
        assert sum(p.stats["stream"] for p in ps) == 0
        assert all(p.listen_streams("127.0.0.1") is None for p in ps)


def _connect(address: list) -> socket.socket:
    return socket.create_connection((str(address[0]), int(address[1])), timeout=5)


def _closed_unanswered(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` without sending a byte (a reset counts: it had unread bytes)."""
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True


def test_a_stranger_is_refused_and_the_streams_still_work(planes) -> None:
    ps = planes(2)
    address = ps[1].streams.incoming.address  # type: ignore[union-attr]
    stranger = _connect(address)
    stranger.sendall(wire.STREAM.pack(b"T", 0, 0, 8) + bytes(28))  # not a hello: rank 0 and a wrong proof
    assert _closed_unanswered(stranger)
    liar = _connect(address)
    liar.sendall(Proofs(b"wrong key", "stream", "x", 0).hello(0, 0, 1))
    assert _closed_unanswered(liar)
    x = np.arange(50_000, dtype=np.float64)
    bufs = [x.copy(), x.copy()]
    on_threads(ps, lambda p, r: algorithms.ring_allreduce(p, bufs[r], ReduceOp.SUM, 0, 16_384))
    assert ps[0].stats["stream"] > 0 and ps[1].stats["stream"] > 0
    assert bufs[0].tobytes() == bufs[1].tobytes() == (x * 2).tobytes()


def test_a_listener_that_cannot_answer_is_named_as_lost(planes) -> None:
    ps = planes(2, peer_timeout=2.0)
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(1)
    ps[0].streams.add_peer(1, list(fake.getsockname()))  # rank 1 now listens there, as far as rank 0 knows

    def answer_wrong() -> None:
        conn, _ = fake.accept()
        conn.recv(64)
        conn.sendall(b"x" * 32)
        time.sleep(1)
        conn.close()

    threading.Thread(target=answer_wrong, daemon=True).start()
    ps[0].send(1, 0, 0, np.ones(10_000))
    started = time.monotonic()
    with pytest.raises(PeerLostError, match=r"lost rank 1.*stream.*did not prove the job secret"):
        ps[0].flush()
    assert time.monotonic() - started < 2.0
    fake.close()


def test_a_stream_port_that_cannot_be_reached_names_the_peer_and_the_fix(planes) -> None:
    ps = planes(2, peer_timeout=2.0)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: connecting is refused
    ps[0].streams.add_peer(1, ["127.0.0.1", port])
    ps[0].send(1, 0, 0, np.ones(10_000))
    with pytest.raises(PeerLostError, match=r"lost rank 1.*cannot connect to its stream port.*RINGCOMM_STREAM_MIN_BYTES=0"):
        ps[0].flush()


def test_a_stream_that_breaks_names_its_sender_at_once(planes) -> None:
    ps = planes(2, peer_timeout=30.0)
    ps[0].send(1, 0, 0, np.ones(10_000))
    ps[0].flush()
    assert np.frombuffer(ps[1].recv(0, 0, 0), np.float64).sum() == 10_000
    ps[0].streams.outgoing[1]._sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]  # as a killed process's
    started = time.monotonic()
    with pytest.raises(PeerLostError, match=r"lost rank 0.*stream"):
        ps[1].recv(0, 1, 0)
    assert time.monotonic() - started < 5.0  # not the 30 s peer timeout


def test_a_payload_larger_than_a_segment_breaks_the_stream(planes) -> None:
    ps = planes(2, segment=4096)
    ps[0].send(1, 0, 0, np.ones(1000))  # 8000 bytes: more than a segment (no real sender cuts these)
    with pytest.raises(PeerLostError, match="more than a segment"):
        ps[1].recv(0, 0, 0)


def test_payloads_are_taken_by_seq_and_tag_in_any_order(planes) -> None:
    ps = planes(2)
    a, b, small = np.full(5000, 1.0), np.full(6000, 2.0), np.full(10, 3.0)
    ps[0].send(1, 4, 1, a)
    ps[0].send(1, 4, 0, small)  # on ZeroMQ
    ps[0].send(1, 4, 2, b)
    ps[0].flush()
    assert np.frombuffer(ps[1].recv(0, 4, 2), np.float64).tolist() == b.tolist()
    assert np.frombuffer(ps[1].recv(0, 4, 0), np.float64).tolist() == small.tolist()
    tag, got = ps[1].recv_any(0, 4)
    assert tag == 1 and np.frombuffer(got, np.float64).tolist() == a.tolist()
    assert ps[0].stats["stream"] == 2 and ps[0].stats["inline"] == 1
    ps[0].send(1, 8, 0, a)  # a payload of an op that is over on arrival is dropped, not kept
    ps[0].send(1, 4, 7, b)
    ps[0].send(1, 12, 0, small)
    ps[0].flush()
    i, tag, got = ps[1].recv_first([(0, 12)])
    assert (i, tag) == (0, 0)
    ps[0].send(1, 4, 9, a)
    ps[0].send(1, 16, 0, b)
    ps[0].flush()
    assert np.frombuffer(ps[1].recv(0, 16, 0), np.float64).tolist() == b.tolist()
    assert ps[1].stats["dropped"] >= 1


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**63 - 1), st.integers(0, 2**32 - 1), st.integers(0, 1 << 20), st.binary(max_size=30))
def test_stream_heads_round_trip_and_garbage_is_refused(seq: int, tag: int, n: int, junk: bytes) -> None:
    msg = wire.parse_stream_head(wire.STREAM.pack(b"T", seq, tag, n), 1 << 20)
    assert (msg.kind, msg.seq, msg.tag, msg.nbytes) == (b"T", seq, tag, n)
    with pytest.raises(ProtocolError):
        wire.parse_stream_head(wire.STREAM.pack(b"T", seq, tag, (1 << 20) + 1 + n), 1 << 20)
    if len(junk) != wire.STREAM.size or junk[:1] != b"T":
        with pytest.raises(ProtocolError):
            wire.parse_stream_head(junk, 1 << 20)
