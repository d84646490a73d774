"""The proof two ranks exchange on a TCP connection of their own (the lane across hosts, the payload streams).

ZeroMQ's sockets prove the job secret in their own handshake (:mod:`ringcomm.net.auth`).  A
plain TCP connection does it here, before any byte of the job's:

- the connecting rank sends :data:`HELLO`: its rank and an HMAC of the job secret over the
  connection's kind, job, round, the two ranks and ``"hello"``;
- the accepting rank checks it in constant time and closes a connection that proves nothing,
  without an answer; otherwise it answers with the HMAC for ``"answer"``;
- the connecting rank checks the answer, so both ends know the other holds the secret.

Example (both ends derive the same :class:`Proofs` from the job's key)::

    >>> proofs = Proofs(key, "stream", job_id, round_)
    >>> sock.sendall(proofs.hello(rank, rank, peer))          # the connecting rank
    >>> rank_, proof = HELLO.unpack(read_exact(conn, HELLO.size))   # the accepting one
    >>> proofs.holds(proof, rank_, me, "hello")
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import socket
import struct

__all__ = ["HELLO", "PROOF_BYTES", "Proofs", "nodelay", "read_exact", "read_into"]

#: The connecting rank's first message: its rank (uint32) and its proof.
HELLO = struct.Struct("<I32s")
#: Bytes of one proof (HMAC-SHA256).
PROOF_BYTES = 32
_WAITALL = getattr(socket, "MSG_WAITALL", 0)


@dataclasses.dataclass(frozen=True)
class Proofs:
    """The proofs of one kind of connection (``"lane"``, ``"stream"``) in one round of one job.

    ``a`` and ``b`` name the pair in the order the kind chooses (the lane: lower rank first; a
    stream: sender first); both ends pass the same order.  The key is left out of ``repr``.
    """

    key: bytes = dataclasses.field(repr=False)
    kind: str
    job_id: str
    round_: int

    def of(self, a: int, b: int, what: str) -> bytes:
        """The proof for the pair ``a``-``b`` and ``what`` (``"hello"`` or ``"answer"``)."""
        label = f"ringcomm/v1/{self.kind}/{self.job_id}/{self.round_}/{a}-{b}/{what}"
        return hmac.digest(self.key, label.encode(), hashlib.sha256)

    def hello(self, rank: int, a: int, b: int) -> bytes:
        """The :data:`HELLO` that ``rank`` sends on the pair ``a``-``b``."""
        return HELLO.pack(rank, self.of(a, b, "hello"))

    def holds(self, proof: bytes, a: int, b: int, what: str) -> bool:
        """Whether ``proof`` is the pair's proof for ``what`` (compared in constant time)."""
        return hmac.compare_digest(proof, self.of(a, b, what))


def read_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the connection ended before its first byte.  One call
    reads it all where it can (``MSG_WAITALL``: no wake-up, and no GIL taken, per packet)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, _WAITALL)
        if not k:
            if got:
                raise ConnectionError(f"the connection ended {got} bytes into {n}")
            return False
        got += k
    return True


def read_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; ConnectionError if it ends first."""
    buf = bytearray(n)
    if not read_into(sock, memoryview(buf)):
        raise ConnectionError("the connection was closed during the handshake")
    return bytes(buf)


def nodelay(sock: socket.socket) -> socket.socket:
    """``sock`` with Nagle's delay off: a message's last bytes leave at once."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
