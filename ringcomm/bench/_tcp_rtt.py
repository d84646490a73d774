"""A raw TCP round trip between two hosts: the link's floor for a small collective.

One process listens (``--serve``), the other connects and times, for every
``(bytes, iters)`` of the plan, a message of that many bytes sent and echoed
back over one TCP connection with Nagle's algorithm off: no framing, no
threads, no coordination.  ``bench crosshost`` runs it beside ringcomm and
gloo, as ``bench latency`` runs its socketpair round trip on one host.

    python -m ringcomm.bench._tcp_rtt --serve 10.0.0.2 --port 29999 --plan 4096:300
    python -m ringcomm.bench._tcp_rtt --connect 10.0.0.2 --port 29999 --plan 4096:300 --out rtt.json
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Sequence

from . import _timing

#: Seconds the client keeps trying to connect while the server starts.
CONNECT_SECONDS = 30.0


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def serve(host: str, port: int, plan: Sequence[tuple[int, int]], warmup: int) -> None:
    """Echo every message of the plan back to the one client, then return."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(1)
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for nbytes, iters in plan:
                buf = bytearray(nbytes)
                view = memoryview(buf)
                for _ in range(warmup + iters):
                    if not _recv_exactly(conn, view):
                        return
                    conn.sendall(view)


def connect(host: str, port: int, plan: Sequence[tuple[int, int]], warmup: int) -> list[dict[str, object]]:
    """Seconds per round trip for every ``(bytes, iters)`` of the plan, as the workers report them."""
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    results: list[dict[str, object]] = []
    with sock:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for nbytes, iters in plan:
            payload = bytes(nbytes)
            view = memoryview(bytearray(nbytes))
            times: list[float] = []
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                sock.sendall(payload)
                if not _recv_exactly(sock, view):
                    raise ConnectionError(f"the echo side closed the connection during the {nbytes} B round trips")
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            results.append({"bytes": nbytes, "times_s": times})
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench._tcp_rtt", description=__doc__.splitlines()[0])
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--serve", metavar="ADDR", help="listen on ADDR and echo")
    side.add_argument("--connect", metavar="ADDR", help="connect to ADDR and time")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--plan", required=True, help="BYTES:ITERS[,BYTES:ITERS...]")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", help="where the client writes its results (JSON)")
    parser.add_argument("--deadline", type=float, default=600.0, help="end the process after this many seconds")
    args = parser.parse_args(argv)
    _timing.start_watchdog(args.deadline)
    plan = _timing.parse_plan(args.plan)
    if args.serve:
        serve(args.serve, args.port, plan, args.warmup)
        return 0
    results = connect(args.connect, args.port, plan, args.warmup)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"results": results}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
