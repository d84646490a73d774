"""Data-parallel linear regression with the NumPy core, no framework needed.

    ringcomm-run -np 4 python examples/numpy_linear_regression.py

Every rank holds a different shard of a synthetic data set; each step every
rank computes its local gradient and ``ringcomm.allreduce`` averages them, so
all ranks take the same step and keep identical weights.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ringcomm as rc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--rows-per-rank", type=int, default=2048)
    args = parser.parse_args()

    rc.init()
    rank, size = rc.rank(), rc.size()
    truth = np.random.default_rng(0).normal(size=args.features)  # the same on every rank
    rng = np.random.default_rng(1 + rank)  # a different shard on every rank
    x = rng.normal(size=(args.rows_per_rank, args.features))
    y = x @ truth + 0.01 * rng.normal(size=args.rows_per_rank)

    w = rng.normal(size=args.features)
    w = rc.broadcast(w, root_rank=0, name="init.w")  # start from rank 0's weights
    start = time.perf_counter()
    for step in range(args.steps):
        grad = 2 * x.T @ (x @ w - y) / len(y)
        grad = rc.allreduce(grad, name="grad")  # Average over ranks
        w -= args.lr * grad
        if step % 50 == 0 or step == args.steps - 1:
            loss = rc.allreduce(np.array(np.mean((x @ w - y) ** 2)), name="loss")
            if rank == 0:
                print(f"step {step:4d}  loss {float(loss):.6f}", flush=True)
    elapsed = time.perf_counter() - start
    weights = rc.allgather(w[None, :], name="final.w")
    assert np.allclose(weights, weights[0]), "ranks disagree on the weights"
    err = float(np.abs(w - truth).max())
    if rank == 0:
        print(f"{size} ranks, {args.steps} steps in {elapsed:.2f} s; max |w - truth| = {err:.4f}", flush=True)
    rc.shutdown()


if __name__ == "__main__":
    main()
