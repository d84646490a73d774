"""The frames of the small-op lane across hosts (:mod:`ringcomm.lane.net_lane`), with no I/O.

A rank sends every peer one frame per lane index it posts, and one when it
posts no more::

    head (26 bytes, little-endian): kind u8, epoch u32, index u64, key u64, fast u8, nbytes u32
    payload: nbytes bytes (a slot's buffers, concatenated; nothing for OFF)

``epoch`` counts the lane's restarts after a join: a frame of an older epoch
is stale and dropped by the reader.  A stream may be cut anywhere; the
reader keeps the tail until the rest arrives.

    >>> r = FrameReader(max_payload=16)
    >>> r.feed(slot_frame(0, 3, 7, True, b"abcd")[:10]), len(r.feed(slot_frame(0, 3, 7, True, b"abcd")[10:]))
    ([], 1)
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ..errors import ProtocolError

SLOT, OFF = 1, 2
HEAD = struct.Struct("<BIQQBI")


class Frame(NamedTuple):
    kind: int  # SLOT or OFF
    epoch: int
    lane_index: int
    key: int
    fast: bool
    payload: bytes


def slot_frame(epoch: int, index: int, key: int, fast: bool, payload: bytes) -> bytes:
    """One lane slot: its head and its payload."""
    return HEAD.pack(SLOT, epoch & 0xFFFFFFFF, index, key, int(fast), len(payload)) + payload


def slot_head(epoch: int, index: int, key: int, fast: bool, nbytes: int) -> bytes:
    """The head of a slot whose ``nbytes`` of payload follow it on the stream."""
    return HEAD.pack(SLOT, epoch & 0xFFFFFFFF, index, key, int(fast), nbytes)


def off_frame(epoch: int) -> bytes:
    """The sender posts no more in ``epoch`` (joined, shut down or stalled out)."""
    return HEAD.pack(OFF, epoch & 0xFFFFFFFF, 0, 0, 0, 0)


class FrameReader:
    """Cuts one peer's byte stream into frames; a payload over ``max_payload`` is a protocol error."""

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        """The frames ``data`` completes (with what earlier calls left over), in stream order."""
        buf = self._buf
        if buf:
            buf += data
            view: bytes | bytearray = buf
        else:
            view = data
        frames, pos, end, size = [], 0, len(view), HEAD.size
        while end - pos >= size:
            kind, epoch, index, key, fast, nbytes = HEAD.unpack_from(view, pos)
            if kind not in (SLOT, OFF) or nbytes > self.max_payload or fast > 1:
                raise ProtocolError(f"malformed small-op lane frame: kind {kind}, fast {fast}, {nbytes} B "
                                    f"(at most {self.max_payload} B)")
            if end - pos - size < nbytes:
                break
            start = pos + size
            frames.append(Frame(kind, epoch, index, key, bool(fast), bytes(view[start:start + nbytes])))
            pos = start + nbytes
        if view is buf:
            del buf[:pos]
        elif pos < end:
            buf += view[pos:]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)
