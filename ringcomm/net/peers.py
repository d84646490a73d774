"""Whether the peers of a data plane are still there: connection events, process checks, notices.

A :class:`PeerWatch` reads the ZeroMQ monitor of each peer's socket (a
completed handshake, a closed connection), checks same-host peers' processes,
and keeps the notices a failing peer sends before it leaves (``L``: the rank
it lost), so that the error every survivor raises names the rank that failed
first.  A failing rank with same-host peers it never connected to (no socket
carries its notice to them) also leaves the notice in a file they read.  The
data plane (:mod:`.transport`) owns the sockets; this object only watches them
and sends the one notice of its own rank's loss.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable
from typing import cast

import zmq

from ..core import wire
from ..errors import PeerLostError, ProtocolError
from ..shm.reclaim import process_alive

log = logging.getLogger("ringcomm.net.transport")

#: A socket monitor's first frame: the event's id and value (libzmq's zmq_socket_monitor).
_MONITOR_HEAD = struct.Struct("=Hi")
#: Seconds a closed connection on a bound socket is re-checked: the peer's own closing detaches it
#: from the socket within milliseconds; a stranger's (refused, or a port scan) never attached
_SUSPECT_SECONDS = 1.0
#: A bound socket found without its peer this long after a connection closed has lost the peer
#: (not sooner: ZeroMQ attaches a newly authenticated connection a moment after reporting it)
_DETACHED_SECONDS = 0.1


class PeerWatch:
    """The liveness of one rank's peers, read from the sockets the data plane owns."""

    def __init__(self, rank: int, size: int, timeout: float, socks: dict[int, zmq.Socket], slots: int,
                 slot_bytes: int, notice_path: Callable[[int], str] | None = None) -> None:
        """``socks``: the data plane's peer -> socket map (shared, not copied); ``timeout``: the peer timeout;
        ``notice_path``: where a rank's notice file is (rank -> path; None: no notice files)."""
        self.rank, self.size, self.timeout = rank, size, timeout
        self.notice_path = notice_path
        self.socks = socks
        self.slots, self.slot_bytes = slots, slot_bytes
        self.monitors: dict[int, zmq.Socket] = {}  # peer -> socket reporting its connection's end
        self.local_pids: dict[int, int] = {}  # same-host peers' process ids
        self.authenticated: set[int] = set()  # peers whose connection completed its handshake
        #: peers whose connection has not completed its handshake yet: peer -> since when this rank
        #: waits for it.  A peer that died after the rendezvous but before connecting leaves no
        #: connection to lose: it is lost once its process is gone (same host) or after the peer timeout.
        self.unconnected: dict[int, float] = {}
        self.never_connected: set[int] = set()
        #: peers whose bound socket saw a connection close (the peer's, or a stranger's): peer ->
        #: when; re-checked until the peer is found gone or still attached after _SUSPECT_SECONDS
        self.suspects: dict[int, float] = {}
        self.lost: dict[int, str] = {}  # peers whose connection closed
        #: peer -> the rank it reported losing (its notice arrived before it left): the first loss
        #: travels with the failure, so a survivor whose neighbour failed *because of* another rank
        #: names that rank
        self.reports: dict[int, int] = {}
        self.noticed = False  # this rank told its peers which rank it lost
        self.peer_names: dict[int, str] = {}

    def watch(self, peer: int, sock: zmq.Socket) -> None:
        """Follow ``sock``'s connection events (the socket for ``peer``)."""
        self.monitors[peer] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def expect(self, peer: int, description: str, pid: int | None) -> None:
        """``peer`` (``description``: its host and process) is to connect; ``pid`` when on this host."""
        self.peer_names[peer] = description
        if peer not in self.authenticated:
            self.unconnected.setdefault(peer, time.monotonic())
        if pid:
            self.local_pids[peer] = int(pid)

    def noted(self, src: int, lost: int) -> None:
        """``src`` sent its notice that it lost rank ``lost`` (it is failing)."""
        self.reports.setdefault(src, lost)
        if lost != self.rank:
            self.lost.setdefault(lost, self.peer_names.get(lost, "?"))

    def close(self) -> None:
        """Stop watching (before the data plane closes its sockets)."""
        for peer, mon in self.monitors.items():
            try:
                self.socks[peer].disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(0)
        self.monitors.clear()

    def check_peers(self) -> dict[int, str]:
        """Read pending connection events; returns the peers found lost by this call."""
        found: dict[int, str] = {}
        for peer, mon in self.monitors.items():
            while True:
                try:
                    event = _MONITOR_HEAD.unpack(mon.recv_multipart(zmq.NOBLOCK)[0])[0]
                except zmq.Again:
                    break
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    # only the peer holds the credentials, so only its connection gets this far
                    self.authenticated.add(peer)
                    self.unconnected.pop(peer, None)
                elif event == zmq.EVENT_DISCONNECTED and peer not in self.lost:
                    self.suspects.setdefault(peer, time.monotonic())
        now = time.monotonic()
        for peer, since in sorted(self.suspects.items()):
            if self.is_gone(peer, now - since):
                del self.suspects[peer]
                self.lost[peer] = found[peer] = self.peer_names.get(peer, "?")
            elif now - since > _SUSPECT_SECONDS:
                del self.suspects[peer]
                log.debug("rank %d: a connection to the socket for rank %d closed, but rank %d is still "
                          "attached: a stranger (refused at the handshake, or a port scan)", self.rank, peer, peer)
        for peer, since in sorted(self.unconnected.items()):
            pid = self.local_pids.get(peer)
            if (pid is not None and not process_alive(pid)) or now - since > self.timeout:
                del self.unconnected[peer]
                self.never_connected.add(peer)
                self.lost[peer] = found[peer] = self.peer_names.get(peer, "?")
        return found

    def is_gone(self, peer: int, suspected_for: float) -> bool:
        """Whether a closed connection on ``peer``'s socket means the peer itself is gone.

        This rank connected to lower-ranked peers: only the peer can be on the other end.
        It bound the socket for higher-ranked peers, so anyone may connect and leave (a port
        scan, a refused stranger): there the peer is gone once its process is (same host), or
        once its authenticated connection is no longer attached to the socket (any host).
        """
        if peer < self.rank:
            return True
        pid = self.local_pids.get(peer)
        if pid is not None and not process_alive(pid):
            return True
        return peer in self.authenticated and suspected_for >= _DETACHED_SECONDS and not self.attached(peer)

    def attached(self, peer: int) -> bool:
        """Whether the bound socket for ``peer`` has its peer's connection attached.

        A PAIR socket is writable exactly while its one pipe is attached (no send limit is set),
        and only an authenticated connection ever gets that pipe.  Reading ``EVENTS`` first
        applies the commands ZeroMQ's I/O thread has posted, such as a pipe's termination.
        """
        sock = self.socks.get(peer)
        return sock is not None and bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT)

    def raise_if_lost(self, awaited: int, what: str = "data", sending: bool = False) -> None:
        """Raise :class:`PeerLostError` if a peer is found gone, naming the rank that failed first."""
        self.check_peers()
        if self.lost:
            where = f"for {what} to rank {awaited}" if sending else f"for {what} from rank {awaited}"
            raise self.lost_error(self.culprit(awaited), f" while rank {self.rank} waited {where}")

    def culprit(self, awaited: int = -1) -> int:
        """The rank to blame among the lost ones: the one a lost peer reported losing before it left.

        A rank that fails because its neighbour died leaves the job too, and this rank may see
        that departure first; the notice it sent on its way out (or left in a file, for a same-host
        rank it never connected to) names the rank it lost.  Without notices: a lost peer that never
        connected, the awaited peer if it is lost, else the lowest lost rank.
        """
        # A same-host peer still awaited whose process has ended is lost too: the rank that lost it
        # may leave before this rank's next check.
        for peer in sorted(self.unconnected):
            pid = self.local_pids.get(peer)
            if pid is not None and not process_alive(pid):
                del self.unconnected[peer]
                self.never_connected.add(peer)
                self.lost[peer] = self.peer_names.get(peer, "?")
        for peer in list(self.lost):
            self.read_notices(peer)
            if peer not in self.reports:
                self.read_notice_file(peer)
        blamed = [r for r in (self.reports.get(p) for p in sorted(self.lost)) if r is not None and r != self.rank]
        if blamed:
            root = blamed[0]
            for _ in range(self.size):  # follow a chain of reports to the first loss
                nxt = self.reports.get(root)
                if nxt is None or nxt == self.rank or nxt == root:
                    break
                root = nxt
            return root
        # a peer that never connected failed before any op could run: it comes first (its notice of
        # the loss may not have reached this rank, whose connection to the notifier was not yet made,
        # or whose notifier left before the notice went out).
        never = sorted(p for p in self.lost if p in self.never_connected)
        if never:
            return never[0]
        return awaited if awaited in self.lost else min(self.lost)

    def read_notices(self, peer: int) -> None:
        """Read what a lost peer left in its socket, keeping only its notice of a lost rank."""
        sock = self.socks.get(peer)
        while sock is not None:
            try:
                frames = sock.recv_multipart(copy=True, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            try:
                msg = wire.parse_data(frames[0], len(frames), self.slots, self.slot_bytes)
            except ProtocolError:
                continue
            if msg.kind == b"L":
                self.reports.setdefault(peer, msg.lost)

    def read_notice_file(self, peer: int) -> None:
        """Read the notice a lost same-host ``peer`` left in a file, if it left one in this job.

        The file names the writer's process: one from another job (a job id derived alike, after a
        restart) or another process names a pid this rank does not know for ``peer`` and is ignored.
        """
        pid = self.local_pids.get(peer)
        if self.notice_path is None or pid is None:
            return
        try:
            with open(self.notice_path(peer)) as f:
                writer, lost = (int(v) for v in f.read().split())
        except (OSError, ValueError):
            return
        if writer == pid and lost != peer:
            self.reports.setdefault(peer, lost)

    def lost_error(self, peer: int, context: str = "", how: str = "") -> PeerLostError:
        """The error naming ``peer``, with how its loss was learned (``how``, when the caller knows); tells
        the other peers, once."""
        name = self.peer_names.get(peer, "?")
        reporters = sorted(p for p, r in self.reports.items() if r == peer)
        how = how or self._how_lost(peer, reporters)
        if reporters and (peer in self.lost):
            how += f"; rank {reporters[0]} reported losing it too"
        self.notify_lost(peer)
        return PeerLostError(f"rank {self.rank}: lost rank {peer} ({name}): {how}{context}")

    def _how_lost(self, peer: int, reporters: list[int]) -> str:
        pid = self.local_pids.get(peer)
        if peer not in self.lost and reporters:
            return (f"rank {reporters[0]} reported losing it and left the job (rank {peer}'s own connection to "
                    "this rank had not closed yet)")
        if peer in self.never_connected:
            return ("it never connected to this rank after the rendezvous: "
                    + (f"its process (pid {pid}) ended" if pid is not None and not process_alive(pid)
                       else f"nothing for {self.timeout:g} s (RINGCOMM_PEER_TIMEOUT)"))
        if pid is not None and not process_alive(pid):
            return f"its process (pid {pid}) ended"
        return (f"its connection closed: the process died, left the job, or stopped answering heartbeats for "
                f"{self.timeout:g} s (RINGCOMM_PEER_TIMEOUT)")

    def notify_lost(self, peer: int) -> None:
        """Tell every other connected peer that this rank lost ``peer`` (best effort, never blocks)."""
        if self.noticed:
            return
        self.noticed = True
        for other, sock in self.socks.items():
            if other == peer or other in self.lost:
                continue
            try:
                sock.send(wire.LOST.pack(b"L", peer), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.leave_notice_file(peer)

    def leave_notice_file(self, peer: int) -> None:
        """Leave the notice in a file when a same-host peer never connected to this rank: no socket reaches
        it, and once this rank has left it would find two ranks gone with nothing to tell which failed first.
        The launcher's clean-up, or the next job's sweep of files no live process holds, removes the file."""
        waiting = [p for p in self.local_pids if p != peer and p not in self.authenticated and p not in self.lost]
        if self.notice_path is None or not waiting:
            return
        path = self.notice_path(self.rank)
        temp = f"{path}.{os.getpid()}.new"  # named whole: a reader never sees half of it
        try:
            with open(temp, "w") as f:
                f.write(f"{os.getpid()} {peer}\n")
            os.replace(temp, path)
        except OSError as exc:
            log.debug("rank %d: could not leave the notice of losing rank %d in %s: %s", self.rank, peer, path, exc)

