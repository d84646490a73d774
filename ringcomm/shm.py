"""Shared-memory slot rings for ranks on the same host.

One ring per direction (sender -> receiver): ``slots`` buffers of
``slot_bytes`` each, in a file under /dev/shm mapped by both processes.
The sender copies a segment into a free slot and tells the receiver which
slot over ZeroMQ; the receiver reduces straight out of the slot and hands it
back with an ack.  That replaces two kernel copies (into and out of the
socket) with one memcpy, and no payload passes through ZeroMQ's I/O thread.

The sender creates the file; the receiver maps it when the first
notification arrives and unlinks the name at once, so nothing is left in
/dev/shm once both sides have it mapped (the sender also unlinks it at the
first ack, and the receiver at close if it never mapped it): a rank killed
with SIGKILL leaves no segment behind.

The files are private to the user running the job: created with mode 0600
(``O_EXCL``: never a file someone prepared under that name), and the receiver
maps only a file its own user owns with no group or other access.  This path
bypasses ZeroMQ and so its authentication and encryption; what protects it is
that only the job's user (or root) can open the file, the same users who can
read the ranks' memory anyway.
"""

from __future__ import annotations

import mmap
import os
import stat

import numpy as np

from . import names

def available() -> bool:
    return os.path.isdir(names.SHM_DIR) and os.access(names.SHM_DIR, os.W_OK)


def unlink(path: str) -> None:
    """Remove a shared-memory file; no error if it is already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class MappedFile:
    """``nbytes`` of a file under /dev/shm, mapped: created (exclusively, mode 0600) or opened.

    An opened file must be this user's, private (no group or other access) and
    exactly ``nbytes`` long, else :class:`OSError` (``PermissionError``): ranks
    map only their own job's files.  ``reserve`` allocates the pages at creation
    (``posix_fallocate``), so a full /dev/shm fails here rather than with SIGBUS
    at the first write.
    """

    def __init__(self, path: str, nbytes: int, create: bool, reserve: bool = False) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, nbytes) if reserve else os.ftruncate(fd, nbytes)
                except OSError:
                    unlink(path)
                    raise
            else:
                info = os.fstat(fd)
                if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
                    raise PermissionError(
                        f"shared-memory file {path} belongs to uid {info.st_uid} with mode "
                        f"{stat.S_IMODE(info.st_mode):o}; ringcomm maps only its own user's private files"
                    )
                if info.st_size != nbytes:
                    raise OSError(f"shared-memory file {path}: {info.st_size} bytes, expected {nbytes}")
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    def unlink(self) -> None:
        unlink(self.path)

    def close(self) -> None:
        self._bytes = np.zeros(0, np.uint8)
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the GC frees the map later
            pass


class SlotRing(MappedFile):
    """A mapped ring of equal slots."""

    def __init__(self, path: str, slots: int, slot_bytes: int, create: bool) -> None:
        super().__init__(path, slots * slot_bytes, create)
        self.slots = slots
        self.slot_bytes = slot_bytes

    def slot(self, index: int, nbytes: int) -> np.ndarray:
        start = index * self.slot_bytes
        return self._bytes[start:start + nbytes]
