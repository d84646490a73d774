"""Wire codec: requests, responses and data-plane headers.  Pure (no sockets).

A control message is one ZeroMQ frame ``tag + body``: ``body`` is msgpack,
``tag`` is the 32-byte keyed BLAKE2b MAC of the body (see :func:`sign`).  The tag is checked before the body is
parsed, and parsing never executes anything (no pickle), so a stranger's bytes
are dropped without effect.

Data-plane messages (see transport.py) start with a small fixed-size struct:
a shared-memory notification ``S``, an inline payload ``I`` (the payload is
the second frame) or a slot ack ``A``.  Every decoder here raises one error
type, :class:`~ringcomm.errors.ProtocolError`, for anything malformed.
"""

from __future__ import annotations

import hashlib
import hmac
import reprlib
import struct
from typing import Any, NamedTuple

import msgpack

from ..errors import ProtocolError

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
ADD_PSET = "add_process_set"  # global set: register ranks ``set_ranks`` as a new process set
REMOVE_PSET = "remove_process_set"  # global set: forget process set ``set_id``
#: Not a collective: every rank stops posting to the small-op lane.  A rank sends it (named after
#: its op) when an op of its lane waited past the stall deadline; rank 0 answers every rank with it,
#: and also after it failed an op of the global set as stalled (the ranks' lane indexes no longer
#: line up).  It never reaches a coordinator.
LANE_OFF = "lane_off"
KINDS = (ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN, SHUTDOWN, ADD_PSET, REMOVE_PSET,
         LANE_OFF)
_KIND_SET = frozenset(KINDS)


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
    #: Set when this rank refused the call (bad arguments): why.  The op then fails on every member
    #: with that reason instead of leaving the others waiting for this rank.
    refused: str = ""
    #: ``ADD_PSET``: the global ranks of the set to create.
    set_ranks: tuple[int, ...] = ()
    #: ``REMOVE_PSET``: the id of the set to forget.
    set_id: int = -1
    #: ``ALLTOALL``, when the caller says: the rows this rank expects from each rank (its
    #: ``received_splits``).  The op fails on every rank unless each rank's splits entry for this
    #: rank is what this rank expects from it.
    received_splits: tuple[int, ...] | None = None

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
    indexed by rank within the set.  ``set_id`` and ``set_ranks`` name the
    set that an ``ADD_PSET`` creates (its id, given by rank 0, and its global
    ranks) or that a ``REMOVE_PSET`` forgets (its id).
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
    set_id: int = -1
    set_ranks: tuple[int, ...] = ()


#: Largest integer a field may hold: shapes, counts and ranks are int64 on every rank.
_INT_MAX = 2**63 - 1
#: Wire names of the reduce ops (``ops.ReduceOp`` values) and dtypes; wire.py stays free of NumPy.
_OPS = frozenset({0, 1, 3, 4, 5})  # Average, Sum, Min, Max, Product; Adasum (2) is refused at the call
_DTYPES = frozenset({"", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"})
_ERROR_KINDS = frozenset({"", "stall", "mismatch"})


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 2, 60, 60, 6, 4


def _short(value: Any) -> str:
    """A bounded repr of a peer's value (never recursing into deep nesting)."""
    return _repr.repr(value)


def _bad(what: str, field: str, value: Any) -> ProtocolError:
    return ProtocolError(f"malformed {what}: field {field!r} is {_short(value)}")


def _int(what: str, field: str, v: Any, lo: int = 0) -> int:
    if type(v) is not int or not lo <= v <= _INT_MAX:
        raise _bad(what, field, v)
    return v


def _ints(what: str, field: str, v: Any, lo: int = 0) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise _bad(what, field, v)
    return tuple(_int(what, field, x, lo) for x in v)


def _str(what: str, field: str, v: Any, allowed: frozenset[str] | None = None) -> str:
    if not isinstance(v, str) or (allowed is not None and v not in allowed):
        raise _bad(what, field, v)
    return v


def _num(what: str, field: str, v: Any) -> float:
    if type(v) not in (int, float):
        raise _bad(what, field, v)
    return float(v)


def _op(what: str, v: Any) -> int:
    if type(v) is not int or v not in _OPS:
        raise _bad(what, "op", v)
    return v


def _fields(what: str, obj: Any, cls: type) -> dict[str, Any]:
    """The named fields of a message list, defaults filled in."""
    names = cls._fields  # type: ignore[attr-defined]
    if not isinstance(obj, list) or not 2 <= len(obj) <= len(names):
        raise ProtocolError(f"malformed {what}: expected a list of 2..{len(names)} fields, got {_short(obj)}")
    d = dict(cls._field_defaults)  # type: ignore[attr-defined]
    d.update(zip(names, obj))
    return d


def request_from_wire(obj: Any) -> Request:
    """Rebuild a Request from its msgpack form; raises :class:`ProtocolError` on anything malformed.

    Every field is checked for its type and range (no recursion: a request is
    at most two levels deep), so a peer's garbage can only produce this one error.
    """
    w = "request"
    d = _fields(w, obj, Request)
    shapes, splits, received = d["shapes"], d["splits"], d["received_splits"]
    if not isinstance(shapes, (list, tuple)):
        raise _bad(w, "shapes", shapes)
    return Request(
        name=_str(w, "name", d["name"]),
        kind=_str(w, "kind", d["kind"], _KIND_SET),
        dtype=_str(w, "dtype", d["dtype"], _DTYPES),
        shapes=tuple(_ints(w, "shapes", s) for s in shapes),
        op=_op(w, d["op"]),
        root=_int(w, "root", d["root"], lo=-1),
        prescale=_num(w, "prescale", d["prescale"]),
        postscale=_num(w, "postscale", d["postscale"]),
        splits=None if splits is None else _ints(w, "splits", splits),
        pset=_int(w, "pset", d["pset"]),
        refused=_str(w, "refused", d["refused"]),
        set_ranks=_ints(w, "set_ranks", d["set_ranks"]),
        set_id=_int(w, "set_id", d["set_id"], lo=-1),
        received_splits=None if received is None else _ints(w, "received_splits", received),
    )


def response_from_wire(obj: Any) -> Response:
    """Rebuild a Response from its msgpack form; raises :class:`ProtocolError` on anything malformed."""
    w = "response"
    d = _fields(w, obj, Response)
    names, splits, data = d["names"], d["splits"], d["data"]
    if not isinstance(names, (list, tuple)) or not isinstance(splits, (list, tuple)):
        raise _bad(w, "names/splits", (names, splits))
    if not isinstance(data, bytes):
        raise _bad(w, "data", type(data).__name__)
    return Response(
        kind=_str(w, "kind", d["kind"], _KIND_SET),
        names=tuple(_str(w, "names", n) for n in names),
        dtype=_str(w, "dtype", d["dtype"], _DTYPES),
        op=_op(w, d["op"]),
        root=_int(w, "root", d["root"], lo=-1),
        prescale=_num(w, "prescale", d["prescale"]),
        postscale=_num(w, "postscale", d["postscale"]),
        numels=_ints(w, "numels", d["numels"]),
        first_dims=_ints(w, "first_dims", d["first_dims"]),
        splits=tuple(_ints(w, "splits", s) for s in splits),
        joined=_ints(w, "joined", d["joined"]),
        last_joined=_int(w, "last_joined", d["last_joined"], lo=-1),
        error=_str(w, "error", d["error"]),
        data=data,
        error_kind=_str(w, "error_kind", d["error_kind"], _ERROR_KINDS),
        pset=_int(w, "pset", d["pset"]),
        set_id=_int(w, "set_id", d["set_id"], lo=-1),
        set_ranks=_ints(w, "set_ranks", d["set_ranks"]),
    )


class Announced(NamedTuple):
    """One item of a request batch: a :class:`Request` or a response-cache id ``(set id, id)``, the
    small op's payload sent along (or None), and how long the sender had already waited for the op
    before announcing it (seconds: an op the small-op lane handed on after a stall)."""

    item: Request | tuple[int, int]
    data: bytes | None = None
    waited: float = 0.0


def parse_request_batch(msg: Any, size: int) -> tuple[int, list[Announced]]:
    """Split a decoded ``["req", rank, items]`` message: the sender's rank and its items.

    Each item is a :class:`Request` or a response-cache id — an int for the
    global set, ``{"s": set id, "c": id}`` for another process set, returned as
    ``(set id, id)`` — either bare or as ``{"q": item}`` with the small-allreduce
    payload (``"d": bytes``) and/or the seconds already waited (``"w": number``).
    Raises :class:`ProtocolError` for anything else.
    """
    if not isinstance(msg, list) or len(msg) != 3 or msg[0] != "req":
        raise ProtocolError(f"malformed request batch: {_short(msg)}")
    _, rank, items = msg
    if type(rank) is not int or not 0 < rank < size:
        raise ProtocolError(f"request batch from rank {_short(rank)}, not one of 1..{size - 1}")
    if not isinstance(items, list):
        raise ProtocolError(f"malformed request batch: items are {_short(items)}")
    out: list[Announced] = []
    for it in items:
        data, waited = None, 0.0
        if isinstance(it, dict) and "q" in it:
            if not {"q"} < set(it) <= {"q", "d", "w"} or ("d" in it and not isinstance(it["d"], bytes)):
                raise ProtocolError(f"malformed request with payload: keys {_short(list(it))}")
            if "w" in it:
                waited = _num("request", "waited", it["w"])
                if not 0.0 <= waited < float("inf"):
                    raise _bad("request", "waited", waited)
            it, data = it["q"], it.get("d")
        if isinstance(it, dict):  # a cached request of another process set
            if set(it) != {"s", "c"}:
                raise ProtocolError(f"malformed cached request: keys {_short(list(it))}")
            out.append(Announced((_int("cached request", "s", it["s"]), _int("cached request", "c", it["c"])),
                                 data, waited))
        elif type(it) is int:
            if not 0 <= it <= _INT_MAX:
                raise ProtocolError(f"response-cache id {it} is out of range")
            out.append(Announced((0, it), data, waited))
        else:
            out.append(Announced(request_from_wire(it), data, waited))
    return rank, out


def parse_response_batch(msg: Any) -> list[Response]:
    """The responses of a decoded ``["resp", [response, ...]]`` message; raises :class:`ProtocolError`."""
    if not isinstance(msg, list) or len(msg) != 2 or msg[0] != "resp" or not isinstance(msg[1], list):
        raise ProtocolError(f"malformed response batch: {_short(msg)}")
    return [response_from_wire(r) for r in msg[1]]


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
#: Senders split batches so that the array data in one control frame stays below this
#: (one item carries at most this much), leaving MAX_CONTROL_BYTES ample room for the rest.
CONTROL_DATA_BYTES = 16 * 1024 * 1024


def unpack_control(secret: bytes, frame: bytes) -> Any:
    """Verify and decode a control frame; raises :class:`ProtocolError` for anything not from the job.

    msgpack bounds every container and string by the frame's length, so no
    length field inside the body can make it allocate more than the frame.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("control message must be one frame")
    frame = bytes(frame)
    if len(frame) < TAG_BYTES:
        raise ProtocolError(f"control frame of {len(frame)} bytes is too short")
    if len(frame) > MAX_CONTROL_BYTES + TAG_BYTES:
        raise ProtocolError(f"control message of {len(frame)} bytes is larger than {MAX_CONTROL_BYTES + TAG_BYTES}")
    tag, body = frame[:TAG_BYTES], frame[TAG_BYTES:]
    if not hmac.compare_digest(tag, sign(secret, body)):
        raise ProtocolError("bad authentication tag")
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several types
        raise ProtocolError(f"undecodable control body: {exc}") from None


# ---------------------------------------------------------------------------
# encoders: what the decoders above read back


def encode_requests(secret: bytes, rank: int,
                    items: list[tuple[Request | int, int, bytes | None]] | list[tuple[Request | int, int, bytes | None, float]],
                    ) -> list[bytes]:
    """Rank ``rank``'s announcements as signed ``["req", rank, items]`` frames.

    Each item is ``(request or response-cache id, process set, payload or None[, seconds waited])``:
    a cached op travels as its id (an int for the global set, ``{"s": set, "c": id}`` for
    another), a small op's data rides along as ``{"q": item, "d": bytes}``, and an op this rank
    had waited for before announcing it carries ``"w": seconds``.  A new frame starts before the
    payloads in one would pass :data:`CONTROL_DATA_BYTES`.
    """
    frames: list[bytes] = []
    batch: list[Any] = []
    carried = 0
    for entry in items:
        it, pset, data = entry[0], entry[1], entry[2]
        waited = entry[3] if len(entry) > 3 else 0.0  # type: ignore[misc]
        obj: Any = list(it) if isinstance(it, Request) else it if pset == 0 else {"s": pset, "c": it}
        if data is not None or waited > 0:
            wrapped: dict[str, Any] = {"q": obj}
            if data is not None:
                if batch and carried + len(data) > CONTROL_DATA_BYTES:
                    frames.append(pack_control(secret, ["req", rank, batch]))
                    batch, carried = [], 0
                wrapped["d"] = data
                carried += len(data)
            if waited > 0:
                wrapped["w"] = float(waited)
            obj = wrapped
        batch.append(obj)
    if batch:
        frames.append(pack_control(secret, ["req", rank, batch]))
    return frames


def response_batches(resps: list[Response]) -> list[list[Response]]:
    """Split responses into batches whose result data stays within :data:`CONTROL_DATA_BYTES`.

    Without this, many small allreduces reduced at rank 0 in one cycle made one
    control frame larger than :data:`MAX_CONTROL_BYTES`; the other ranks dropped
    it and waited forever for their results.
    """
    batches: list[list[Response]] = [[]]
    carried = 0
    for resp in resps:
        if batches[-1] and carried + len(resp.data) > CONTROL_DATA_BYTES:
            batches.append([])
            carried = 0
        batches[-1].append(resp)
        carried += len(resp.data)
    return batches


def encode_responses(secret: bytes, resps: list[Response]) -> list[bytes]:
    """Responses as signed ``["resp", [response, ...]]`` frames, each within the control bound."""
    return [pack_control(secret, ["resp", [list(r) for r in batch]]) for batch in response_batches(resps)]


# ---------------------------------------------------------------------------
# data-plane messages (the pair socket between two ranks; see transport.py)

NOTE = struct.Struct("<cHIQI")  # b"S", slot, nbytes, seq, tag: the payload is in a shared-memory slot
INLINE = struct.Struct("<cQI")  # b"I", seq, tag: the payload is the second frame
ACK = struct.Struct("<cH")  # b"A", slot: the receiver is done with that slot
LOST = struct.Struct("<cI")  # b"L", rank: the sender lost that rank and is failing (sent to the others)
#: b"R", address, nbytes, seq, tag: the payload is at that address of the sender (a peer on the same host,
#: which reads it with ``process_vm_readv``; ``shm/cross_memory.py``) until the receiver answers :data:`READ`
REF = struct.Struct("<cQQQI")
READ = struct.Struct("<c")  # b"B": the receiver has read the sender's oldest payload sent by reference
#: b"P", address, token: can the receiver read the sender's memory?  The token is at that address
PROBE = struct.Struct("<cQ16s")
PROBE_ANSWER = struct.Struct("<c?")  # b"Y", whether the receiver read the probe's token right
#: b"T", seq, tag, nbytes: the head of one payload on a pair's TCP stream (``net/streams.py``); the
#: payload's bytes follow it on the stream
STREAM = struct.Struct("<cQIQ")


class DataMessage(NamedTuple):
    """One parsed data-plane message: ``kind`` is ``b"S"``, ``b"I"``, ``b"A"``, ``b"L"`` (``lost``: the rank),
    ``b"T"`` (a stream head, :func:`parse_stream_head`), or one of reading a same-host peer's memory:
    ``b"R"`` (``address``, ``nbytes``), ``b"B"``, ``b"P"`` (``address``, ``token``) or ``b"Y"`` (``ok``: the
    probe was read right)."""

    kind: bytes
    seq: int = 0
    tag: int = 0
    slot: int = -1
    nbytes: int = 0
    lost: int = -1
    address: int = 0
    token: bytes = b""
    ok: bool = False


def parse_data(head: bytes, nframes: int, slots: int, slot_bytes: int) -> DataMessage:
    """Parse a data-plane message's first frame; raises :class:`ProtocolError` for anything malformed.

    ``nframes`` is the message's frame count (an inline payload is the second
    frame, every other kind is one frame); ``slots`` and ``slot_bytes`` bound
    a shared-memory notification, so a bad slot number can never address memory
    outside the ring.
    """
    kind = head[:1]
    if kind == b"S" and len(head) == NOTE.size and nframes == 1:
        _, slot, n, seq, tag = NOTE.unpack(head)
        if slot >= slots or n > slot_bytes:
            raise ProtocolError(f"data notification for slot {slot} of {n} bytes; the ring has {slots} slots "
                                f"of {slot_bytes} bytes")
        return DataMessage(b"S", seq, tag, slot, n)
    if kind == b"I" and len(head) == INLINE.size and nframes == 2:
        _, seq, tag = INLINE.unpack(head)
        return DataMessage(b"I", seq, tag)
    if kind == b"A" and len(head) == ACK.size and nframes == 1:
        slot = ACK.unpack(head)[1]
        if slot >= slots:
            raise ProtocolError(f"ack of slot {slot}; the ring has {slots} slots")
        return DataMessage(b"A", slot=slot)
    if kind == b"L" and len(head) == LOST.size and nframes == 1:
        return DataMessage(b"L", lost=LOST.unpack(head)[1])
    if kind == b"R" and len(head) == REF.size and nframes == 1:
        _, address, n, seq, tag = REF.unpack(head)
        return DataMessage(b"R", seq, tag, nbytes=n, address=address)
    if kind == b"B" and len(head) == READ.size and nframes == 1:
        return DataMessage(b"B")
    if kind == b"P" and len(head) == PROBE.size and nframes == 1:
        _, address, token = PROBE.unpack(head)
        return DataMessage(b"P", address=address, token=token)
    if kind == b"Y" and len(head) == PROBE_ANSWER.size and nframes == 1:
        return DataMessage(b"Y", ok=PROBE_ANSWER.unpack(head)[1])
    raise ProtocolError(f"malformed data message: {nframes} frame(s), first {len(head)} bytes {head[:16]!r}")


def parse_stream_head(head: bytes, max_bytes: int) -> DataMessage:
    """Parse the head of one payload on a stream (:data:`STREAM`); raises :class:`ProtocolError` when it is
    not one, or announces more than ``max_bytes`` (a segment: no sender cuts larger ones)."""
    if len(head) != STREAM.size or head[:1] != b"T":
        raise ProtocolError(f"malformed stream head: {len(head)} bytes {head[:16]!r}")
    _, seq, tag, n = STREAM.unpack(head)
    if n > max_bytes:
        raise ProtocolError(f"a stream payload of {n} bytes, more than a segment ({max_bytes} bytes)")
    return DataMessage(b"T", seq, tag, nbytes=n)
