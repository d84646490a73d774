"""Shared-memory slot rings for ranks on the same host.

One ring per direction (sender -> receiver): ``slots`` buffers of
``slot_bytes`` each, in a file under /dev/shm mapped by both processes.
The sender copies a segment into a free slot and tells the receiver which
slot over ZeroMQ; the receiver reduces straight out of the slot and hands it
back with an ack.  That replaces two kernel copies (into and out of the
socket) with one memcpy, and no payload passes through ZeroMQ's I/O thread.

The sender creates the file, every page reserved (``posix_fallocate``: a
/dev/shm without room refuses it there, instead of a SIGBUS at the first
write), in the shape the room there allows (:mod:`ringcomm.shm.space`); the
receiver learns that shape from the file's size.  The receiver maps it when the first
notification arrives and unlinks the name at once, so nothing is left in
/dev/shm once both sides have it mapped (the sender also unlinks it at the
first ack, and the receiver at close if it never mapped it): a rank killed
with SIGKILL leaves no segment behind.

The files are private to the user running the job: created with mode 0600
(exclusively: never a file someone prepared under that name), and the receiver
maps only a file its own user owns with no group or other access.

Every file is made whole before it has a name (an unnamed ``O_TMPFILE``,
sized, then linked in), so a reader never sees it half made and a creator
killed while making it leaves nothing.  Its creator holds a shared ``flock``
on it for as long as it lives; the kernel drops that lock when the process
dies, however it dies.  A file left under a name by a creator that died
(SIGKILL before it could unlink it) is therefore known dead by its lock, not
by a pid that may have been reused, and the next creator of that name
reclaims it; a live creator's file is never touched.  This path
bypasses ZeroMQ and so its authentication and encryption; what protects it is
that only the job's user (or root) can open the file, the same users who can
read the ranks' memory anyway.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat

import numpy as np

from ..job import names
from . import space
from .reclaim import process_alive, process_visible, reclaim_dead, reclaim_if_dead

__all__ = ["MappedFile", "SlotRing", "available", "process_alive", "process_visible", "reclaim_if_dead",
           "reclaim_left_by_dead", "unlink"]

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
    at the first write: an :class:`OSError` with ``errno.ENOSPC`` whose message
    names the path, the bytes needed, the bytes free and the fix
    (:func:`ringcomm.shm.space.no_space_text`).  A creator finds a file of a dead creator under its
    name, removes it and creates its own; a live one's raises
    :class:`FileExistsError`.  ``named=False`` creates the file without a name:
    :meth:`name` gives it one later (once the ranks that will open it are
    known to exist), and until then a creator killed leaves nothing behind.
    """

    def __init__(self, path: str, nbytes: int, create: bool, reserve: bool = False, named: bool = True) -> None:
        self.path = path
        self._lock_fd = -1  # the creator's: open (and flock-ed shared) while this process has the file
        self._temp: str | None = None  # where the kernel cannot make unnamed files: the name it has until named
        self._named = not create  # whether ``path`` is this file's (a creator's file until it names it is not)
        if create:
            fd, self._temp = _unnamed(path, nbytes, reserve)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            if create:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if named:
                    self._lock_fd = fd
                    self.name()
            if not create:
                info = os.fstat(fd)
                if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
                    raise PermissionError(
                        f"shared-memory file {path} belongs to uid {info.st_uid} with mode "
                        f"{stat.S_IMODE(info.st_mode):o}; ringcomm maps only its own user's private files"
                    )
                if info.st_size != nbytes:
                    raise OSError(f"shared-memory file {path}: {info.st_size} bytes, expected {nbytes}")
            self._map = mmap.mmap(fd, nbytes)
        except BaseException:
            self._lock_fd = -1
            os.close(fd)
            if self._temp is not None:
                unlink(self._temp)
            raise
        if create:
            self._lock_fd = fd
        else:
            os.close(fd)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    def name(self) -> None:
        """Give a file created with ``named=False`` its path (a dead creator's file there is reclaimed;
        a live one's raises :class:`FileExistsError`)."""
        for attempt in range(2):
            try:
                _name(self._lock_fd, self._temp, self.path)
                self._temp, self._named = None, True
                return
            except FileExistsError:
                if attempt or not reclaim_if_dead(self.path):
                    raise FileExistsError(
                        errno.EEXIST, f"{os.strerror(errno.EEXIST)}: a live process created it (another job "
                        "with this job id is running on this host)", self.path) from None

    def unlink(self) -> None:
        """Remove the file's name (nothing if this creator never gave it one: the path is not its)."""
        if self._named:
            unlink(self.path)

    def close(self) -> None:
        self._bytes = np.zeros(0, np.uint8)
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the GC frees the map later
            pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self._temp is not None:
            unlink(self._temp)
            self._temp = None


def _unnamed(path: str, nbytes: int, reserve: bool) -> tuple[int, str | None]:
    """An open, sized file (mode 0600) beside ``path`` with no name yet, where the kernel can make
    one (``O_TMPFILE``); else under a temporary name of this process's.  Returns (fd, that name)."""
    temp = None
    try:
        fd = os.open(os.path.dirname(path), os.O_RDWR | os.O_TMPFILE, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        temp = f"{path}.{os.getpid()}.new"
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes) if reserve else os.ftruncate(fd, nbytes)
    except BaseException as exc:
        os.close(fd)  # the pages it got go with it
        if temp is not None:
            unlink(temp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.ENOMEM):
            free = space.free_bytes(os.path.dirname(path))
            raise OSError(exc.errno, space.no_space_text(path, nbytes, free)) from None
        raise
    return fd, temp


def _name(fd: int, temp: str | None, path: str) -> None:
    """Give the file ``fd`` the name ``path`` (FileExistsError if taken): atomically, whole."""
    if temp is not None:
        os.link(temp, path)
        unlink(temp)
        return
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:  # linkat(AT_SYMLINK_FOLLOW) through /proc: the way to name an O_TMPFILE file
        os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def reclaim_left_by_dead(directory: str = names.SHM_DIR) -> list[tuple[str, int]]:
    """Remove every ``ringcomm-*`` file in ``directory`` that this user's processes created and that
    no live process holds (:func:`reclaim_if_dead`): what jobs killed with SIGKILL before they could
    unlink their files left, whatever job they were.  Returns the ``(path, bytes)`` of each removed.

    A file being made under a temporary name (``...new``) by a live process is left alone: its
    creator takes the lock just after it opens it.
    """
    return reclaim_dead(os.path.join(directory, names.prefix("*") + "*"))


class SlotRing(MappedFile):
    """A mapped ring of equal slots; its creator reserves every page (:class:`MappedFile`)."""

    def __init__(self, path: str, slots: int, slot_bytes: int, create: bool) -> None:
        super().__init__(path, slots * slot_bytes, create, reserve=create)
        self.slots = slots
        self.slot_bytes = slot_bytes

    @classmethod
    def open(cls, path: str, segment_bytes: int) -> "SlotRing":
        """Map the ring another rank made at ``path``, in the shape its size tells
        (:func:`ringcomm.shm.space.geometry_of`; ``segment_bytes``: the job's segment size)."""
        nbytes = os.stat(path, follow_symlinks=False).st_size
        shape = space.geometry_of(nbytes, segment_bytes)
        if shape is None:
            raise OSError(errno.EINVAL, f"shared-memory file {path}: {nbytes} bytes is no ring of "
                          f"{segment_bytes}-byte slots (nor one slot of whole pages below that)")
        return cls(path, shape.slots, shape.slot_bytes, create=False)

    def slot(self, index: int, nbytes: int) -> np.ndarray:
        start = index * self.slot_bytes
        return self._bytes[start:start + nbytes]
