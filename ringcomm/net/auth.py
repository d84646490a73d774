"""Connection authentication: credentials derived from the job secret, and the ZAP handler that checks them.

Every socket a ringcomm process binds (the data plane's PAIR sockets, rank 0's
control ROUTER, the rendezvous ROUTER) is a ZeroMQ security *server*; every
socket that connects is a *client* holding credentials derived from the job's
secret.  During the ZMTP handshake ZeroMQ asks the context's ZAP handler
(RFC 27, ``inproc://zeromq.zap.01``) whether to let the peer in, and only
then attaches the connection to the socket.  A refused peer therefore never
takes a PAIR socket's single slot, and not one byte it sends reaches ringcomm.
Without a ZAP handler bound, ZeroMQ refuses PLAIN peers outright, so a socket
is never open by accident.

Two mechanisms (:meth:`Credentials.derive`):

``PLAIN`` (the default)
    The client sends user ``ringcomm`` and a password, HMAC-SHA256(secret,
    label); the handler compares it in constant time.  Proves that the peer
    holds the job secret; costs nothing per message; the password crosses the
    network in the clear (see the threat model in docs/design/security.md).
``CURVE`` (``RINGCOMM_ENCRYPT=1``)
    One server and one client Curve25519 key pair, their secret keys
    HMAC-SHA256(secret, label) (any 32 bytes are a valid Curve25519 secret
    key).  The client must know the server's public key and the handler
    admits only the derived client key, so both ends prove they hold the
    secret; every message is encrypted and authenticated (libsodium).

Example (one process; the server thread answers the handshakes)::

    >>> creds = Credentials.derive(secret, "job")
    >>> zap = ZapThread(ctx, creds, "rank 0")       # before any bind
    >>> creds.apply_server(server_sock); server_sock.bind(...)
    >>> creds.apply_client(client_sock); client_sock.connect(...)   # in every other rank
    >>> zap.stop()                                   # before ctx.term()
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import threading

import zmq
from zmq.utils import z85

from ..errors import InvalidInputError

__all__ = ["Credentials", "ZapHandler", "ZapThread", "ZAP_ENDPOINT", "curve_available"]

log = logging.getLogger("ringcomm.net.auth")

#: Where ZeroMQ sends its authentication requests (RFC 27); one handler per context.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: The PLAIN user name; only the password carries the proof.
USERNAME = b"ringcomm"
_ZAP_VERSION = b"1.0"


def curve_available() -> bool:
    """Whether this libzmq can encrypt (CURVE needs libsodium or its built-in tweetnacl)."""
    return bool(zmq.has("curve"))


def _derive(secret: bytes, label: str, what: str) -> bytes:
    """32 bytes of key material for ``label``/``what``, independent of every other label's."""
    return hmac.digest(secret, f"ringcomm/v1/{label}/{what}".encode(), hashlib.sha256)


@dataclasses.dataclass(frozen=True)
class Credentials:
    """What a ringcomm socket proves, or checks, at connection time.

    Build with :meth:`derive`; every process of the job derives the same
    credentials from the same secret.  Key material is left out of ``repr``.
    """

    mechanism: str  # "PLAIN" or "CURVE"
    label: str
    password: bytes = dataclasses.field(default=b"", repr=False)
    server_public: bytes = b""  # z85, 40 characters
    server_secret: bytes = dataclasses.field(default=b"", repr=False)
    client_public: bytes = b""
    client_secret: bytes = dataclasses.field(default=b"", repr=False)

    @classmethod
    def derive(cls, secret: bytes, label: str, encrypt: bool = False) -> "Credentials":
        """The job's credentials for ``label`` (``"job"``: data and control; ``"rendezvous"``).

        Raises :class:`InvalidInputError` for an empty secret, or when
        ``encrypt`` is asked for and this libzmq has no CURVE.

        Example:
            >>> Credentials.derive(bytes.fromhex(os.environ["RINGCOMM_SECRET"]), "job").mechanism
            'PLAIN'
        """
        if not secret:
            raise InvalidInputError(
                "the job secret is empty: every rank of a multi-rank job needs the same RINGCOMM_SECRET "
                "(hex; ringcomm-run sets it, under torchrun set it yourself or let ringcomm derive one)"
            )
        if not encrypt:
            return cls("PLAIN", label, password=_derive(secret, label, "plain-password").hex().encode())
        if not curve_available():
            raise InvalidInputError(
                f"RINGCOMM_ENCRYPT=1 needs ZeroMQ with CURVE encryption, but this libzmq "
                f"{zmq.zmq_version()} was built without it (zmq.has('curve') is False). Install a pyzmq "
                f"wheel (they bundle libzmq with libsodium), or unset RINGCOMM_ENCRYPT."
            )
        server_secret = z85.encode(_derive(secret, label, "curve-server"))
        client_secret = z85.encode(_derive(secret, label, "curve-client"))
        return cls(
            "CURVE", label,
            server_public=zmq.curve_public(server_secret), server_secret=server_secret,
            client_public=zmq.curve_public(client_secret), client_secret=client_secret,
        )

    @property
    def encrypted(self) -> bool:
        return self.mechanism == "CURVE"

    def apply_server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``bind``) authenticate every peer through the context's ZAP handler."""
        if self.encrypted:
            sock.curve_server = True
            sock.curve_secretkey = self.server_secret
            sock.curve_publickey = self.server_public
        else:
            sock.plain_server = True

    def apply_client(self, sock: zmq.Socket) -> None:
        """Give ``sock`` (before ``connect``) the credentials the servers check."""
        if self.encrypted:
            sock.curve_serverkey = self.server_public
            sock.curve_publickey = self.client_public
            sock.curve_secretkey = self.client_secret
        else:
            sock.plain_username = USERNAME
            sock.plain_password = self.password

    def refusal(self, mechanism: bytes, credentials: list[bytes]) -> str:
        """Why a peer offering ``credentials`` over ``mechanism`` is refused; ``""`` if it is let in."""
        if mechanism.decode(errors="replace") != self.mechanism:
            return f"mechanism {mechanism.decode(errors='replace') or '?'}, expected {self.mechanism}"
        if self.encrypted:
            if len(credentials) != 1 or not hmac.compare_digest(credentials[0], z85.decode(self.client_public)):
                return "unknown client key (not derived from this job's secret)"
            return ""
        if len(credentials) != 2:
            return f"{len(credentials)} credential frames, expected user and password"
        user, password = credentials
        # both compared, always, in constant time: the reply time says nothing about which was wrong
        ok_user = hmac.compare_digest(user, USERNAME)
        ok_password = hmac.compare_digest(password, self.password)
        if not (ok_user and ok_password):
            return "wrong password (not derived from this job's secret)" if ok_user else "wrong user name"
        return ""


class ZapHandler:
    """The ZAP endpoint of one ZeroMQ context: admits exactly the peers holding ``credentials``.

    Binds ``inproc://zeromq.zap.01`` in the constructor, so create it before
    the context's first server socket binds.  :meth:`handle` answers what is
    pending without blocking; call it when :attr:`socket` is readable, from
    the one thread that owns the handler (:class:`ZapThread`, or a server's
    own poll loop).
    """

    def __init__(self, ctx: zmq.Context, credentials: Credentials, where: str) -> None:
        self.credentials = credentials
        self.where = where
        self.refused = 0  # handshakes refused so far (for tests and debugging)
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self.socket.close(0)
            raise RuntimeError(f"{where}: cannot bind the ZAP handler ({exc}); one per ZeroMQ context") from exc

    def handle(self) -> int:
        """Answer every pending authentication request; returns how many were answered."""
        answered = 0
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            self.socket.send_multipart(self._answer(frames))
            answered += 1

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6 or frames[0] != _ZAP_VERSION:
            request_id = frames[1] if len(frames) > 1 else b""
            log.debug("%s: malformed ZAP request of %d frames refused", self.where, len(frames))
            return [_ZAP_VERSION, request_id, b"400", b"malformed ZAP request", b"", b""]
        _, request_id, _domain, address, _routing_id, mechanism, *credentials = frames
        why = self.credentials.refusal(mechanism, credentials)
        if why:
            self.refused += 1
            log.debug("%s: refused a %s connection from %s: %s", self.where,
                      mechanism.decode(errors="replace"), address.decode(errors="replace") or "a local socket", why)
            return [_ZAP_VERSION, request_id, b"400", why.encode(), b"", b""]
        return [_ZAP_VERSION, request_id, b"200", b"OK", USERNAME, b""]

    def close(self) -> None:
        self.socket.close(0)


class ZapThread:
    """A :class:`ZapHandler` served from its own daemon thread.

    The engine cannot answer handshakes itself: it blocks inside collectives
    (a send to a peer whose connection is still being authenticated would wait
    for itself).  The thread sleeps in ``poll`` with no timeout, so an idle job
    stays idle; :meth:`stop` wakes it through a pipe, joins it and leaves no
    socket or file descriptor behind.
    """

    def __init__(self, ctx: zmq.Context, credentials: Credentials, where: str) -> None:
        self.handler = ZapHandler(ctx, credentials, where)
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name=f"ringcomm-zap ({where})", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.handler.socket, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._stop_r in events:
                    return
                self.handler.handle()
        except zmq.ContextTerminated:  # pragma: no cover - stop() comes first in ringcomm's own shutdown
            pass
        except Exception:  # pragma: no cover - a bug; handshakes would hang: never silent
            log.exception("%s: the ZAP handler stopped on an internal error", self.handler.where)
        finally:
            self.handler.close()

    def stop(self) -> None:
        """Stop the thread and close its socket (before ``ctx.term()``); idempotent."""
        if self._stop_w < 0:
            return
        os.write(self._stop_w, b"x")
        self._thread.join()
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
        self._stop_r = self._stop_w = -1
