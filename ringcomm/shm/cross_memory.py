"""Payloads read straight from a same-host peer's memory (``process_vm_readv``): one copy, not two.

Through a shared-memory slot a payload is copied twice: into the slot by its
sender and out of it by its receiver.  Linux lets a process read another
process's memory when it may trace it (the same user, and Yama's
``ptrace_scope`` or a container's seccomp profile allowing it), so a receiver
can copy a payload straight from the sender's array into its destination.

The protocol, on the pair's own socket (layouts in :mod:`ringcomm.core.wire`):

1. Before its first payload of at least ``min_bytes`` for a peer, a rank sends
   a probe (:data:`~ringcomm.core.wire.PROBE`): the address of a random token
   and the token.  The peer reads that address from the sender's pid and
   answers whether it found the token (:data:`~ringcomm.core.wire.PROBE_ANSWER`);
   a wrong pid (another pid namespace), Yama or seccomp all answer no.  Until a
   yes arrives, payloads go through the slots as before.
2. After a yes, such a payload travels as its address and length
   (:data:`~ringcomm.core.wire.REF`).  The receiver reads it at once, where the
   algorithm said it goes (``expect``) or into a buffer of its own, and answers
   :data:`~ringcomm.core.wire.READ`; the sender holds the array until then, and
   ``flush()`` waits for every answer (the link's rule that a sent array stays
   unchanged until ``flush()`` returns covers the rest).

:class:`CrossMemory` holds one rank's state of it and makes no I/O of its own
but the read; the data plane (``net/transport.py``) sends and receives the
messages.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import sys

import numpy as np

from ..core import wire
from ..core.buffers import SpareBuffers
from ..errors import ProtocolError

__all__ = ["CrossMemory", "SPARE_BYTES", "read_into", "unavailable_reason"]

log = logging.getLogger("ringcomm.shm.cross_memory")

#: The most bytes of read buffers a rank keeps for reuse.
SPARE_BYTES = 32 << 20
_READ = wire.READ.pack(b"B")


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_READV = _load()


def unavailable_reason() -> str | None:
    """Why this process cannot read another's memory at all (not Linux, no ``process_vm_readv``), or None."""
    if _READV is None:
        return "process_vm_readv is not available (Linux only)"
    return None


def address(arr: np.ndarray) -> int:
    """The address of ``arr``'s first byte in this process."""
    return int(arr.__array_interface__["data"][0])


def read_into(pid: int, remote: int, dest: np.ndarray) -> None:
    """Copy ``dest.nbytes`` bytes at address ``remote`` of process ``pid`` into ``dest`` (contiguous).

    Raises :class:`OSError` (``ESRCH``: the process is gone; ``EPERM``: not allowed; ``EFAULT``: no such
    memory there).  The call releases the GIL while the kernel copies.
    """
    if _READV is None:
        raise OSError(errno.ENOSYS, unavailable_reason())
    n = dest.nbytes
    local, there = _IoVec(), _IoVec()
    done = 0
    base = address(dest)
    while done < n:
        local.base, local.len = base + done, n - done
        there.base, there.len = remote + done, n - done
        got = _READV(pid, ctypes.byref(local), 1, ctypes.byref(there), 1, 0)  # type: ignore[operator]
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got == 0:
            raise OSError(errno.EFAULT, f"read nothing at {remote + done:#x} of process {pid}")
        done += got


class CrossMemory:
    """One rank's side of reading its same-host peers' payloads from their memory.

    ``min_bytes``: payloads of at least this many bytes go by reference once the peer said it can
    read this process (0: never; never where :func:`unavailable_reason` gives one).
    """

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes if unavailable_reason() is None else 0
        self._token = np.frombuffer(os.urandom(16), np.uint8).copy()
        self._pids: dict[int, int] = {}  # same-host peer -> its pid
        self._probed: set[int] = set()  # peers sent a probe
        self._readers: set[int] = set()  # peers that read this process's probe right
        self._lent: dict[int, collections.deque[np.ndarray]] = collections.defaultdict(collections.deque)
        self._expected: dict[int, dict[tuple[int, int], np.ndarray]] = collections.defaultdict(dict)
        self._spare = SpareBuffers(SPARE_BYTES)  # buffers read into where nothing was expected, given back

    def add_peer(self, peer: int, pid: int | None) -> None:
        """``peer`` shares this host; ``pid`` is its process id (None: unknown, never read)."""
        if pid is not None:
            self._pids[peer] = pid

    # -- sending --------------------------------------------------------------

    def probe(self, dst: int, nbytes: int) -> bytes | None:
        """The probe to send ``dst`` before a payload of ``nbytes``, the first time one would go by reference."""
        if not self.min_bytes or nbytes < self.min_bytes or dst in self._probed or dst not in self._pids:
            return None
        self._probed.add(dst)
        return wire.PROBE.pack(b"P", address(self._token), self._token.tobytes())

    def by_reference(self, dst: int, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` for ``dst`` goes as its address (``dst`` read the probe right)."""
        return bool(self.min_bytes) and nbytes >= self.min_bytes and dst in self._readers

    def lend(self, dst: int, payload: np.ndarray, seq: int, tag: int) -> bytes:
        """The message that sends ``payload`` (1-D uint8, contiguous) to ``dst`` by reference; held until read."""
        self._lent[dst].append(payload)
        return wire.REF.pack(b"R", address(payload), payload.nbytes, seq, tag)

    def answered(self, src: int, ok: bool) -> None:
        """``src`` answered this rank's probe."""
        if ok:
            self._readers.add(src)
        else:
            log.debug("rank %d cannot read this process's memory: payloads for it go through shared memory", src)

    def returned(self, src: int) -> bool:
        """``src`` has read the oldest payload lent to it; False if none was lent (a stray answer)."""
        lent = self._lent.get(src)
        if not lent:
            return False
        lent.popleft()
        return True

    def lent(self, dst: int) -> int:
        """How many payloads ``dst`` has yet to read."""
        lent = self._lent.get(dst)
        return len(lent) if lent else 0

    def lent_to(self) -> list[int]:
        """The peers with payloads yet to read."""
        return [peer for peer, lent in self._lent.items() if lent]

    # -- receiving ------------------------------------------------------------

    def answer(self, src: int, remote: int, token: bytes) -> bytes:
        """Read ``src``'s probe token at ``remote``; the answer to send back."""
        pid = self._pids.get(src)
        ok = False
        if self.min_bytes and pid is not None:
            got = np.empty(len(token), np.uint8)
            try:
                read_into(pid, remote, got)
                ok = got.tobytes() == token
            except OSError as exc:
                log.debug("cannot read rank %d's memory (pid %d): %s; its payloads come through shared memory "
                          "(Yama's kernel.yama.ptrace_scope, a seccomp profile, or another pid namespace)", src, pid, exc)
                ok = False
        return wire.PROBE_ANSWER.pack(b"Y", ok)

    def expect(self, src: int, seq: int, tag: int, view: np.ndarray) -> None:
        """The payload ``(seq, tag)`` from ``src``, if it comes by reference, goes to ``view`` (uint8)."""
        if src in self._pids and self.min_bytes and view.nbytes >= self.min_bytes:
            self._expected[src][(seq, tag)] = view

    def forget_before(self, src: int, seq: int) -> None:
        """Drop what :meth:`expect` was told for ``src``'s payloads of sequence numbers below ``seq``."""
        expected = self._expected.get(src)
        if expected:
            for key in [k for k in expected if k[0] < seq]:
                del expected[key]

    def settled(self, src: int, seq: int, tag: int) -> None:
        """The payload ``(seq, tag)`` from ``src`` came another way: forget where it was to go."""
        expected = self._expected.get(src)
        if expected:
            expected.pop((seq, tag), None)

    def read(self, src: int, remote: int, nbytes: int, seq: int, tag: int,
             max_bytes: int = 0) -> tuple[np.ndarray, bool]:
        """Read the payload ``src`` sent by reference: ``(its bytes, whether they are where expect() said)``.

        Raises :class:`OSError` when the read fails, ``ValueError`` when ``nbytes`` is not what was expected
        or more than ``max_bytes`` (a segment; 0: no bound).
        """
        if max_bytes and nbytes > max_bytes:
            raise ValueError(f"a payload of {nbytes} bytes by reference, more than a segment ({max_bytes} bytes)")
        view = self._expected[src].pop((seq, tag), None) if src in self._expected else None
        if view is not None and view.nbytes != nbytes:
            raise ValueError(f"a payload of {nbytes} bytes by reference where {view.nbytes} were expected")
        dest = view if view is not None else self._spare.take(nbytes)
        pid = self._pids.get(src)
        if pid is None:
            raise OSError(errno.ESRCH, f"no process id known for rank {src}")
        read_into(pid, remote, dest)
        return dest, view is not None

    def give_back(self, buf: np.ndarray) -> None:
        """``buf`` (from :meth:`read`, not placed) is no longer used: a later read of its size may reuse it."""
        self._spare.give(buf)

    def take(self, src: int, msg: wire.DataMessage,
             max_bytes: int = 0) -> tuple[bytes | None, tuple[np.ndarray, bool] | None]:
        """Apply one message of this protocol from ``src``: ``(the reply to send it or None, what :meth:`read`
        read for a payload sent by reference or None)``.  Raises :class:`ProtocolError` for a message that
        cannot be (a stray answer, a length that does not fit) and :class:`OSError` when a read fails."""
        if msg.kind == b"P":
            return self.answer(src, msg.address, msg.token), None
        if msg.kind == b"Y":
            self.answered(src, msg.ok)
            return None, None
        if msg.kind == b"B":
            if not self.returned(src):
                raise ProtocolError("an answer that a payload was read, with none sent by reference")
            return None, None
        try:
            got = self.read(src, msg.address, msg.nbytes, msg.seq, msg.tag, max_bytes)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc
        return _READ, got

    def close(self) -> None:
        self._lent.clear()
        self._expected.clear()
        self._spare.clear()
