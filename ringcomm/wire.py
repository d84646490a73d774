"""Wire codec: requests, responses and data-plane headers.  Pure (no sockets).

A control message is one ZeroMQ frame ``tag + body``: ``body`` is msgpack,
``tag`` is the 32-byte keyed BLAKE2b MAC of the body (see :func:`sign`).  The tag is checked before the body is
parsed, and parsing never executes anything (no pickle), so a stranger's bytes
are dropped without effect.

Data-plane messages are ``[header, payload]``: a fixed 24-byte header
(job token, source rank, op sequence number, tag) and the raw array bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any, NamedTuple

import msgpack

# ---------------------------------------------------------------------------
# kinds of collective


ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
ALLTOALL = "alltoall"
REDUCESCATTER = "reducescatter"
BARRIER = "barrier"
JOIN = "join"
SHUTDOWN = "shutdown"
ADD_PSET = "add_process_set"  # global set: register ranks ``splits`` as a new process set
REMOVE_PSET = "remove_process_set"  # global set: forget process set ``root``
KINDS = (ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN, SHUTDOWN, ADD_PSET, REMOVE_PSET)


class Request(NamedTuple):
    """What one rank announces to the coordinator for one named op.

    ``pset`` is the id of the process set the op runs on (0: every rank); names
    are unique per set, and ``root`` is a global rank.
    """

    name: str
    kind: str
    dtype: str = ""
    shapes: tuple[tuple[int, ...], ...] = ()
    op: int = 0
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] | None = None
    pset: int = 0

    def signature(self) -> tuple:
        """Everything but the name: what must agree across ranks (allgather/alltoall relax it)."""
        return tuple(self)[1:]

    def numel(self) -> int:
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


class Response(NamedTuple):
    """What every rank executes, in the order rank 0 fixed.

    ``names`` are fused into one buffer in this order (allreduce), or a single
    name.  ``numels`` gives each name's element count (what a joined rank must
    contribute).  ``first_dims[r]`` is rank r's dim 0 (allgather);
    ``splits[r]`` is rank r's split vector (alltoall).  ``error`` set means the
    op failed on every rank with that message.  ``data`` set means rank 0
    already reduced the (small) payloads the ranks sent with their requests:
    every rank just unpacks it, no ring.  ``pset`` is the op's process set:
    only its members receive the response, and ``first_dims``/``splits`` are
    indexed by rank within the set.  For ``ADD_PSET``, ``root`` is the new
    set's id and ``splits[0]`` its ranks.
    """

    kind: str
    names: tuple[str, ...]
    dtype: str = ""
    op: int = 0
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    numels: tuple[int, ...] = ()
    first_dims: tuple[int, ...] = ()
    splits: tuple[tuple[int, ...], ...] = ()
    joined: tuple[int, ...] = ()
    last_joined: int = -1
    error: str = ""
    data: bytes = b""  # the finished result, when rank 0 reduced a small allreduce itself
    error_kind: str = ""  # "stall" for a stall turned into an error; otherwise a mismatch
    pset: int = 0


def _tuplify(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_tuplify(v) for v in x)
    return x


def request_from_wire(obj: Any) -> Request:
    """Rebuild a Request from its msgpack form; raises ValueError on anything malformed."""
    if not isinstance(obj, list) or not 2 <= len(obj) <= len(Request._fields):
        raise ValueError(f"malformed request: {obj!r:.200}")
    req = Request(*(_tuplify(v) for v in obj))
    if not isinstance(req.name, str) or req.kind not in KINDS or not isinstance(req.pset, int) or req.pset < 0:
        raise ValueError(f"malformed request: {obj!r:.200}")
    return req


_RESP_TUPLE_FIELDS = tuple(Response._fields.index(f) for f in ("names", "numels", "first_dims", "splits", "joined"))


def response_from_wire(obj: Any) -> Response:
    if not isinstance(obj, list) or not 2 <= len(obj) <= len(Response._fields):
        raise ValueError(f"malformed response: {obj!r:.200}")
    for i in _RESP_TUPLE_FIELDS:
        if i < len(obj):
            obj[i] = _tuplify(obj[i])
    resp = Response(*obj)
    if resp.kind not in KINDS:
        raise ValueError(f"malformed response: {obj!r:.200}")
    return resp


# ---------------------------------------------------------------------------
# control envelope


TAG_BYTES = 32


def sign(secret: bytes, body: bytes) -> bytes:
    """The 32-byte tag of ``body``: keyed BLAKE2b, a MAC by design (RFC 7693), in one pass.

    It replaced HMAC-SHA256 (two hash passes): 3.4 vs 15 us per control message
    here, and every small allreduce signs and checks two of them per rank.
    """
    key = secret if len(secret) <= 64 else hashlib.sha256(secret).digest()
    return hashlib.blake2b(body, key=key, digest_size=TAG_BYTES).digest()


def pack_control(secret: bytes, msg: Any) -> bytes:
    """Encode ``msg`` (msgpack-able) as one authenticated frame: 32-byte MAC tag, then the body."""
    body = msgpack.packb(msg, use_bin_type=True)
    return sign(secret, body) + body


#: Largest control body accepted (a request list of thousands of tensors fits easily).
MAX_CONTROL_BYTES = 64 * 1024 * 1024


def unpack_control(secret: bytes, frame: bytes) -> Any:
    """Verify and decode a control frame; raises ValueError for anything not from the job."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ValueError("control message must be one frame")
    frame = bytes(frame)
    if len(frame) < TAG_BYTES:
        raise ValueError(f"control frame of {len(frame)} bytes is too short")
    if len(frame) > MAX_CONTROL_BYTES + TAG_BYTES:
        raise ValueError("control message too large")
    tag, body = frame[:TAG_BYTES], frame[TAG_BYTES:]
    if not hmac.compare_digest(tag, sign(secret, body)):
        raise ValueError("bad authentication tag")
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several types
        raise ValueError(f"undecodable control body: {exc}") from None


# ---------------------------------------------------------------------------
# data-plane header

_HEADER = struct.Struct("<8sIQI")
HEADER_SIZE = _HEADER.size


def job_token(secret: bytes) -> bytes:
    """8 bytes derived from the secret that every data message carries."""
    return hashlib.sha256(b"ringcomm-data" + secret).digest()[:8]


def pack_header(token: bytes, src: int, seq: int, tag: int) -> bytes:
    return _HEADER.pack(token, src, seq, tag)


def unpack_header(token: bytes, header: bytes) -> tuple[int, int, int]:
    """``(src, seq, tag)``; raises ValueError for a wrong size or token."""
    if len(header) != HEADER_SIZE:
        raise ValueError(f"bad data header length {len(header)}")
    tok, src, seq, tag = _HEADER.unpack(header)
    if not hmac.compare_digest(tok, token):
        raise ValueError("data message with a foreign job token")
    return src, seq, tag
