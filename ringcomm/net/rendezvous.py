"""Authenticated key-value rendezvous: how the ranks of a job find each other.

One process (the launcher, or rank 0 when the job was started by hand) runs a
:class:`RendezvousServer`; every rank calls :func:`register` with its own
endpoints and gets back the table of all ranks, in rank order.

Wire format (ZeroMQ, DEALER client -> ROUTER server), every message both ways
is two frames::

    [tag, body]    body = msgpack(dict)    tag = HMAC-SHA256(secret, body)

Two layers keep strangers out.  The connection itself is authenticated at
the ZeroMQ handshake (PLAIN with a password derived from the secret, checked
by the server's ZAP handler, :mod:`.auth`): a peer without the secret is
refused before any of its messages reach the server (logged at DEBUG on
``ringcomm.net.auth``).  Then every message's tag is checked with
:func:`hmac.compare_digest` *before* the body is unpacked; anything
unauthenticated or unparseable is dropped (logged at DEBUG on
``ringcomm.net.rendezvous``).  Bodies are msgpack only -- nothing is ever
unpickled.  The rendezvous carries endpoints, host names and process ids,
never tensor data, so it stays PLAIN under ``RINGCOMM_ENCRYPT`` (its server
may be the launcher, which has no job settings).  Requests and their replies:

=============================================  ==========================================
request                                        reply
=============================================  ==========================================
``{op: "register", round, rank, size, info}``  ``{ok: True, table: [info_0, ...]}`` once
                                               all ``size`` ranks of ``round`` arrived
``{op: "set", key, value: bytes}``             ``{ok: True}``
``{op: "get", key, wait: float}``              ``{ok: True, value}``, or
                                               ``{ok: False, error: "timeout"}`` after ``wait`` s
``{op: "status", round}``                      ``{ok: True, size, arrived: [ranks]}``
=============================================  ==========================================

Every reply also carries ``op`` (the request's op); errors are
``{ok: False, error: "..."}``.

Example (two ranks, each in its own process)::

    >>> server = RendezvousServer(size=2, secret=b"k")           # launcher
    >>> register(server.address, b"k", rank, 2, {"ep": my_ep}, timeout=60.0)
    [{'ep': 'tcp://...rank 0...'}, {'ep': 'tcp://...rank 1...'}]   # on both ranks
"""


from __future__ import annotations

import collections
import errno
import logging
import threading
import time
from typing import Any

import zmq

from .auth import ZapHandler
from .ports import bind_zmq
from ..errors import RendezvousError
from ..job.ports import PortRange
from .rendezvous_client import (
    MAX_MESSAGE_BYTES,
    credentials,
    decode,
    encode,
    is_int,
    kv_get,
    kv_set,
    lost_reports,
    register,
    sign,
    verify,
    waiting_line,
)

__all__ = [
    "RendezvousServer",
    "register",
    "kv_set",
    "kv_get",
    "sign",
    "verify",
    "credentials",
    "MAX_MESSAGE_BYTES",
    "waiting_line",
]

log = logging.getLogger("ringcomm.net.rendezvous")

#: Completed rounds whose table is kept, so that a late retry of a registration still gets it.
_COMPLETED_ROUNDS_KEPT = 8
#: Longest the server thread sleeps between checks of ``close()`` and pending-get deadlines.
_POLL_SECONDS = 0.05


class _Round:
    """Registrations received so far for one round: each rank's routing id and info."""

    def __init__(self) -> None:
        self.routes: dict[int, bytes] = {}
        self.infos: dict[int, dict[str, Any]] = {}


class RendezvousServer:
    """Collects every rank's info and hands each the full table; also a tiny key-value store.

    Binds a ROUTER socket on ``tcp://host:port`` (``port=0``: a free port, one of ``ports`` if given) in
    the constructor and serves it from a daemon thread with its own ZeroMQ
    context.  ``close()`` (idempotent; also ``with RendezvousServer(...)``)
    stops the thread within about 50 ms.

    Example:
        >>> with RendezvousServer(size=4, secret=secret) as server:
        ...     spawn_workers(env={"RINGCOMM_RENDEZVOUS_ADDR": server.address})
    """

    def __init__(self, size: int, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 ports: PortRange | None = None) -> None:
        if not is_int(size) or size < 1:
            raise ValueError(f"RendezvousServer size must be an int >= 1, got {size!r}")
        if not isinstance(secret, (bytes, bytearray)) or not secret:
            raise ValueError("RendezvousServer secret must be non-empty bytes")
        self._size = size
        self._secret = bytes(secret)
        self._context = zmq.Context()
        creds = credentials(self._secret)
        # answered by the server thread's own poll loop, which never blocks for long
        self._zap = ZapHandler(self._context, creds, "rendezvous")
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        creds.apply_server(self._socket)
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        bracketed = f"[{host}]" if ":" in host else host
        try:
            if port:
                self._socket.bind(f"tcp://{bracketed}:{port}")
                endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            else:  # a free port: any, or one of ``ports``
                endpoint = bind_zmq(self._socket, host, ports, "the rendezvous")
            self._port = int(endpoint.rpartition(":")[2])
        except (zmq.ZMQError, RendezvousError) as exc:
            self._socket.close(0)
            self._zap.close()
            self._context.term()
            if isinstance(exc, RendezvousError):
                raise
            hint = (" -- another process holds that port (a second job on this host, or torchrun's store next "
                    "to it); set RINGCOMM_RENDEZVOUS_PORT to a free port, the same on every rank"
                    ) if exc.errno == errno.EADDRINUSE else ""
            raise RendezvousError(f"cannot bind the rendezvous to tcp://{bracketed}:{port}: {exc}{hint}") from exc
        self._address = f"tcp://{bracketed}:{self._port}"
        self._lock = threading.Lock()  # guards the state below against readers in other threads
        self._rounds: dict[int, _Round] = {}
        self._completed: collections.OrderedDict[int, list[dict[str, Any]]] = collections.OrderedDict()
        self._store: dict[str, bytes] = {}
        self._pending_gets: list[tuple[bytes, str, float]] = []
        self._aborted: str | None = None
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="ringcomm-rendezvous", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public surface

    @property
    def address(self) -> str:
        """``tcp://host:port`` that clients connect to."""
        return self._address

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        return self._port

    @property
    def size(self) -> int:
        """Number of ranks each round waits for."""
        return self._size

    def open_rounds(self) -> list[int]:
        """Rounds that have registrations but are not complete yet."""
        with self._lock:
            return sorted(self._rounds)

    def registrations(self, round: int = 0) -> dict[int, dict[str, Any]]:  # noqa: A002 - the protocol's name
        """rank -> info of the ranks registered so far in an open ``round`` (a copy; ``{}`` once complete).

        For tests and debugging: what each rank published, e.g. its endpoints, before the table is out.
        """
        with self._lock:
            state = self._rounds.get(round)
            return {r: dict(info) for r, info in state.infos.items()} if state else {}

    def lost_reports(self) -> dict[int, int]:
        """reporting rank -> the rank it lost, as the ranks told the server (:func:`report_lost`)."""
        with self._lock:
            return lost_reports(self._store)

    @property
    def refused_connections(self) -> int:
        """Connections refused at the handshake so far (peers without the job's secret)."""
        return self._zap.refused

    def abort(self, reason: str) -> None:
        """Refuse every round not complete yet, now and later, with ``reason``: ranks waiting in
        :func:`register` get :class:`RendezvousAbortedError` at once instead of waiting out their timeout."""
        with self._lock:
            self._aborted = reason

    def close(self) -> None:
        """Stop the server thread and release the socket; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._context.term()

    def __enter__(self) -> "RendezvousServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"<RendezvousServer {self._address} size={self._size} {state}>"

    # ------------------------------------------------------------------ server thread

    def _serve(self) -> None:
        sock = self._socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._zap.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                timeout = _POLL_SECONDS
                if self._pending_gets:
                    soonest = min(deadline for _, _, deadline in self._pending_gets)
                    timeout = max(0.0, min(timeout, soonest - time.monotonic()))
                events = dict(poller.poll(int(timeout * 1000)))
                if self._zap.socket in events:
                    self._zap.handle()  # handshakes of new connections
                if sock in events:
                    # Drain everything queued before checking deadlines again.
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle_frames(frames)
                self._expire_gets()
                if self._aborted is not None and self._rounds:
                    self._refuse_open_rounds()
        except Exception:  # pragma: no cover - a bug, not a peer's fault; never silent
            log.exception("rendezvous server at %s stopped on an internal error", self._address)
        finally:
            sock.close(0)
            self._zap.close()

    def _handle_frames(self, frames: list[bytes]) -> None:
        """Route one received multipart message; never raises for a peer's misbehaviour."""
        if len(frames) < 1:
            return
        route, payload = frames[0], frames[1:]
        peer = route.hex()
        message = decode(self._secret, payload, peer)
        if message is None:
            return
        op = message.get("op")
        try:
            if op == "register":
                self._on_register(route, message)
            elif op == "set":
                self._on_set(route, message)
            elif op == "get":
                self._on_get(route, message)
            elif op == "status":
                self._on_status(route, message)
            else:
                self._reply(route, {"op": op, "ok": False, "error": f"unknown op {op!r}"})
        except _BadRequest as exc:
            log.debug("refused a %r request from %s: %s", op, peer, exc)
            self._reply(route, {"op": op, "ok": False, "error": str(exc)})
        except Exception:  # a bug or an input nobody foresaw: log it, keep serving the others
            log.exception("rendezvous at %s failed to handle a %r request from %s", self._address, op, peer)

    def _reply(self, route: bytes, message: dict[str, Any]) -> None:
        try:
            self._socket.send_multipart([route, *encode(self._secret, message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will time out on its side
            log.debug("could not answer %s: %s", route.hex(), exc)

    # ------------------------------------------------------------------ ops

    def _on_register(self, route: bytes, msg: dict[str, Any]) -> None:
        rnd, rank, size, info = msg.get("round"), msg.get("rank"), msg.get("size"), msg.get("info")
        if not (is_int(rnd) and is_int(rank) and is_int(size) and isinstance(info, dict)):
            raise _BadRequest("register needs int round, rank, size and a dict info")
        if size != self._size:
            raise _BadRequest(
                f"rank {rank} says the job has {size} ranks but the rendezvous at {self._address} "
                f"was started for {self._size}: start every rank with the same RINGCOMM_SIZE / -np"
            )
        if not 0 <= rank < self._size:
            raise _BadRequest(f"rank {rank} is out of range for a job of {self._size} ranks (0..{self._size - 1})")
        with self._lock:
            done_table = self._completed.get(rnd)
            if done_table is not None:
                if done_table[rank] == info:  # a late retry of a rank that already got its table
                    self._reply(route, {"op": "register", "ok": True, "table": done_table})
                    return
                raise _BadRequest(
                    f"round {rnd} of this job already completed, and rank {rank} registered with other "
                    f"info then; each init() after a shutdown() must use the next round"
                )
            if self._aborted is not None:
                self._rounds.setdefault(rnd, _Round()).routes[rank] = route  # answered by the serving loop
                return
            state = self._rounds.setdefault(rnd, _Round())
            previous = state.infos.get(rank)
            if previous is not None and previous != info:
                raise _BadRequest(
                    f"rank {rank} is already registered in round {rnd} with different info "
                    f"({previous!r} vs {info!r}); were two processes started with RINGCOMM_RANK={rank}?"
                )
            state.routes[rank] = route  # a re-send of the same registration is a retry: newest route wins
            state.infos[rank] = info
            if len(state.infos) < self._size:
                return
            table = [state.infos[r] for r in range(self._size)]
            del self._rounds[rnd]
            self._completed[rnd] = table
            while len(self._completed) > _COMPLETED_ROUNDS_KEPT:
                self._completed.popitem(last=False)
        log.debug("round %d complete: sending the table to %d ranks", rnd, self._size)
        for r in range(self._size):
            self._reply(state.routes[r], {"op": "register", "ok": True, "table": table})

    def _refuse_open_rounds(self) -> None:
        with self._lock:
            routes = [route for state in self._rounds.values() for route in state.routes.values()]
            self._rounds.clear()
        for route in routes:
            self._reply(route, {"op": "register", "ok": False, "aborted": True, "error": self._aborted})

    def _on_status(self, route: bytes, msg: dict[str, Any]) -> None:
        rnd = msg.get("round")
        if not is_int(rnd):
            raise _BadRequest("status needs an int round")
        with self._lock:
            if rnd in self._completed:
                arrived = list(range(self._size))
            else:
                state = self._rounds.get(rnd)
                arrived = sorted(state.infos) if state else []
        self._reply(route, {"op": "status", "ok": True, "size": self._size, "arrived": arrived})

    def _on_set(self, route: bytes, msg: dict[str, Any]) -> None:
        key, value = msg.get("key"), msg.get("value")
        if not isinstance(key, str) or not isinstance(value, bytes):
            raise _BadRequest("set needs a str key and a bytes value")
        with self._lock:
            self._store[key] = value
        self._reply(route, {"op": "set", "ok": True})
        still_waiting = []
        for waiter, wanted, deadline in self._pending_gets:
            if wanted == key:
                self._reply(waiter, {"op": "get", "ok": True, "value": value})
            else:
                still_waiting.append((waiter, wanted, deadline))
        self._pending_gets = still_waiting

    def _on_get(self, route: bytes, msg: dict[str, Any]) -> None:
        key, wait = msg.get("key"), msg.get("wait", 0.0)
        if not isinstance(key, str) or not isinstance(wait, (int, float)) or isinstance(wait, bool):
            raise _BadRequest("get needs a str key and a number wait")
        with self._lock:
            value = self._store.get(key)
        if value is not None:
            self._reply(route, {"op": "get", "ok": True, "value": value})
        elif wait <= 0:
            self._reply(route, {"op": "get", "ok": False, "error": "timeout"})
        else:
            self._pending_gets.append((route, key, time.monotonic() + float(wait)))

    def _expire_gets(self) -> None:
        if not self._pending_gets:
            return
        now = time.monotonic()
        still_waiting = []
        for waiter, key, deadline in self._pending_gets:
            if deadline <= now:
                self._reply(waiter, {"op": "get", "ok": False, "error": "timeout"})
            else:
                still_waiting.append((waiter, key, deadline))
        self._pending_gets = still_waiting


class _BadRequest(Exception):
    """An authenticated request the server refuses; its text goes back to the client."""


