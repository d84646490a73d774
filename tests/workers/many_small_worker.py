"""Many small allreduces in flight at once: rank 0 reduces them and answers in one cycle.

Usage: ringcomm-run -np N python many_small_worker.py COUNT
Each op is 128 KiB (run it with RINGCOMM_SMALL_ALLREDUCE_BYTES=131072), so COUNT=700 puts ~90 MiB of
results into one cycle's responses: more than one control frame may carry.
Prints ``many small ok`` once every result is right.
"""

from __future__ import annotations

import sys

import numpy as np

import ringcomm as rc


def main() -> None:
    count = int(sys.argv[1])
    rc.init()
    r, n = rc.rank(), rc.size()
    handles = [rc.allreduce_async(np.full(32768, float(r + i), np.float32), op=rc.Sum, name=f"t{i}")
               for i in range(count)]
    for i, h in enumerate(handles):
        got = rc.synchronize(h)
        expected = float(sum(k + i for k in range(n)))
        assert got.shape == (32768,) and (got == expected).all(), (i, got[:3], expected)
    rc.barrier()
    print("many small ok", flush=True)
    rc.shutdown()


if __name__ == "__main__":
    main()
