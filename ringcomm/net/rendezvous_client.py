"""The rendezvous' wire format and its client calls: :func:`register`, :func:`kv_set`, :func:`kv_get`.

Every message both ways is two ZeroMQ frames, ``[tag, body]`` with ``body =
msgpack(dict)`` and ``tag = HMAC-SHA256(secret, body)``; :func:`decode` checks
the tag before it unpacks anything and drops what fails.  The requests and their
replies, and the server that answers them, are in :mod:`ringcomm.net.rendezvous`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import msgpack
import zmq

from .auth import Credentials
from ..errors import InvalidTypeError, RendezvousAbortedError, RendezvousError, RendezvousTimeoutError

__all__ = ["register", "kv_set", "kv_get", "report_lost", "lost_reports", "LOST_KEY_PREFIX", "sign", "verify", "encode", "decode", "is_int", "credentials",
           "waiting_line", "MAX_MESSAGE_BYTES", "CREDENTIALS_LABEL"]

log = logging.getLogger("ringcomm.net.rendezvous")

#: Larger messages are refused by ZeroMQ before they are buffered (guards against junk peers).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Extra time a client waits for an answer beyond the server-side wait, for the network.
_REPLY_GRACE_SECONDS = 0.5
#: How long a timed-out ``register`` asks the server who did arrive, for the error message.
_STATUS_PROBE_SECONDS = 0.3
#: The label the rendezvous credentials are derived under (:meth:`Credentials.derive`).
CREDENTIALS_LABEL = "rendezvous"

_FIX_HINT = "Start every rank, or raise RINGCOMM_START_TIMEOUT / ringcomm-run --start-timeout."


def credentials(secret: bytes) -> Credentials:
    """What a rendezvous connection must prove: PLAIN, with a password derived from ``secret``."""
    return Credentials.derive(secret, CREDENTIALS_LABEL)


# --------------------------------------------------------------------------- message codec


def sign(secret: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 tag of ``body`` under the job's ``secret`` (32 bytes)."""
    return hmac.new(secret, body, hashlib.sha256).digest()


def verify(secret: bytes, tag: bytes, body: bytes) -> bool:
    """True when ``tag`` authenticates ``body`` under ``secret`` (constant-time compare)."""
    return hmac.compare_digest(sign(secret, body), tag)


def encode(secret: bytes, message: dict[str, Any]) -> list[bytes]:
    """The two frames ``[tag, body]`` of ``message``."""
    body = msgpack.packb(message, use_bin_type=True)
    return [sign(secret, body), body]


def decode(secret: bytes, frames: list[bytes], peer: str) -> dict[str, Any] | None:
    """Authenticate and unpack ``[tag, body]``; ``None`` (logged at DEBUG) for anything else."""
    if len(frames) != 2:
        log.debug("dropped a message from %s: %d frames, expected 2 [tag, body]", peer, len(frames))
        return None
    tag, body = frames
    if not verify(secret, tag, body):
        log.debug("dropped a message from %s: bad HMAC tag (wrong secret or corrupted)", peer)
        return None
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on junk
        log.debug("dropped an authenticated message from %s that is not msgpack: %s", peer, exc)
        return None
    if not isinstance(message, dict):
        log.debug("dropped a message from %s: body is %s, not a map", peer, type(message).__name__)
        return None
    return message


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- server


# --------------------------------------------------------------------------- client


class _Client:
    """One DEALER socket for one request, closed with linger 0 on every path."""

    def __init__(self, address: str, secret: bytes) -> None:
        self.address = address
        self.secret = bytes(secret)
        creds = credentials(self.secret)  # raises for an empty secret, before anything is opened
        self.context = zmq.Context()
        try:
            self.socket = self.context.socket(zmq.DEALER)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            creds.apply_client(self.socket)
            if address.startswith("tcp://["):
                self.socket.setsockopt(zmq.IPV6, 1)
            self.socket.connect(address)
        except zmq.ZMQError as exc:
            self.context.destroy(linger=0)
            raise RendezvousError(f"cannot connect to the rendezvous at {address!r}: {exc}") from exc

    def send(self, message: dict[str, Any]) -> None:
        """Queue ``message``; never blocks (a server that refused this connection leaves it nowhere to go)."""
        try:
            self.socket.send_multipart(encode(self.secret, message), zmq.NOBLOCK)
        except zmq.Again:
            # the handshake failed -- the server does not know this secret -- and ZeroMQ dropped the
            # connection: the caller times out and says so
            log.debug("the rendezvous at %s has no connection for us; message not sent", self.address)

    def recv(self, deadline: float, *ops: str) -> dict[str, Any] | None:
        """The next authenticated reply to one of ``ops`` before ``deadline`` (monotonic), or ``None``."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.socket.poll(int(remaining * 1000), zmq.POLLIN):
                return None
            reply = decode(self.secret, self.socket.recv_multipart(), self.address)
            if reply is not None and reply.get("op") in ops:
                return reply

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()

    def __enter__(self) -> "_Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check(reply: dict[str, Any], address: str) -> dict[str, Any]:
    if not reply.get("ok") and reply.get("aborted"):
        raise RendezvousAbortedError(f"the rendezvous at {address} was called off: {reply.get('error')}")
    if not reply.get("ok"):
        raise RendezvousError(f"the rendezvous at {address} refused the request: {reply.get('error')}")
    return reply


_RESEND_SECONDS = 1.0


def register(
    address: str,
    secret: bytes,
    rank: int,
    size: int,
    info: dict,
    timeout: float,
    round: int = 0,  # noqa: A002 - the protocol's name for it
    progress: Callable[[str], None] | None = None,
    progress_every: float = 5.0,
) -> list[dict]:
    """Announce this rank's ``info`` and wait for every rank's: returns ``[info_0, ..., info_{size-1}]``.

    ``progress`` (rank 0 prints it) is called every ``progress_every`` s of
    waiting with :func:`waiting_line`'s report of who is missing.

    Raises :class:`RendezvousTimeoutError` when not every rank arrived within
    ``timeout`` seconds (the message says which ranks did), and
    :class:`RendezvousError` when the server refuses (size mismatch, rank out
    of range, the rank registered twice with different info).

    Example:
        >>> register(addr, secret, rank, 2, {"host": "a", "port": 5000 + rank}, timeout=60.0)
        [{'host': 'a', 'port': 5000}, {'host': 'a', 'port': 5001}]   # on both ranks
    """
    request = {"op": "register", "round": round, "rank": rank, "size": size, "info": info}
    with _Client(address, secret) as client:
        start = time.monotonic()
        deadline, next_report = start + timeout, start + progress_every
        reply = None
        wait = 0.1
        while reply is None and time.monotonic() < deadline:
            # Re-sent every second (the server treats a repeat as a retry): a request that reached
            # a server which then closed -- rank 0 re-hosting the rendezvous after shutdown() and
            # init() under torchrun -- is not lost.
            client.send(request)
            reply = client.recv(min(deadline, time.monotonic() + wait), "register", "status")
            if reply is not None and reply.get("op") == "status":  # rank 0's report of who is missing
                line = waiting_line(reply.get("arrived", []), size, time.monotonic() - start, timeout)
                if progress is not None and line:
                    progress(line)
                reply = None
            elif progress is not None and reply is None and time.monotonic() >= next_report:
                client.send({"op": "status", "round": round})
                next_report += progress_every
            wait = min(_RESEND_SECONDS, wait * 2)
        if reply is None:
            # Ask who did arrive, for the message; the table may still come in meanwhile.
            client.send({"op": "status", "round": round})
            got = client.recv(time.monotonic() + _STATUS_PROBE_SECONDS, "register", "status")
            if got is not None and got.get("op") == "register":
                reply = got
            else:
                raise RendezvousTimeoutError(_timeout_message(address, rank, size, round, timeout, got))
        table = _check(reply, address).get("table")
        if not isinstance(table, list) or len(table) != size or not all(isinstance(t, dict) for t in table):
            raise RendezvousError(
                f"the rendezvous at {address} answered with a malformed table (expected {size} entries): "
                "is another program listening on that port with the same secret?"
            )
        return table


def _missing(arrived: list[Any], size: int) -> tuple[int, str]:
    """How many of ``size`` ranks are not in ``arrived``, and the first 16 of them as text."""
    have = {r for r in arrived if is_int(r)}
    missing = [r for r in range(size) if r not in have]
    return len(missing), ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")


def waiting_line(arrived: list[Any], size: int, elapsed: float, timeout: float) -> str:
    """``"waiting for ranks 2, 3 (10 s of 60)"``, or "" when nobody is missing."""
    count, shown = _missing(arrived, size)
    noun = "rank" if count == 1 else "ranks"
    return f"waiting for {noun} {shown} ({elapsed:.0f} s of {timeout:.0f})" if count else ""


def _timeout_message(
    address: str, rank: int, size: int, rnd: int, timeout: float, status: dict[str, Any] | None
) -> str:
    if status is None or not status.get("ok"):
        detail = (
            " (the rendezvous did not answer at all: is the launcher still running, and does every "
            "rank have the launcher's RINGCOMM_SECRET?)"
        )
    else:
        count, shown = _missing(status.get("arrived", []), size)
        detail = f" ({size - count} of {size} ranks registered; missing: {shown})" if count else ""
    return (
        f"rank {rank} timed out after {float(timeout):.1f} s waiting for the rendezvous at {address} "
        f"(round {rnd}): the other ranks did not all arrive{detail}. {_FIX_HINT}"
    )


#: Store keys under which ranks tell the launcher which rank the job lost: ``<prefix><reporting rank>``.
LOST_KEY_PREFIX = "job/lost-by/"


def report_lost(address: str, secret: bytes, reporter: int, lost: int, timeout: float) -> None:
    """Tell the rendezvous (``ringcomm-run``'s) that rank ``reporter`` lost rank ``lost`` (read by :func:`lost_reports`)."""
    kv_set(address, secret, f"{LOST_KEY_PREFIX}{int(reporter)}", str(int(lost)).encode(), timeout)


def lost_reports(store: Mapping[str, bytes]) -> dict[int, int]:
    """reporting rank -> the rank it lost, from a rendezvous store's ``LOST_KEY_PREFIX`` keys (others ignored)."""
    found = {}
    for key, value in store.items():
        reporter = key[len(LOST_KEY_PREFIX):] if key.startswith(LOST_KEY_PREFIX) else ""
        if reporter.isdigit() and bytes(value).isdigit():
            found[int(reporter)] = int(bytes(value))
    return found


def kv_set(address: str, secret: bytes, key: str, value: bytes, timeout: float) -> None:
    """Store ``value`` under ``key`` on the rendezvous server (overwrites)."""
    if not isinstance(key, str) or not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(
            f"kv_set needs a str key and a bytes value, got {type(key).__name__} and {type(value).__name__}"
        )
    with _Client(address, secret) as client:
        client.send({"op": "set", "key": key, "value": bytes(value)})
        reply = client.recv(time.monotonic() + timeout, "set")
        if reply is None:
            raise RendezvousTimeoutError(
                f"the rendezvous at {address} did not answer a set of {key!r} within {float(timeout):.1f} s"
            )
        _check(reply, address)


def kv_get(address: str, secret: bytes, key: str, timeout: float) -> bytes:
    """The value under ``key``, waiting up to ``timeout`` seconds for some rank to set it."""
    with _Client(address, secret) as client:
        client.send({"op": "get", "key": key, "wait": float(timeout)})
        reply = client.recv(time.monotonic() + timeout + _REPLY_GRACE_SECONDS, "get")
        if reply is None:
            raise RendezvousTimeoutError(
                f"the rendezvous at {address} did not answer a get of {key!r} within {float(timeout):.1f} s"
            )
        if not reply.get("ok") and reply.get("error") == "timeout":
            raise RendezvousTimeoutError(
                f"key {key!r} was not set at the rendezvous at {address} within {float(timeout):.1f} s"
            )
        return bytes(_check(reply, address)["value"])
