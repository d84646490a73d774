"""How much of /dev/shm a slot ring takes, and what to say when a region does not fit.

A container's /dev/shm is often small (Docker's default is 64 MB), and a page of a shared-memory
file that cannot be had kills the process that touches it with SIGBUS.  So every region reserves
its pages when it is made (:class:`ringcomm.shm.slots.MappedFile`), and the slot rings between
ranks are sized from the room there is:

- the small-op lane's region (made first, by rank 0) grows past its base size only into a quarter of
  what is free (:func:`lane_payload_bytes`);
- a ring may take ``1 / (2 x local ranks)`` of what is free when it is made: the ranks of a host
  make up to one ring each towards each other, and half of /dev/shm is left for the small-op lane,
  the shared-memory allreduce, later rings and the application's own use (a DataLoader's workers);
- within that it keeps whole slots of ``slot_bytes`` (the segment size, so a segment fits in
  one), as many as the setting asks for and fit; if not even one fits, one smaller slot of whole
  pages carries the payloads that fit it (larger ones go through the socket);
- below one page, or below the smallest payload the slots are for, there is no ring: every payload
  to that peer goes through the socket.

The receiver learns the ring's shape from the size of its file (:func:`geometry_of`): whole slots
make a multiple of ``slot_bytes`` (the segment size, which every rank holds the same), the one
smaller slot is smaller than that.  The sender alone decides, and the receiver follows whatever
it finds.

Pure, apart from :func:`free_bytes`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

#: Unit of a slot smaller than a segment (and the smallest ring).
PAGE = 4096
#: A ring's share of what is free is 1 / (SHARE x local ranks).
SHARE = 2
#: Most slots a ring may have (a notification carries the slot number in 16 bits).
MAX_SLOTS = 1 << 16

_FIX = ("give the container more shared memory (docker run --shm-size=1g; Kubernetes: an emptyDir volume "
        "with medium: Memory mounted at /dev/shm)")
#: What shrinks each region, by the last part of its name (ringcomm.job.names).
_SETTINGS = {
    "lane": "RINGCOMM_SHM_LANE_BYTES (the small-op lane's payload bound; 0: no lane)",
    "allreduce": "RINGCOMM_SHM_ALLREDUCE_PIECE_BYTES (or RINGCOMM_SHM_ALLREDUCE_MIN_BYTES=0: allreduces take the "
                 "ring)",
}
_RING_SETTINGS = "RINGCOMM_SHM_SLOTS (slots per pair of ranks; 0: sockets only) or RINGCOMM_SEGMENT_BYTES"


#: Beyond its base size (entries of the reductions' bound), the small-op lane's region takes at most
#: 1 / LANE_SHARE of what is free when it is made.
LANE_SHARE = 4


def lane_payload_bytes(want: int, floor: int, free: int | None, entries: int) -> int:
    """The payload bytes of each of the lane region's ``entries``: ``want``, cut back where the
    region would take more than 1/:data:`LANE_SHARE` of the ``free`` bytes (None: unknown), but
    never below ``floor`` (a region of that size that does not fit is not made: no lane).

        lane_payload_bytes(8 << 20, 2 << 20, 24 << 30, 8) -> 8388608      # plenty
        lane_payload_bytes(8 << 20, 2 << 20, 192 << 20, 8) -> 6291456     # 48 MiB for the region
        lane_payload_bytes(8 << 20, 2 << 20, 64 << 20, 8) -> 2097152      # a container's 64 MB
        lane_payload_bytes(8 << 20, 2 << 20, None, 8) -> 2097152
    """
    if want <= floor:
        return want
    if free is None:
        return floor
    return max(floor, min(want, max(0, free) // LANE_SHARE // max(1, entries) // 64 * 64))


class RingGeometry(NamedTuple):
    """``slots`` slots of ``slot_bytes`` each."""

    slots: int
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes


def ring_geometry(slots: int, slot_bytes: int, min_bytes: int, free: int, local_ranks: int) -> RingGeometry | None:
    """The ring a sender makes when ``free`` bytes are free and ``local_ranks`` ranks share the host;
    None: no ring (sockets only).  ``slots`` x ``slot_bytes``: what the settings ask for;
    ``min_bytes``: smaller payloads never use the slots.

        ring_geometry(4, 4 << 20, 65536, 24 << 30, 4) -> RingGeometry(4, 4194304)      # plenty
        ring_geometry(4, 4 << 20, 65536, 48 << 20, 4) -> RingGeometry(1, 4194304)      # 6 MiB share
        ring_geometry(4, 4 << 20, 65536, 8 << 20, 2)  -> RingGeometry(1, 2097152)      # 2 MiB share
        ring_geometry(4, 4 << 20, 65536, 128 << 10, 2) -> None                         # 32 KiB share
    """
    if slots <= 0 or slot_bytes <= 0:
        return None
    budget = max(0, free) // (SHARE * max(1, local_ranks))
    if budget >= slot_bytes:
        return RingGeometry(min(slots, MAX_SLOTS - 1, budget // slot_bytes), slot_bytes)
    small = budget // PAGE * PAGE
    if small >= max(PAGE, min_bytes):
        return RingGeometry(1, small)
    return None


def geometry_of(file_bytes: int, slot_bytes: int) -> RingGeometry | None:
    """The shape of a ring whose file holds ``file_bytes`` (as :func:`ring_geometry` makes them, with
    the same ``slot_bytes``); None for a size no sender makes.

        geometry_of(3 * 4194304, 4194304) -> RingGeometry(3, 4194304)
        geometry_of(2097152, 4194304)     -> RingGeometry(1, 2097152)
    """
    if file_bytes <= 0 or slot_bytes <= 0:
        return None
    if file_bytes < slot_bytes:
        return RingGeometry(1, file_bytes) if file_bytes % PAGE == 0 else None
    slots, rest = divmod(file_bytes, slot_bytes)
    return RingGeometry(slots, slot_bytes) if rest == 0 and slots < MAX_SLOTS else None


def free_bytes(directory: str) -> int | None:
    """Bytes an unprivileged process may still allocate under ``directory``; None if unknown."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def size_text(nbytes: int) -> str:
    """``16.0 MiB (16777216 B)``, ``128.0 KiB (131072 B)``."""
    if nbytes < 1 << 20:
        return f"{nbytes / 1024:.1f} KiB ({nbytes} B)"
    return f"{nbytes / (1 << 20):.1f} MiB ({nbytes} B)"


def settings_for(path: str) -> str:
    """The settings that shrink the region at ``path`` (a ringcomm shared-memory file)."""
    return _SETTINGS.get(os.path.basename(path).rpartition("-")[2], _RING_SETTINGS)


def no_space_text(path: str, needed: int, free: int | None) -> str:
    """What to say when the region at ``path`` needs ``needed`` bytes and ``free`` are free."""
    room = "an unknown amount" if free is None else size_text(free)
    return (f"{path} needs {size_text(needed)} of shared memory and {os.path.dirname(path)} has {room} free: "
            f"{_FIX}, or lower {settings_for(path)}")


def short_ring_text(path: str, want: RingGeometry, got: RingGeometry | None, free: int | None) -> str:
    """What to say when a ring gets less than the settings ask for (``got`` None: no ring at all)."""
    beside = " (from RINGCOMM_CROSS_MEMORY_MIN_BYTES up, read from this rank's memory where the host allows it)"
    if got is None:
        then = f"payloads to that rank go through its socket{beside}"
    elif got.slot_bytes < want.slot_bytes:
        then = f"it has 1 slot of {size_text(got.slot_bytes)}, so larger payloads go through the socket{beside}"
    else:
        then = f"it has {got.slots} of the {want.slots} slots"
    return (f"{no_space_text(path, want.nbytes, free)} (a ring takes at most 1/{SHARE} of the free space, shared "
            f"among the host's ranks); {then}. Results are the same, only slower")
