"""Rendezvous server and client, in one process (client ranks are threads)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time

import msgpack
import pytest
import zmq

from ringcomm.errors import RendezvousError, RendezvousTimeoutError
from ringcomm.net.rendezvous import RendezvousServer, credentials, kv_get, kv_set, register, sign, verify

SECRET = b"s" * 32


@pytest.fixture
def server4():
    with RendezvousServer(size=4, secret=SECRET) as server:
        yield server


def _register_all(address: str, size: int, rnd: int = 0, timeout: float = 5.0, ranks=None) -> list:
    """Register ``ranks`` (default all) concurrently; returns their results in rank order."""
    ranks = list(range(size)) if ranks is None else ranks
    with concurrent.futures.ThreadPoolExecutor(len(ranks)) as pool:
        futures = [
            pool.submit(register, address, SECRET, r, size, {"rank": r, "ep": f"tcp://h:{5000 + r}"}, timeout, rnd)
            for r in ranks
        ]
        return [f.result() for f in futures]


def _expected(size: int) -> list[dict]:
    return [{"rank": r, "ep": f"tcp://h:{5000 + r}"} for r in range(size)]


def _send_raw(address: str, frames: list[bytes]) -> None:
    """Send arbitrary frames from a throwaway DEALER that passes the handshake, and close it."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        credentials(SECRET).apply_client(sock)
        sock.connect(address)
        sock.send_multipart(frames)
        sock.close()
    finally:
        ctx.term()


@pytest.mark.timeout(10)
def test_sign_and_verify():
    tag = sign(SECRET, b"body")
    assert len(tag) == 32
    assert verify(SECRET, tag, b"body")
    assert not verify(SECRET, tag, b"bodx")
    assert not verify(b"other", tag, b"body")
    assert not verify(SECRET, b"short", b"body")


@pytest.mark.timeout(10)
def test_four_ranks_get_the_same_table_in_rank_order(server4):
    assert server4.address == f"tcp://127.0.0.1:{server4.port}"
    tables = _register_all(server4.address, 4)
    assert tables == [_expected(4)] * 4
    assert server4.open_rounds() == []  # state dropped once every rank got its table


@pytest.mark.timeout(10)
def test_rounds_are_independent_and_sequential(server4):
    assert _register_all(server4.address, 4, rnd=0) == [_expected(4)] * 4
    assert _register_all(server4.address, 4, rnd=1) == [_expected(4)] * 4
    # Two rounds open at once do not mix either.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = {
            (rnd, r): pool.submit(register, server4.address, SECRET, r, 4, {"r": r, "round": rnd}, 5.0, rnd)
            for rnd in (2, 3)
            for r in range(4)
        }
        for (rnd, _), future in futures.items():
            assert future.result() == [{"r": r, "round": rnd} for r in range(4)]
    assert server4.open_rounds() == []


@pytest.mark.timeout(10)
def test_single_rank_job():
    with RendezvousServer(size=1, secret=SECRET) as server:
        assert register(server.address, SECRET, 0, 1, {"x": 1}, 2.0) == [{"x": 1}]


@pytest.mark.timeout(10)
def test_wrong_secret_is_ignored_and_others_still_succeed():
    with RendezvousServer(size=2, secret=SECRET) as server:
        start = time.monotonic()
        with pytest.raises(RendezvousTimeoutError) as info:
            register(server.address, b"wrong secret", 0, 2, {"evil": True}, 0.3)
        assert time.monotonic() - start < 2.0
        assert "did not answer" in str(info.value) and "RINGCOMM_SECRET" in str(info.value)
        assert server.open_rounds() == []  # nothing was acted upon
        assert _register_all(server.address, 2) == [_expected(2)] * 2


@pytest.mark.timeout(15)
def test_garbage_does_not_disturb_the_server(caplog):
    caplog.set_level(logging.DEBUG, logger="ringcomm.net.rendezvous")
    with RendezvousServer(size=2, secret=SECRET) as server:
        body = msgpack.packb({"op": "register", "round": 0, "rank": 0, "size": 2, "info": {}})
        half_open = socket.create_connection(("127.0.0.1", server.port))
        half_open.sendall(b"\xff" + os.urandom(64))  # not even a ZMTP greeting; then keep it open
        silent = socket.create_connection(("127.0.0.1", server.port))  # connects, never speaks
        try:
            for frames in (
                [os.urandom(100)],  # one frame
                [b"a", b"b", b"c"],  # three frames
                [],  # routing id only
                [os.urandom(32), body],  # forged tag
                [sign(b"wrong", body), body],  # wrong secret
                [sign(SECRET, b"\xc1\xc1junk"), b"\xc1\xc1junk"],  # authenticated, not msgpack
                [sign(SECRET, b"\x93\x01\x02\x03"), b"\x93\x01\x02\x03"],  # msgpack, not a map
            ):
                if frames:
                    _send_raw(server.address, frames)
            garbage_tcp = socket.create_connection(("127.0.0.1", server.port))
            garbage_tcp.sendall(os.urandom(4096))
            garbage_tcp.close()
            assert server.open_rounds() == []
            assert _register_all(server.address, 2) == [_expected(2)] * 2
            dropped = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
            for reason in ("3 frames", "bad HMAC tag", "not msgpack", "not a map"):
                assert reason in dropped
        finally:
            half_open.close()
            silent.close()


@pytest.mark.timeout(10)
def test_authenticated_but_malformed_requests_get_an_error_answer(server4):
    with pytest.raises(RendezvousError, match="expects|started for 4"):
        register(server4.address, SECRET, 0, 3, {}, 2.0)
    with pytest.raises(RendezvousError, match="out of range"):
        register(server4.address, SECRET, 4, 4, {}, 2.0)
    with pytest.raises(RendezvousError, match="out of range"):
        register(server4.address, SECRET, -1, 4, {}, 2.0)
    with pytest.raises(RendezvousError, match="dict info"):
        register(server4.address, SECRET, 0, 4, "not a dict", 2.0)  # type: ignore[arg-type]
    assert server4.open_rounds() == []


@pytest.mark.timeout(10)
def test_same_rank_twice_with_different_info_is_refused():
    with RendezvousServer(size=2, secret=SECRET) as server:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(register, server.address, SECRET, 0, 2, {"rank": 0, "ep": "tcp://h:5000"}, 5.0)
            deadline = time.monotonic() + 2
            while server.open_rounds() != [0] and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(RendezvousError, match="RINGCOMM_RANK=0"):
                register(server.address, SECRET, 0, 2, {"other": 1}, 2.0)
            assert register(server.address, SECRET, 1, 2, {"rank": 1, "ep": "tcp://h:5001"}, 5.0) == _expected(2)
            assert first.result() == _expected(2)


@pytest.mark.timeout(10)
def test_resend_of_the_same_registration_is_a_retry():
    with RendezvousServer(size=2, secret=SECRET) as server:
        info0 = {"rank": 0, "ep": "tcp://h:5000"}
        with pytest.raises(RendezvousTimeoutError):
            register(server.address, SECRET, 0, 2, info0, 0.2)  # gives up; its route is now dead
        # The retry replaces the route, so the table reaches the new socket.
        assert _register_all(server.address, 2) == [_expected(2)] * 2
        # A late retry of a completed round still gets the table.
        assert register(server.address, SECRET, 0, 2, info0, 2.0) == _expected(2)
        with pytest.raises(RendezvousError, match="already completed"):
            register(server.address, SECRET, 0, 2, {"new": "info"}, 2.0)


@pytest.mark.timeout(10)
def test_timeout_message_names_address_round_missing_ranks_and_fix():
    with RendezvousServer(size=3, secret=SECRET) as server:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(register, server.address, SECRET, 0, 3, {"r": 0}, 0.8)
            with pytest.raises(RendezvousTimeoutError) as info:
                register(server.address, SECRET, 2, 3, {"r": 2}, 0.3, round=0)
            with pytest.raises(RendezvousTimeoutError):
                waiting.result()
    message = str(info.value)
    assert isinstance(info.value, TimeoutError)
    assert message.startswith("rank 2 timed out after 0.3 s waiting for the rendezvous at " + server.address)
    assert "(round 0)" in message
    assert "2 of 3 ranks registered; missing: 1" in message
    assert "RINGCOMM_START_TIMEOUT" in message and "--start-timeout" in message


@pytest.mark.timeout(10)
def test_timeout_when_no_server_is_listening():
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="did not answer at all") as info:
        register(address, SECRET, 1, 2, {}, 0.2)
    assert address in str(info.value)
    assert time.monotonic() - start < 2.0


@pytest.mark.timeout(10)
def test_kv_set_get_and_a_get_that_waits_for_a_later_set(server4):
    kv_set(server4.address, SECRET, "a", b"\x00\x01value", 2.0)
    assert kv_get(server4.address, SECRET, "a", 2.0) == b"\x00\x01value"
    kv_set(server4.address, SECRET, "a", b"new", 2.0)
    assert kv_get(server4.address, SECRET, "a", 0.0) == b"new"

    def later() -> None:
        time.sleep(0.3)
        kv_set(server4.address, SECRET, "late", b"arrived", 2.0)

    setter = threading.Thread(target=later)
    start = time.monotonic()
    setter.start()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two waiters on the same key
        waiters = [pool.submit(kv_get, server4.address, SECRET, "late", 5.0) for _ in range(2)]
        assert [w.result() for w in waiters] == [b"arrived", b"arrived"]
    setter.join()
    assert 0.2 < time.monotonic() - start < 3.0


@pytest.mark.timeout(10)
def test_kv_get_times_out_without_blocking_other_requests(server4):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(kv_get, server4.address, SECRET, "never", 0.5)
        time.sleep(0.05)
        start = time.monotonic()
        assert _register_all(server4.address, 4) == [_expected(4)] * 4  # server not blocked by the get
        assert time.monotonic() - start < 0.5
        with pytest.raises(RendezvousTimeoutError, match="'never'"):
            pending.result()


@pytest.mark.timeout(10)
def test_kv_wrong_types_are_refused(server4):
    with pytest.raises(TypeError, match="bytes value"):
        kv_set(server4.address, SECRET, "k", "text", 2.0)  # type: ignore[arg-type]
    # The server checks too (another client may not): an authenticated bad request gets an error answer.
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        credentials(SECRET).apply_client(sock)
        sock.connect(server4.address)
        for request in ({"op": "set", "key": "k", "value": "text"}, {"op": "nope"}):
            body = msgpack.packb(request)
            sock.send_multipart([sign(SECRET, body), body])
            assert sock.poll(2000)
            tag, reply_body = sock.recv_multipart()
            assert verify(SECRET, tag, reply_body)
            reply = msgpack.unpackb(reply_body)
            assert reply["ok"] is False and reply["error"]
        sock.close()
    finally:
        ctx.term()


@pytest.mark.timeout(10)
def test_close_is_prompt_and_idempotent():
    server = RendezvousServer(size=2, secret=SECRET)
    start = time.monotonic()
    server.close()
    server.close()
    assert time.monotonic() - start < 1.0
    assert "closed" in repr(server)
    # The port is free again.
    with socket.socket() as s:
        s.bind(("127.0.0.1", server.port))


@pytest.mark.timeout(10)
def test_fixed_port_and_bind_error_names_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with RendezvousServer(size=1, secret=SECRET, port=port) as server:
        assert server.port == port
        with pytest.raises(RendezvousError, match=f"127.0.0.1:{port}"):
            RendezvousServer(size=1, secret=SECRET, port=port)


@pytest.mark.timeout(10)
def test_constructor_validates_arguments():
    with pytest.raises(ValueError):
        RendezvousServer(size=0, secret=SECRET)
    with pytest.raises(ValueError):
        RendezvousServer(size=2, secret=b"")


def _stranger_sends(address: str, frames: list[bytes], setup) -> int:
    """Connect a DEALER prepared by ``setup(sock)``, send ``frames``; returns the handshake's outcome event."""
    from zmq.utils.monitor import recv_monitor_message

    outcome = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | \
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        setup(sock)
        mon = sock.get_monitor_socket(outcome)
        sock.connect(address)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)  # queued until the handshake decides
        except zmq.Again:
            pass  # the handshake already failed and ZeroMQ dropped the connection's queue: nothing goes out
        assert mon.poll(5000), "no handshake outcome within 5 s"
        event = recv_monitor_message(mon)["event"]
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        return event
    finally:
        ctx.destroy(0)  # closes whatever a failed assertion left open, so this cannot hang


def _curve_random_keys(sock: zmq.Socket) -> None:
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()[0], public, secret


@pytest.mark.timeout(20)
def test_a_stranger_without_the_secret_is_refused_at_the_handshake(caplog):
    """Even a correctly signed message (say, a replayed one) is not acted upon over an unauthenticated connection."""
    caplog.set_level(logging.DEBUG, logger="ringcomm.net.auth")
    body = msgpack.packb({"op": "register", "round": 0, "rank": 0, "size": 2, "info": {"evil": True}})
    signed = [sign(SECRET, body), body]
    with RendezvousServer(size=2, secret=SECRET) as server:
        strangers = {
            "no security (NULL)": lambda sock: None,
            "PLAIN, another job's password": lambda sock: credentials(b"another job's secret").apply_client(sock),
            "PLAIN, a made-up password": lambda sock: (setattr(sock, "plain_username", b"ringcomm"),
                                                       setattr(sock, "plain_password", b"guess")),
        }
        if zmq.has("curve"):
            strangers["CURVE, random keys"] = _curve_random_keys
        for name, setup in strangers.items():
            event = _stranger_sends(server.address, signed, setup)
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, name
        time.sleep(0.2)
        assert server.open_rounds() == []  # not one of the signed registrations was acted upon
        assert server.refused_connections == 2  # the two PLAIN ones reached the ZAP handler
        refused = [r.getMessage() for r in caplog.records if r.name == "ringcomm.net.auth"]
        assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "ringcomm.net.auth")
        assert sum("rendezvous: refused a PLAIN connection from 127.0.0.1: wrong password" in m for m in refused) == 2
        # the same signed frames over an authenticated connection are acted upon: the gate was the handshake
        assert _stranger_sends(server.address, signed, credentials(SECRET).apply_client) == \
            zmq.EVENT_HANDSHAKE_SUCCEEDED
        deadline = time.monotonic() + 2
        while server.open_rounds() != [0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.registrations(0) == {0: {"evil": True}}


@pytest.mark.timeout(10)
def test_a_client_with_the_wrong_secret_times_out_promptly_and_says_why():
    with RendezvousServer(size=2, secret=SECRET) as server:
        start = time.monotonic()
        with pytest.raises(RendezvousTimeoutError, match="did not answer at all.*RINGCOMM_SECRET"):
            register(server.address, b"wrong", 0, 2, {}, 1.5)  # re-sends after the refusal never block
        with pytest.raises(RendezvousTimeoutError):
            kv_get(server.address, b"wrong", "k", 0.3)
        assert time.monotonic() - start < 4.0
        assert server.refused_connections >= 2


# -- fuzzing: the rendezvous decoder and the server's request handling -------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ringcomm.net import rendezvous_client  # noqa: E402

_leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
           | st.binary(max_size=6))
_values = st.recursive(_leaves, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                       max_leaves=10)


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=64), max_size=4), _values)
def test_decoder_returns_a_map_or_none_for_any_frames(frames: list[bytes], obj: object) -> None:
    """Arbitrary frames, and authenticated msgpack of any structure: a dict or None, never an exception."""
    for candidate in (frames, [sign(SECRET, f) for f in frames[:1]] + frames[1:2],
                      [sign(SECRET, b := msgpack.packb(obj)), b]):
        got = rendezvous_client.decode(SECRET, candidate, "fuzz")
        assert got is None or isinstance(got, dict)


@pytest.fixture(scope="module")
def fuzz_target():
    with RendezvousServer(size=2, secret=SECRET) as server:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        credentials(SECRET).apply_client(sock)
        sock.connect(server.address)
        yield server, sock
        sock.close()
        ctx.term()


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(op=st.sampled_from(["register", "set", "get", "status", "nonsense"]) | _values,
       fields=st.dictionaries(st.sampled_from(["round", "rank", "size", "info", "key", "value", "wait"]), _values))
def test_authenticated_requests_with_fields_of_any_type_never_break_the_server(fuzz_target, caplog, op, fields) -> None:
    """Every field of every request with values of any type: refused or served, never an internal
    error, and the server keeps answering."""
    server, sock = fuzz_target
    caplog.set_level(logging.DEBUG, logger="ringcomm.net.rendezvous")
    if isinstance(fields.get("wait"), (int, float)):
        fields["wait"] = min(fields["wait"], 0.2) if fields["wait"] == fields["wait"] else 0.2
    sock.send_multipart(rendezvous_client.encode(SECRET, {"op": op, **fields}))
    sock.send_multipart(rendezvous_client.encode(SECRET, {"op": "status", "round": 99}))
    deadline = time.monotonic() + 5
    while True:  # the status reply proves the request before it was handled and the server lives
        assert sock.poll(max(0.0, deadline - time.monotonic()) * 1000), "the server stopped answering"
        reply = rendezvous_client.decode(SECRET, sock.recv_multipart(), "server")
        if reply and reply.get("op") == "status" and reply.get("size") == 2:
            break
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_waiting_line_names_the_missing_ranks() -> None:
    from ringcomm.net.rendezvous import waiting_line

    assert waiting_line([0, 1], 4, 10.2, 60) == "waiting for ranks 2, 3 (10 s of 60)"
    assert waiting_line([0, 2], 3, 5, 60.0) == "waiting for rank 1 (5 s of 60)"
    assert waiting_line([0, 1, 2], 3, 5, 60) == ""
    assert waiting_line([0], 40, 5, 60).endswith("16, ... (5 s of 60)")


@pytest.mark.timeout(30)
def test_rank_0_reports_who_is_missing_while_it_waits() -> None:
    secret = b"progress"
    lines: list[str] = []
    with RendezvousServer(size=3, secret=secret) as server:
        def rank_1() -> None:
            with pytest.raises(RendezvousTimeoutError):  # rank 2 never comes
                register(server.address, secret, 1, 3, {"r": 1}, 3.0)

        t = threading.Thread(target=rank_1, daemon=True)
        t.start()
        with pytest.raises(RendezvousTimeoutError, match="missing: 2"):
            register(server.address, secret, 0, 3, {"r": 0}, 2.0, progress=lines.append, progress_every=0.4)
        t.join(10)
    assert lines and all(line.startswith("waiting for rank 2 (") and line.endswith(" of 2)") for line in lines), lines
    assert len(lines) >= 2, lines


@pytest.mark.timeout(30)
def test_a_taken_port_names_ringcomm_rendezvous_port() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"127.0.0.1:{port}: Address already in use .* -- .*"
                                                  "set RINGCOMM_RENDEZVOUS_PORT to a free port"):
            RendezvousServer(size=2, secret=b"k", port=port)
