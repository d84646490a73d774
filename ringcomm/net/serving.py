"""Rank 0's control step, run while its data plane waits for a peer's data.

Rank 0 hands its :class:`~ringcomm.net.control.Rank0Control` to
:meth:`~ringcomm.net.transport.DataPlane.serve_while_waiting`: the ops of
process sets without rank 0 are then answered while rank 0 waits inside a
transfer of its own, instead of after it.  The step returns nothing and starts
no transfer.
"""

from __future__ import annotations

import time
from typing import Protocol

import zmq

__all__ = ["ControlStep", "WaitServing"]


class ControlStep(Protocol):
    """A socket to watch while a receive waits, and the step to run when it is readable."""

    socket: zmq.Socket | None  # None: nothing to watch

    def step(self) -> None: ...


class WaitServing:
    """The control step a data plane runs while it waits (none until :meth:`serve` is called)."""

    def __init__(self) -> None:
        self.control: ControlStep | None = None
        self._pollers: dict[int, zmq.Poller] = {}

    def serve(self, control: ControlStep) -> None:
        """Run ``control.step()`` whenever ``control.socket`` is readable during a wait."""
        self.control = control
        self._pollers.clear()

    @property
    def socket(self) -> zmq.Socket | None:
        return self.control.socket if self.control is not None else None

    def step(self) -> None:
        if self.control is not None:
            self.control.step()

    def until_data(self, src: int, data: zmq.Socket, wake_fd: int | None) -> None:
        """Run the step until ``src``'s socket ``data`` (or ``wake_fd``, its streams' wake-up) is readable, or a
        slice passes: the receive's own wait, with its peer checks and timeout, takes over then."""
        ctrl = self.socket
        if ctrl is None:
            return
        poller = self._pollers.get(src)
        if poller is None:
            poller = self._pollers[src] = zmq.Poller()
            poller.register(data, zmq.POLLIN)
            poller.register(ctrl, zmq.POLLIN)
            if wake_fd is not None:
                poller.register(wake_fd, zmq.POLLIN)
        deadline = time.monotonic() + 1.0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            events = dict(poller.poll(max(1, int(left * 1000))))
            if ctrl in events:
                self.step()
            if data in events or not events or (wake_fd is not None and wake_fd in events):
                return
