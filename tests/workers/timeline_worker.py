"""Runs a known mix of allreduces with RINGCOMM_TIMELINE set; rank 0 writes the timeline.

- ``big``: one 4 MiB tensor, the ring with no fusion copy;
- ``fused``: a grouped allreduce of two 1 MiB tensors, copied into and out of the fusion buffer;
- ``small``: a 4 KiB allreduce, reduced at rank 0 from the payloads sent with the requests;
- ``medium``: a 100 KiB allreduce, past the rank-0 path: recursive doubling;
- ``gathered``: a small allgather (rank r gives r + 1 rows), gathered at rank 0 likewise.
"""

import numpy as np

import ringcomm as rc

rc.init()
n = rc.size()
big = rc.allreduce(np.full(1 << 20, rc.rank() + 1, np.float32), op=rc.Sum, name="big")
assert np.all(big == n * (n + 1) / 2)
a, b = rc.grouped_allreduce([np.ones(1 << 18, np.float32), np.ones(1 << 18, np.float32)], op=rc.Sum, name="fused")
assert np.all(a == n) and np.all(b == n)
small = rc.allreduce(np.ones(1024, np.float32), op=rc.Sum, name="small")
assert np.all(small == n)
medium = rc.allreduce(np.ones(25_600, np.float32), op=rc.Sum, name="medium")
assert np.all(medium == n)
g = rc.allgather(np.full((rc.rank() + 1, 2), rc.rank(), np.int32), name="gathered")
assert g.shape == (n * (n + 1) // 2, 2) and g[:, 0].tolist() == [r for r in range(n) for _ in range(r + 1)], g
print("timeline ops ok", flush=True)
rc.shutdown()
