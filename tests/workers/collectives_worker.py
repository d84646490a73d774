"""Runs a list of collective cases on every rank and checks each result against NumPy.

Usage: python collectives_worker.py CASES.json
Every rank can compute every other rank's input from the case's seed, so each
rank checks its own result locally.  Prints "CASE <i> OK" per case and exits
non-zero on the first wrong result.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import ringcomm as rc

OPS = {"sum": rc.Sum, "average": rc.Average, "min": rc.Min, "max": rc.Max, "product": rc.Product}


def data(seed: int, rank: int, shape, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.startswith("float"):
        return rng.uniform(-2, 2, shape).astype(dtype)
    return rng.integers(0, 3, shape).astype(dtype)


def ref_reduce(arrs: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    st = np.stack(arrs)
    if dtype == "bool":
        return {"sum": st.any(0), "max": st.any(0), "min": st.all(0), "product": st.all(0)}[op]
    if op == "average":
        if dtype.startswith("float"):
            return (st.astype(np.float64).sum(0) / len(arrs)).astype(dtype)
        return (st.sum(0).astype(np.float64) / len(arrs)).astype(dtype)
    f = {"sum": np.sum, "min": np.min, "max": np.max, "product": np.prod}[op]
    return f(st, axis=0).astype(dtype)


def close(got: np.ndarray, exp: np.ndarray, dtype: str, what: str) -> None:
    assert got.shape == exp.shape, f"{what}: shape {got.shape} != {exp.shape}"
    assert got.dtype == exp.dtype, f"{what}: dtype {got.dtype} != {exp.dtype}"
    if dtype.startswith("float"):
        tol = 2e-2 if dtype == "float16" else 1e-5
        np.testing.assert_allclose(got, exp, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, exp, err_msg=what)


def run_case(i: int, case: dict) -> None:
    r, n = rc.rank(), rc.size()
    kind, dtype, seed = case["kind"], case.get("dtype", "float32"), case["seed"]
    shape = tuple(case.get("shape", ()))
    what = f"case {i} {case}"
    if kind == "allreduce":
        op = case["op"]
        ins = [data(seed, k, shape, dtype) for k in range(n)]
        got = rc.allreduce(ins[r], op=OPS[op], name=f"c{i}")
        close(got, ref_reduce(ins, op, dtype), dtype, what)
    elif kind == "allgather":
        dims = case["dims"]  # per-rank dim 0
        ins = [data(seed, k, (dims[k % len(dims)], *shape), dtype) for k in range(n)]
        got = rc.allgather(ins[r], name=f"c{i}")
        close(got, np.concatenate(ins), dtype, what)
        total = sum(len(x) for x in ins)
        into = np.full((total, *shape), 7, dtype=ins[r].dtype)  # out= of the gathered shape: filled in place
        assert rc.allgather(ins[r], name=f"c{i}.out", out=into) is into, what
        close(into, np.concatenate(ins), dtype, what)
        bigger = np.zeros((total + 1, *shape), dtype=ins[r].dtype)  # a first dimension that does not fit
        got = rc.allgather(ins[r], name=f"c{i}.other", out=bigger)
        assert got is not bigger and not bigger.any(), what
        close(got, np.concatenate(ins), dtype, what)
        try:  # an out= of another dtype is refused on every rank, before any data moves
            rc.allgather(ins[r], name=f"c{i}.bad", out=np.zeros((total, *shape), dtype=np.int8 if dtype != "int8"
                                                              else np.int16))
            raise AssertionError(f"{what}: an out= of another dtype was taken")
        except rc.InvalidInputError as exc:
            assert "out= must be a C-contiguous array" in str(exc), exc
    elif kind == "broadcast":
        root = case["root"] % n
        ins = [data(seed, k, shape, dtype) for k in range(n)]
        close(rc.broadcast(ins[r], root, name=f"c{i}"), ins[root], dtype, what)
        mine = ins[r].copy()  # in place (out=): the data land in the caller's array, nothing new
        assert rc.broadcast(mine, root, name=f"c{i}.inplace", out=mine) is mine, what
        close(mine, ins[root], dtype, what)
        other = np.zeros_like(ins[r])  # into another array: the input stays as it was
        assert rc.broadcast(ins[r], root, name=f"c{i}.out", out=other) is other, what
        close(other, ins[root], dtype, what)
        close(ins[r], data(seed, r, shape, dtype), dtype, what)
    elif kind == "alltoall":
        rng = np.random.default_rng(seed)
        splits = rng.integers(0, 4, (n, n))
        ins = [data(seed, k, (int(splits[k].sum()), *shape), dtype) for k in range(n)]
        out, rsplits = rc.alltoall(ins[r], splits=splits[r], name=f"c{i}")
        offs = [np.concatenate([[0], np.cumsum(splits[k])]) for k in range(n)]
        exp = np.concatenate([ins[k][offs[k][r]:offs[k][r + 1]] for k in range(n)])
        close(out, exp, dtype, what)
        np.testing.assert_array_equal(rsplits, splits[:, r])
        into = np.full(exp.shape, 7, dtype=exp.dtype)  # out= of the received shape: filled in place
        assert rc.alltoall(ins[r], splits=splits[r], name=f"c{i}.out", out=into)[0] is into, what
        close(into, exp, dtype, what)
        bigger = np.zeros((len(exp) + 1, *shape), dtype=exp.dtype)  # a first dimension that does not fit
        got, _ = rc.alltoall(ins[r], splits=splits[r], name=f"c{i}.other", out=bigger)
        assert got is not bigger and not bigger.any(), what
        close(got, exp, dtype, what)
        # one array for each rank, sent from where it lies, into one output for each rank
        parts = [ins[r][offs[r][k]:offs[r][k + 1]] for k in range(n)]
        outs = [np.full((int(splits[k, r]), *shape), 7, dtype=exp.dtype) for k in range(n)]
        res, rsplits = rc.alltoall(parts, name=f"c{i}.each", out=outs, received_splits=splits[:, r])
        assert isinstance(res, list) and len(res) == n and all(a is b for a, b in zip(res, outs)), what
        close(np.concatenate(outs), exp, dtype, what)
        np.testing.assert_array_equal(rsplits, splits[:, r])
        close(rc.alltoall(parts, name=f"c{i}.parts")[0], exp, dtype, what)
        bads = [(np.zeros(exp.shape, dtype=np.int8 if dtype != "int8" else np.int16), "out= must be")]
        if all(x.size for x in ins):  # every rank's array is one an out= can share memory with
            bads.append((ins[r], "shares memory"))
        for j, (bad, why) in enumerate(bads):  # refused on every rank, before any data moves
            try:
                rc.alltoall(ins[r], splits=splits[r], name=f"c{i}.bad{j}", out=bad)
                raise AssertionError(f"{what}: out= {why} was taken")
            except rc.InvalidInputError as exc:
                assert why in str(exc), exc
    elif kind == "reducescatter":
        op = case["op"]
        rows = case["rows"]
        ins = [data(seed, k, (rows, *shape), dtype) for k in range(n)]
        got = rc.reducescatter(ins[r], op=OPS[op], name=f"c{i}")
        full = ref_reduce(ins, op, dtype)
        counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
        start = sum(counts[:r])
        close(got, full[start:start + counts[r]], dtype, what)
    elif kind == "concurrent":
        # many tensors, submitted in a different random order on every rank
        count = case["count"]
        order = np.random.default_rng([seed, r]).permutation(count)
        sizes = np.random.default_rng(seed).integers(0, 3000, count)
        handles = {}
        for j in order:
            handles[j] = rc.allreduce_async(np.full(sizes[j], float(r + j), np.float32), op=rc.Sum, name=f"c{i}.{j}")
        for j in range(count):
            exp = np.full(sizes[j], float(sum(k + j for k in range(n))), np.float32)
            close(rc.synchronize(handles[j]), exp, "float32", f"{what} tensor {j}")
    elif kind == "join":
        # rank k has k+1 batches; others keep reducing while the short ranks have joined
        mine = case["base"] + r
        for step in range(mine):
            got = rc.allreduce(np.ones(4, np.float32), op=rc.Sum, name=f"c{i}.step")
            active = sum(1 for k in range(n) if case["base"] + k > step)
            close(got, np.full(4, float(active), np.float32), "float32", f"{what} step {step}")
        last = rc.join()
        assert last == n - 1, f"{what}: join returned {last}"
    elif kind == "mismatch":
        try:
            rc.allreduce(np.ones(2 + r, np.float32), name=f"c{i}")
        except rc.MismatchError as exc:
            assert "shape" in str(exc) and "rank 0" in str(exc), str(exc)
        else:
            assert n == 1, f"{what}: mismatch not detected"
        close(rc.allreduce(np.ones(3, np.float32), op=rc.Sum, name=f"c{i}.after"),
              np.full(3, float(n), np.float32), "float32", what)
    else:
        raise ValueError(kind)


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    rc.init()
    for i, case in enumerate(cases):
        run_case(i, case)
        print(f"CASE {i} OK", flush=True)
    rc.barrier()
    rc.shutdown()


if __name__ == "__main__":
    main()
