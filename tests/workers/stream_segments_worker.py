"""One rank per host: large collectives cross in segments of RINGCOMM_STREAM_SEGMENT_BYTES over the streams.

Usage: python stream_segments_worker.py
Runs an allreduce, an allgather and a broadcast of some MiB, checks each against NumPy, then prints
"SEGMENTS <json>": how many payloads this rank streamed and its settings' segment sizes.
"""

from __future__ import annotations

import json

import numpy as np

import ringcomm as rc
from ringcomm import runtime

rc.init()
rank, size = rc.rank(), rc.size()
n = 3 * (1 << 20) + 5  # float32: 12 MiB and 20 B, two chunks of 6 MiB at two ranks
mine = np.arange(n, dtype=np.float32) % 1000 + rank
got = rc.allreduce(mine, op=rc.Sum, name="sum")
want = sum(np.arange(n, dtype=np.float32) % 1000 + r for r in range(size))
assert np.array_equal(got, want), "allreduce"
gathered = rc.allgather(np.full(n // 2, rank, np.float32), name="gather")
assert np.array_equal(gathered, np.repeat(np.arange(size, dtype=np.float32), n // 2)), "allgather"
sent = rc.broadcast(mine if rank == 0 else np.zeros(n, np.float32), 0, name="bcast")
assert np.array_equal(sent, np.arange(n, dtype=np.float32) % 1000), "broadcast"
rt = runtime.active()
print("SEGMENTS " + json.dumps({"rank": rank, "stream": rt.engine._link.stats.get("stream", 0),
                                "segment": rt.settings.segment_bytes,
                                "stream_segment": rt.settings.stream_segment_bytes}), flush=True)
rc.barrier()
rc.shutdown()
