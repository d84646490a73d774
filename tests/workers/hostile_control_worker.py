"""A member of the job (it knows the secret) sends malformed control messages to rank 0.

Usage: ringcomm-run -np N python hostile_control_worker.py
Rank 1 opens a second DEALER to rank 0's control socket and sends authenticated
messages of the wrong structure, wrong field types, unknown cache ids and a body
nested 1000 deep (which used to kill rank 0's engine thread with RecursionError).
Every rank then runs checked collectives; prints ``hostile ok``.
"""

import os

import numpy as np
import zmq

import ringcomm as rc
from ringcomm.core import wire
from ringcomm.net.auth import Credentials

rc.init()
r, n = rc.rank(), rc.size()
secret = rc.runtime.active().engine.topo.secret
if r == 1:
    deep: list = ["leaf"]
    for _ in range(1000):
        deep = [deep]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.IDENTITY, b"intruder")
    sock.setsockopt(zmq.SNDTIMEO, 5000)  # a send never blocks the rank for good (rank 0 always reads)
    Credentials.derive(secret, "job").apply_client(sock)  # a member of the job: the handshake passes
    sock.connect(rc.runtime.active().engine.peer_table[0]["ctrl"][1])
    for msg in (
        ["req", 1, [["x", "allreduce", "float32", deep]]],
        ["req", 1, deep],
        ["req", 1, [["x", "allreduce", "float32", [[1]], 99]]],  # no such reduce op
        ["req", 1, [["x", "allreduce", "object", [[1]], 1]]],  # no such dtype
        ["req", 1, [123456]],  # an unknown response-cache id
        ["req", 1, [{"q": 1}]],  # a payload without its data
        ["req", 7, []],  # no such rank
        ["req", True, []],
        {"req": 1},
        ["resp", []],  # a response sent to the coordinator
        "req",
    ):
        sock.send(wire.pack_control(secret, msg))
    sock.send(os.urandom(100))  # and plain garbage
    sock.close()
    ctx.term()
rc.barrier()
for i in range(20):
    got = rc.allreduce(np.full(10 + i, r + 1.0), op=rc.Sum, name=f"h{i}")
    assert (got == n * (n + 1) / 2).all(), got
assert rc.broadcast(np.full(5, float(r)), 0, name="hb").tolist() == [0.0] * 5
rc.shutdown()
print("hostile ok", flush=True)
