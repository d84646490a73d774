"""Sharing device buffers and events between the processes of one host: torch's CUDA IPC
(:class:`CudaIpc`), and its model on the fake device (:class:`FakeIpc`): buffers are CPU tensors
in shared memory that the peer process maps, and events are two counters in shared memory
(recorded, happened) that stay *not happened* while the recording process's fake is held.

    ipc = ipc_for(ops)
    flat = ipc.shared_flat(n, torch.float32, device); handle = ipc.share(flat)   # rank 0
    peer = ipc.open_shared(handle, device)                                        # rank 1: the same memory
"""

from __future__ import annotations

import itertools
import os
import time
import weakref
from typing import Any

import numpy as np
import torch

from ringcomm.errors import HorovodInternalError
from ringcomm.shm import slots

from .device import DeviceOps, FakeEvent, FakeOps

__all__ = ["CudaIpc", "FakeIpc", "FakeIpcEvent", "ipc_for"]

#: How long a fake stream wait for a peer's event may take before it fails the op.
FAKE_WAIT_SECONDS = 120.0


class CudaIpc:
    """torch's CUDA IPC, as documented: ``reduce_tensor`` / rebuild, interprocess events."""

    def shared_flat(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def share(self, t: torch.Tensor) -> Any:
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(t)  # (rebuild function, its arguments): picklable

    def open_shared(self, handle: Any, device: torch.device) -> torch.Tensor:
        rebuild, args = handle
        return rebuild(*args)

    def event(self) -> Any:
        return torch.cuda.Event(interprocess=True)

    def event_handle(self, event: Any) -> Any:
        return event.ipc_handle()

    def open_event(self, handle: Any, device: torch.device) -> Any:
        return torch.cuda.Event.from_ipc_handle(device, handle)

    def peer_access(self, a: int, b: int) -> bool:
        return a == b or bool(torch.cuda.can_device_access_peer(a, b))

    def opened(self) -> None:
        """Every peer has opened this process's handles (nothing to do on CUDA)."""


class _Counters:
    """An interprocess fake event's state: ``[recorded, happened]`` in shared memory."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.arr = np.memmap(path, dtype=np.int64, mode="r+", shape=(2,))

    def set(self) -> None:  # the recorded work happened
        self.arr[1] = self.arr[0]

    def is_set(self) -> bool:
        return bool(self.arr[1] >= self.arr[0])

    def wait(self) -> None:
        target = int(self.arr[0])
        deadline = time.monotonic() + FAKE_WAIT_SECONDS
        while int(self.arr[1]) < target:
            if time.monotonic() > deadline:
                raise HorovodInternalError(f"fake device: a peer's event ({self.path}) did not happen within "
                                           f"{FAKE_WAIT_SECONDS} s")
            time.sleep(0.0005)


class FakeIpcEvent(FakeEvent):
    """An event another process of the host may wait for (see the module docstring)."""

    def __init__(self, path: str, foreign: bool) -> None:
        super().__init__()
        self.path = path
        self.foreign = foreign
        self.done = _Counters(path)

    def on_record(self) -> None:
        self.done.arr[0] += 1

    def on_stream_wait(self) -> None:
        if self.foreign:
            self.done.wait()


class FakeIpc:
    """The fake device's IPC: shared-memory CPU tensors and counters, their files unlinked once
    every peer opened them (:meth:`opened`).  Until then this process holds a shared ``flock`` on
    each, as every ``ringcomm-*`` file's creator does, so another job's sweep of files left by dead
    processes (:func:`ringcomm.shm.slots.reclaim_left_by_dead`) leaves them alone."""

    def __init__(self, ops: FakeOps) -> None:
        self._capable = ops.ipc
        self._made: list[slots.MappedFile] = []  # each held (its creator's lock) until unlinked
        self._handles: dict[int, tuple[str, int, str]] = {}
        weakref.finalize(self, _unlink, self._made)  # files nobody opened go at exit at the latest

    def _file(self, nbytes: int) -> str:
        # numbered per process, not per object: a new object may reuse a freed one's id(), and the
        # freed one's finalizer would then unlink the new one's files
        path = f"/dev/shm/ringcomm-fakeipc-{os.getpid()}-{next(_serial)}"
        self._made.append(slots.MappedFile(path, max(nbytes, 16), create=True))  # made and held as the runtime's
        return path

    def shared_flat(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        path = self._file(numel * dtype.itemsize)
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        self._handles[t.untyped_storage().data_ptr()] = (path, numel, str(dtype).replace("torch.", ""))
        return t

    def share(self, t: torch.Tensor) -> Any:
        return self._handles[t.untyped_storage().data_ptr()]

    def open_shared(self, handle: Any, device: torch.device) -> torch.Tensor:
        path, numel, dtype = handle
        return torch.from_file(path, shared=True, size=numel, dtype=getattr(torch, dtype))

    def event(self) -> Any:
        return FakeIpcEvent(self._file(16), foreign=False)

    def event_handle(self, event: Any) -> Any:
        return event.path

    def open_event(self, handle: Any, device: torch.device) -> Any:
        return FakeIpcEvent(handle, foreign=True)

    def peer_access(self, a: int, b: int) -> bool:
        return self._capable

    def opened(self) -> None:
        _unlink(self._made)


def _unlink(made: list[slots.MappedFile]) -> None:
    for f in made:
        f.unlink()  # the mappings stay
        f.close()
    made.clear()


_serial = itertools.count()
_fakes: "weakref.WeakKeyDictionary[FakeOps, FakeIpc]" = weakref.WeakKeyDictionary()
_cuda = CudaIpc()


def ipc_for(ops: DeviceOps, own: bool = False) -> CudaIpc | FakeIpc:
    """The IPC of ``ops``: the fake's own for a :class:`FakeOps`, else CUDA's.  ``own``: a fake IPC
    of its own, whose :meth:`FakeIpc.opened` unlinks only the files it made (a caller that shares
    at its own pace, not with the optimizer's buckets)."""
    if isinstance(ops, FakeOps):
        if own:
            return FakeIpc(ops)
        fake = _fakes.get(ops)
        if fake is None:
            fake = _fakes[ops] = FakeIpc(ops)
        return fake
    return _cuda
