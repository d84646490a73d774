"""One rank's slot rings to and from its peers on the same host: which exist, their shape, which slots are free.

No sockets here.  The data plane (:class:`ringcomm.net.transport.DataPlane`) tells a peer which
slot holds its payload and acks the slots it has used; this object owns the bookkeeping behind
both: the rings this rank writes (created at the first payload that could use one, sized from
the room in /dev/shm, :mod:`ringcomm.shm.space`), their free slots, the rings it reads (mapped at
the first notice), and the slots it holds until its next receive from that peer.
"""

from __future__ import annotations

import collections
import errno
import logging

from ..errors import ProtocolError
from ..job import names
from . import slots as shm, space as shm_space

log = logging.getLogger("ringcomm.net.transport")  # what a user filters on for the data plane's messages


class PeerRings:
    """The slot rings of rank ``rank`` in round ``round_`` of job ``job_id``.

    ``slots`` and ``slot_bytes``: the shape this rank's rings ask for (``slots`` 0: none); payloads
    from ``min_bytes`` to ``slot_bytes`` use them.
    """

    def __init__(self, rank: int, job_id: str, round_: int, slots: int, slot_bytes: int, min_bytes: int) -> None:
        self.rank, self._job, self._round = rank, job_id, round_
        self.slots = slots if shm.available() else 0
        self.slot_bytes = slot_bytes  # the segment size (every rank's): no slot is larger
        self.min_bytes = min_bytes
        self.out: dict[int, shm.SlotRing] = {}
        self.free: dict[int, collections.deque[int]] = {}
        self._in: dict[int, shm.SlotRing] = {}
        self.held: dict[int, list[int]] = collections.defaultdict(list)
        self._untried: set[int] = set()  # same-host peers this rank has not tried to make a ring to yet
        self._sources: set[int] = set()  # same-host peers that may create a ring to this rank
        self._short_warned = False  # one warning per rank when /dev/shm has no room for a ring
        self._acked: set[int] = set()  # peers that acked a slot of this rank's ring to them

    def add_peer(self, peer: int) -> None:
        """``peer`` shares this host: it may make a ring to this rank, and this rank one to it."""
        self._sources.add(peer)  # it decides for itself whether it makes a ring to this rank
        if self.slots > 0:
            self._untried.add(peer)  # the ring is created on first use (fewer files, none unused)

    def fits(self, nbytes: int) -> bool:
        return self.min_bytes <= nbytes <= self.slot_bytes

    def out_ring(self, dst: int) -> shm.SlotRing | None:
        """This rank's ring to ``dst``, created the first time a payload could use it, as large as the
        room in /dev/shm allows (:func:`ringcomm.shm.space.ring_geometry`), its pages reserved."""
        ring = self.out.get(dst)
        if ring is None and dst in self._untried:
            self._untried.discard(dst)
            path = names.shm_ring(self._job, self._round, self.rank, dst)
            want = shm_space.RingGeometry(self.slots, self.slot_bytes)
            local = len(self._sources) + 1
            shape: shm_space.RingGeometry | None = None
            free: int | None = None
            for _ in range(3):  # other ranks take room at the same time: size again from what is left
                free = shm_space.free_bytes(names.SHM_DIR)
                shape = want if free is None else shm_space.ring_geometry(
                    want.slots, want.slot_bytes, self.min_bytes, free, local)
                if shape is None:
                    break
                try:
                    ring = self.out[dst] = shm.SlotRing(path, shape.slots, shape.slot_bytes, create=True)
                    self.free[dst] = collections.deque(range(shape.slots))
                    break
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                        log.debug("rank %d: no shared memory to rank %d (%s); using sockets", self.rank, dst, exc)
                        return None
                    shape = None
            if shape != want:
                self._tell_short(path, want, shape, free)
        return ring

    def _tell_short(self, path: str, want: shm_space.RingGeometry, got: shm_space.RingGeometry | None,
                    free: int | None) -> None:
        """Log that a ring to a peer is smaller than asked: a warning, once per rank, when payloads that
        would have used it go through the socket instead (then DEBUG); INFO when it only has fewer slots."""
        falls_back = got is None or got.slot_bytes < want.slot_bytes
        level = logging.INFO if not falls_back else logging.DEBUG if self._short_warned else logging.WARNING
        if log.isEnabledFor(level):
            text = shm_space.short_ring_text(path, want, got, free)
            log.log(level, "rank %d: %s", self.rank, text)
        self._short_warned |= falls_back

    def acked(self, src: int, slot: int) -> None:
        """``src`` is done with ``slot`` of this rank's ring to it; raises :class:`ProtocolError` for a
        slot that is not in use."""
        free = self.free.get(src)
        if free is None or slot in free or slot >= self.out[src].slots:
            raise ProtocolError(f"ack of slot {slot}, which is not in use towards rank {src}")
        free.append(slot)
        if src not in self._acked:  # the receiver has the ring mapped: its name can go
            self._acked.add(src)
            self.out[src].unlink()

    def in_ring(self, src: int) -> shm.SlotRing:
        """The ring ``src`` writes to this rank, mapped (and its name unlinked) on first use."""
        ring = self._in.get(src)
        if ring is None:
            path = names.shm_ring(self._job, self._round, src, self.rank)
            try:
                ring = shm.SlotRing.open(path, self.slot_bytes)
            except (OSError, ValueError) as exc:
                raise ProtocolError(f"shared-memory notification, but no ring {path} to map: {exc}") from None
            self._in[src] = ring
            ring.unlink()  # both sides have it mapped now
        return ring

    def close(self) -> None:
        for ring in (*self.out.values(), *self._in.values()):
            ring.unlink()
            ring.close()
        # A peer killed after creating its ring to this rank, before this rank mapped it, cannot
        # remove it: this rank does (the name is unique to the pair, the round and the job).
        names.remove_files([names.shm_ring(self._job, self._round, src, self.rank) for src in self._sources])
        self._sources.clear()
        self.out.clear()
        self._in.clear()
