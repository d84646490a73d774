"""One end of the ZeroMQ PUSH->PULL ceiling stream (see :mod:`.ceiling`).

The ``pull`` end binds, receives ``warmup + count`` messages and writes the
throughput of the last ``count`` to ``--out``; the ``push`` end connects and
sends the same NumPy buffer ``warmup + count`` times without copying it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import zmq

from ._timing import start_watchdog


def push(addr: str, nbytes: int, total: int) -> None:
    """Send ``total`` messages of ``nbytes`` bytes, zero-copy, then wait until they are delivered."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(addr)
    buf = np.ones(nbytes, dtype=np.uint8)
    for _ in range(total):
        sock.send(buf, copy=False)  # type: ignore[call-overload]  # an ndarray is a buffer; the stubs do not say so
    sock.close(linger=-1)
    ctx.term()


def pull(addr: str, warmup: int, count: int) -> dict[str, float]:
    """Receive ``warmup + count`` messages; time the last ``count`` (from the end of the warmup)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    nbytes = 0
    for _ in range(warmup):
        sock.recv(copy=False)
    t0 = time.perf_counter()
    for _ in range(count):
        nbytes += len(sock.recv(copy=False))
    seconds = time.perf_counter() - t0
    sock.close(linger=0)
    ctx.term()
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bench._zmq_peer", description=__doc__)
    parser.add_argument("role", choices=("push", "pull"))
    parser.add_argument("--addr", required=True)
    parser.add_argument("--bytes", type=int, default=16 << 20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--out", help="pull: write the JSON result here")
    parser.add_argument("--deadline", type=float, default=300.0)
    args = parser.parse_args(argv)
    start_watchdog(args.deadline)
    if args.role == "push":
        push(args.addr, args.bytes, args.warmup + args.count)
        return 0
    result = pull(args.addr, args.warmup, args.count)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
    else:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
