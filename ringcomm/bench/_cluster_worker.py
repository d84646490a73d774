"""Benchmark worker for a user's own hosts: started by the ringcomm launcher on every rank.

One job times one system, chosen by ``--system``:

``ringcomm``
    ringcomm's allreduce (as :mod:`ringcomm.bench._rc_worker`).
``gloo``
    torch.distributed's gloo allreduce.  ringcomm is used only to agree on
    where gloo's store listens (rank 0's address, a port rank 0 found free),
    then shut down before gloo starts.
``exchange``
    the practical ceiling of the links between the hosts: the first rank of
    each host sends S bytes to the next host's first rank over one plain TCP
    connection while it receives S bytes from the previous host's (a thread
    sends, the main thread ``recv_into`` a preallocated buffer; no framing,
    no sum).  An allreduce of S bytes must move at least 2(H-1)/H x S bytes
    out of each of H hosts, so ``2(H-1)/H`` times this exchange's time is the
    most any allreduce can reach on these links from Python.  The other
    ranks only take part in the barriers, run through ringcomm.

``plain-ring``
    the least an allreduce adds to that exchange: a ring allreduce between the
    hosts' first ranks on the same plain connections, in Python, with nothing
    but what the algorithm needs (a thread sends, the main thread reads each
    segment with ``recv_into``, adds it with NumPy and queues it to be
    forwarded).  Its time over the exchange's is what the sum and the ring's
    order cost on these hosts' CPUs; a system's time over the ring's is what
    the system itself costs.  The other ranks only take part in the
    barriers, as for the exchange, so with several ranks per host it leaves
    out the reduction within each host.

    ringcomm-run -np 2 -H a:1,b:1 python -m ringcomm.bench._cluster_worker \\
        --system exchange --op allreduce --plan 67108864:10 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

import ringcomm as rc
from ringcomm import runtime
from ringcomm.core import ring
from ringcomm.errors import InvalidInputError
from ringcomm.job import netaddr
from ringcomm.job.config import Settings
from ringcomm.net.handshake import read_into

from . import _timing
from ._rc_worker import RingcommBackend

SYSTEMS = ("ringcomm", "gloo", "exchange", "plain-ring")
#: Seconds a host's first rank waits for the next host's to accept its connection.
CONNECT_SECONDS = 60.0


def _own_address() -> str:
    """The address this rank binds and advertises (RINGCOMM_NETWORK_INTERFACE's, or the one that routes)."""
    return runtime.current("the cluster benchmark").topo.addr


class ExchangeBackend(RingcommBackend):
    """Plain TCP between the hosts' first ranks, in a ring over the hosts; ringcomm for barriers and gathers."""

    name = "exchange"

    def __init__(self) -> None:
        super().__init__()
        self.hosts = rc.cross_size()
        self.leader = rc.local_rank() == 0
        if self.hosts < 2:
            raise SystemExit("the exchange needs ranks on 2 or more hosts (-H a:P,b:P); this job has one host")
        listener = None
        where: tuple[int, str, int] | None = None
        if self.leader:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((_own_address(), 0))
            listener.listen(1)
            where = (rc.cross_rank(), *listener.getsockname()[:2])
        leaders = {w[0]: (w[1], w[2]) for w in rc.allgather_object(where, name="bench.exchange.where") if w is not None}
        self._send: socket.socket | None = None
        self._recv: socket.socket | None = None
        if listener is not None:
            me = rc.cross_rank()
            self._send = socket.create_connection(leaders[(me + 1) % self.hosts], timeout=CONNECT_SECONDS)
            listener.settimeout(CONNECT_SECONDS)
            self._recv, _ = listener.accept()
            listener.close()
            for s in (self._send, self._recv):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rc.barrier()

    def _exchange(self, out: np.ndarray, into: np.ndarray) -> None:
        """Send ``out`` to the next host while receiving ``into`` from the previous one."""
        assert self._send is not None and self._recv is not None
        sender = threading.Thread(target=self._send.sendall, args=(out.view(np.uint8).data,), daemon=True)
        sender.start()
        view = into.view(np.uint8).data
        got = 0
        while got < len(view):
            n = self._recv.recv_into(view[got:])
            if not n:
                raise ConnectionError(f"rank {self.rank}: the previous host closed the exchange after {got} B")
            got += n
        sender.join()

    def prepare(self, op: str, count: int) -> tuple[Callable[[], None], Callable[[], None]]:
        if op != "allreduce":
            raise ValueError(f"the exchange stands for an allreduce's traffic, not {op!r}")
        out = np.zeros(count, dtype=np.float32)
        into = np.empty(count, dtype=np.float32)
        if not self.leader:
            return (lambda: None), (lambda: None)

        def step() -> None:
            self._exchange(out, into)

        def check() -> None:
            me = rc.cross_rank()
            out.fill(me + 1)
            step()
            if not np.all(into == (me - 1) % self.hosts + 1):
                raise RuntimeError(f"rank {self.rank}: the exchange delivered the wrong bytes")
            out.fill(0)
        return step, check

    def close(self) -> None:
        for s in (self._send, self._recv):
            if s is not None:
                s.close()
        super().close()


def plain_ring_allreduce(send: socket.socket, recv: socket.socket, me: int, hosts: int, buf: np.ndarray,
                         scratch: np.ndarray, seg_bytes: int = Settings.stream_segment_bytes) -> None:
    """Sum ``buf`` in place over a ring of ``hosts`` members, ``me`` among them, that sends to the next on
    ``send`` and receives from the previous on ``recv`` (``scratch``: a buffer of ``buf``'s size).

    A thread writes the queued segments; this thread reads each segment as it arrives, adds it (the
    reduce steps) and queues it for the next member, so sending, receiving and adding overlap."""
    bounds = ring.chunk_bounds(buf.size, hosts)
    seg = max(1, seg_bytes // buf.itemsize)
    outgoing: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
    failed: list[OSError] = []

    def write() -> None:
        try:
            while (view := outgoing.get()) is not None:
                send.sendall(view)
        except OSError as exc:
            failed.append(exc)
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        for a, b in ring.segments(*bounds[me], seg):
            outgoing.put(buf[a:b].view(np.uint8).data)
        # what arrives, in order: each reduce step's chunk, then each allgather step's
        steps = [((me - s - 1) % hosts, True) for s in range(hosts - 1)]
        steps += [((me - t) % hosts, False) for t in range(hosts - 1)]
        for i, (chunk, reduce) in enumerate(steps):
            for a, b in ring.segments(*bounds[chunk], seg):
                into = scratch[a:b] if reduce else buf[a:b]
                if not read_into(recv, into.view(np.uint8).data):
                    raise ConnectionError(f"ring member {me}: the previous member closed its connection")
                if reduce:
                    np.add(buf[a:b], into, out=buf[a:b])
                if i < len(steps) - 1:
                    outgoing.put(buf[a:b].view(np.uint8).data)
    except BaseException:
        outgoing.put(None)  # the writer ends after what it is writing; a member that stopped reading is the job's end
        raise
    outgoing.put(None)
    writer.join()
    if failed:
        raise ConnectionError(f"ring member {me}: sending to the next member failed: {failed[0]}")


class PlainRingBackend(ExchangeBackend):
    """:func:`plain_ring_allreduce` between the hosts' first ranks on the exchange's connections, in segments
    of ringcomm's default stream segment."""

    name = "plain-ring"

    def prepare(self, op: str, count: int) -> tuple[Callable[[], None], Callable[[], None]]:
        if op != "allreduce":
            raise ValueError(f"the plain ring is an allreduce, not {op!r}")
        buf = np.zeros(count, dtype=np.float32)  # zeros stay zeros: every timed op sums the same values
        scratch = np.empty(count, dtype=np.float32)
        if not self.leader:
            return (lambda: None), (lambda: None)

        def step() -> None:
            assert self._send is not None and self._recv is not None
            plain_ring_allreduce(self._send, self._recv, rc.cross_rank(), self.hosts, buf, scratch)

        def check() -> None:
            buf.fill(rc.cross_rank() + 1)
            step()
            if not np.all(buf == self.hosts * (self.hosts + 1) // 2):
                raise RuntimeError(f"rank {self.rank}: the plain ring summed wrong")
            buf.fill(0)
        return step, check


def interface_of(addr: str) -> str | None:
    """The name of this host's network interface that holds ``addr`` (None: none does)."""
    for _, name in socket.if_nameindex():
        try:
            if netaddr.interface_address(name) == addr:
                return name
        except InvalidInputError:  # an interface without an IPv4 address
            continue
    return None


def gloo_backend(timeout_s: float) -> Any:
    """gloo over every rank, its store at rank 0's address on a port rank 0 found free (told through ringcomm).

    gloo's connections leave from the interface that holds this rank's ringcomm address (GLOO_SOCKET_IFNAME,
    unless set): left to itself, gloo takes the address the host name resolves to, often 127.0.1.1."""
    from ._gloo_worker import GlooBackend

    rc.init()
    iface = interface_of(_own_address())
    if iface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    rank, size = rc.rank(), rc.size()
    store = None
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((_own_address(), 0))
            store = probe.getsockname()[:2]
    addr, port = rc.broadcast_object(store, 0, name="bench.gloo.store")
    rc.shutdown()
    return GlooBackend(rank, size, port, timeout_s, master_addr=addr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench._cluster_worker", description=__doc__)
    parser.add_argument("--system", choices=SYSTEMS, required=True)

    def backend(args: argparse.Namespace) -> Any:
        if args.system == "gloo":
            return gloo_backend(args.deadline)
        kinds = {"exchange": ExchangeBackend, "plain-ring": PlainRingBackend}
        return kinds.get(args.system, RingcommBackend)()
    return _timing.main(backend, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
