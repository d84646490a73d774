"""Removing shared-memory files whose creator died: the lock rule, on the standard library alone.

Every shared-memory file's creator holds a shared ``flock`` on it for as long as it lives
(:class:`ringcomm.shm.slots.MappedFile`); the kernel drops the lock when the process dies, however
it dies.  A file under a ringcomm name whose lock nobody holds was left by a dead creator and can
go; a live creator's file is never touched.

This module imports nothing but the standard library, so the launcher's parent guard (which runs
as a file, with no import path: :mod:`ringcomm.launch.guard`) loads it by its path and removes,
once its rank has died, whatever that rank left.
"""

from __future__ import annotations

import fcntl
import glob
import os
from collections.abc import Collection


def reclaim_if_dead(path: str) -> bool:
    """Remove the file at ``path`` if no live process holds its creator's lock; returns whether it is gone.

    Only this user's files are touched (another user's name squatted in /dev/shm stays and fails the
    creation, as before).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its creator is alive
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return True
        if (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino):  # still the dead creator's file
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return True
    finally:
        os.close(fd)


def process_visible(pid: int) -> bool:
    """Whether process ``pid`` exists in this process's view (another user's counts; so does a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs or is stopped in this process's view; False once it is gone or a zombie
    (it has ended; its parent has not collected it yet), or in another pid namespace."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def reclaim_dead(pattern: str, dead: Collection[int] = ()) -> list[tuple[str, int]]:
    """Remove every file matching the glob ``pattern`` that this user's processes created and that no
    live process holds (:func:`reclaim_if_dead`).  Returns the ``(path, bytes)`` of each removed.

    A file being made under a temporary name (``NAME.PID.new``, where the kernel cannot make unnamed
    files) is left alone while process ``PID`` may still be making it: its creator takes the lock
    just after it opens it.  ``dead``: pids known to be gone, although they may still be visible
    (a zombie not yet reaped).
    """
    removed = []
    for path in sorted(glob.glob(pattern)):
        if path.endswith(".new"):
            pid = path.rsplit(".", 2)[-2]
            if not pid.isdigit() or (int(pid) not in dead and process_visible(int(pid))):
                continue
        try:
            size = os.stat(path, follow_symlinks=False).st_size
        except OSError:
            continue
        if reclaim_if_dead(path) and not os.path.exists(path):
            removed.append((path, size))
    return removed
