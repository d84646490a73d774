"""Linux futexes on 32-bit words in a shared mapping: sleep until a word changes, wake its sleepers.

Two processes that map the same file can meet on a word of it::

    waiter:  seen = word;  if not ready(): wait(addr, seen, 0.1)   # sleeps only while word == seen
    poster:  (update the shared state);  word = new value;  wake(addr)

``wait`` releases the GIL (a ctypes call) and returns on a wake, a change of
the word before it slept, a signal, or after ``timeout`` seconds: the caller
re-checks its condition every time, so a lost or spurious wake costs at most
one timeout.  Only Linux on x86-64 (ordered stores, a known syscall number):
:func:`available` says whether this platform has them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from collections.abc import Callable

_SYS_FUTEX = 202  # x86-64
#: Shared futexes (not FUTEX_PRIVATE_FLAG): the words live in a mapping several processes share.
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 2**31 - 1


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def timespec(seconds: float) -> Timespec:
    return Timespec(int(seconds), int((seconds % 1) * 1e9))


def available() -> bool:
    """Whether this platform has the futexes (Linux on x86-64: ordered stores, a known syscall)."""
    return sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")


_syscall: Callable[..., int] | None = None


def libc_syscall() -> Callable[..., int]:
    """libc's ``syscall`` through ctypes (errno kept), looked up once."""
    global _syscall
    if _syscall is None:
        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        _syscall = fn
    return _syscall


def wake(addr: int) -> None:
    """Wake every process sleeping on the word at ``addr``."""
    libc_syscall()(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


def wait(addr: int, seen: int, timeout: Timespec) -> bool:
    """Sleep while the word at ``addr`` holds ``seen``, at most ``timeout``; False when the time ran out."""
    if libc_syscall()(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(seen & 0xFFFFFFFF),
                      ctypes.byref(timeout), None, 0) != 0:
        err = ctypes.get_errno()
        if err == errno.ETIMEDOUT:
            return False
        if err not in (errno.EAGAIN, errno.EINTR):
            raise OSError(err, f"futex wait: {os.strerror(err)}")
    return True
