"""What a rank has received from each peer and not taken yet, and which arrivals are stale.

Each op owns ``stride`` consecutive sequence numbers (``seq // stride`` numbers the op), and
its payloads are told apart by ``(seq, tag)``; they may arrive, and be taken, in any order.
A rank receives the ops of one peer in order, so once it has entered an op:

- a payload for an earlier op is stale (every one of them was taken before that op ended);
- a second payload under a key already waiting, or already taken in this op, is a repeat.

Both are refused with :class:`ringcomm.errors.ProtocolError`; the data plane drops them.  The
items are opaque here (a ZeroMQ frame, a shared-memory slot, a streamed buffer).

Example::

    >>> box = Inbox(stride=2)
    >>> box.enter(1, 4)          # op 2 from rank 1: returns its first seq, 4
    4
    >>> box.put(1, 5, 0, "b"); box.put(1, 4, 0, "a")
    >>> box.take_op(1, 4)
    (0, 'a')
"""

from __future__ import annotations

from typing import Any

from ..errors import ProtocolError

__all__ = ["Inbox"]


class Inbox:
    """Per peer: the payloads waiting, by ``(seq, tag)``, and the keys taken in the current op."""

    def __init__(self, stride: int = 1) -> None:
        self.stride = max(1, stride)
        self._waiting: dict[int, dict[tuple[int, int], Any]] = {}
        self._op: dict[int, int] = {}  # peer -> the op this rank receives from it now
        self._taken: dict[int, set[tuple[int, int]]] = {}  # peer -> keys of that op already taken

    def enter(self, src: int, seq: int) -> int | None:
        """This rank now receives op ``seq`` from ``src``.  When that is a new op, its first sequence
        number (anything sent before it is stale from here on); None when it was entered already."""
        op = seq // self.stride
        if op == self._op.get(src, -1):
            return None
        self._op[src] = op
        self._taken[src] = set()
        return op * self.stride

    def check(self, src: int, seq: int, tag: int) -> None:
        """Raise :class:`ProtocolError` if ``(seq, tag)`` from ``src`` is a repeat or belongs to an op that is over."""
        key = (seq, tag)
        op, current = seq // self.stride, self._op.get(src, -1)
        if key in self._waiting.get(src, ()) or (op == current and key in self._taken[src]):
            raise ProtocolError(f"a second message for op {seq} tag {tag}")
        if op < current:
            raise ProtocolError(f"a message for op {seq}, which is over (this rank is at op {current * self.stride})")

    def put(self, src: int, seq: int, tag: int, item: Any) -> None:
        """Keep ``item`` until it is taken; raises like :meth:`check` (and keeps nothing then)."""
        self.check(src, seq, tag)
        self._waiting.setdefault(src, {})[(seq, tag)] = item

    def has(self, src: int, seq: int, tag: int) -> bool:
        return (seq, tag) in self._waiting.get(src, ())

    def take(self, src: int, seq: int, tag: int) -> Any:
        """The item waiting under ``(seq, tag)`` (KeyError if none); a repeat of it is refused from now on."""
        item = self._waiting[src].pop((seq, tag))
        self._taken.setdefault(src, set()).add((seq, tag))
        return item

    def take_op(self, src: int, seq: int) -> tuple[int, Any] | None:
        """``(tag, item)`` of the oldest payload of ``seq`` from ``src`` waiting, whichever its tag; or None."""
        for s, tag in self._waiting.get(src, ()):
            if s == seq:
                return tag, self.take(src, seq, tag)
        return None

    def keys(self, src: int) -> list[tuple[int, int]]:
        """The ``(seq, tag)`` of every payload from ``src`` waiting, oldest first."""
        return list(self._waiting.get(src, ()))

    def clear(self) -> None:
        self._waiting.clear()
