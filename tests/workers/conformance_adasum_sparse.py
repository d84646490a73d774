"""Conformance job: Adasum and sparse allreduce, each rank's result against a NumPy/dense reference.

Every rank rebuilds every other rank's inputs from seeds, computes the reference itself
and checks its own result (and that all ranks hold the same bits).  Adasum runs on
power-of-two job sizes; on others it must raise NotImplementedError (as Horovod's) and
leave the job usable.  Prints ``CONFORMANCE OK rank=R`` when every check passed.
"""

from __future__ import annotations

import numpy as np
import torch

import ringcomm as rc
import ringcomm_torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
POW2 = N & (N - 1) == 0


def ranks_agree(t: torch.Tensor, what: str) -> None:
    got = hvd.allgather_object(t.double().tolist())
    assert all(g == got[0] for g in got), f"rank {R}: {what}: ranks hold different results"


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    dot, na, nb = float(np.sum(a64 * b64)), float(np.sum(a64 * a64)), float(np.sum(b64 * b64))
    ca = 1.0 - dot / (2.0 * na) if na >= 2.0 ** -511 else 1.0  # sqrt(DBL_MIN), Horovod's bound
    cb = 1.0 - dot / (2.0 * nb) if nb >= 2.0 ** -511 else 1.0
    return (ca * a64 + cb * b64).astype(a.dtype)


def tree(vectors: list[np.ndarray]) -> np.ndarray:
    while len(vectors) > 1:
        vectors = [pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def rank_input(r: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + r)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * (r + 1)).to(dtype)


def close(got: torch.Tensor, want: np.ndarray, what: str, tol: float) -> None:
    assert got.shape == want.shape, f"rank {R}: {what}: shape {tuple(got.shape)} != {want.shape}"
    assert np.allclose(got.double().numpy(), want.astype(np.float64), rtol=tol, atol=tol), \
        f"rank {R}: {what}: got {got.flatten()[:4].tolist()}, expected {want.flatten()[:4].tolist()}"


def check_adasum_allreduce() -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12), (torch.float16, 2e-2)):
        shape = (5, 3)
        mine = rank_input(R, shape, dtype, 1)
        ins = [rank_input(r, shape, dtype, 1) for r in range(N)]
        pre, post = 0.5, 3.0
        got = hvd.allreduce(mine, op=hvd.Adasum, prescale_factor=pre, postscale_factor=post, name=f"ad.{dtype}")
        want = tree([(t.to(torch.float32 if dtype == torch.float16 else dtype) * pre).to(dtype).numpy().ravel()
                     for t in ins])
        want = (torch.from_numpy(want).to(torch.float32 if dtype == torch.float16 else dtype) * post).to(dtype)
        close(got, want.numpy().reshape(shape), f"allreduce Adasum {dtype}", tol)
        ranks_agree(got, f"allreduce Adasum {dtype}")
        assert torch.equal(mine, rank_input(R, shape, dtype, 1)), "the input was changed"
        # in place and async
        t = mine.clone()
        hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Adasum, prescale_factor=pre, postscale_factor=post))
        assert torch.equal(t, got), f"rank {R}: allreduce_async_ Adasum {dtype} differs from allreduce"
    # grouped: each tensor combined with its own dot product and norms
    shapes = [(4,), (2, 3), (7,)]
    mine = [rank_input(R, s, torch.float32, 10 + i) for i, s in enumerate(shapes)]
    got = hvd.grouped_allreduce(mine, op=hvd.Adasum, name="ad.grouped")
    for i, s in enumerate(shapes):
        want = tree([rank_input(r, s, torch.float32, 10 + i).numpy().ravel() for r in range(N)]).reshape(s)
        close(got[i], want, f"grouped_allreduce Adasum tensor {i}", 1e-5)
        ranks_agree(got[i], f"grouped_allreduce Adasum tensor {i}")
    # the NumPy core too
    arr = rank_input(R, (6,), torch.float64, 20).numpy()
    core = rc.allreduce(arr, op=rc.Adasum, name="ad.core")
    assert np.allclose(core, tree([rank_input(r, (6,), torch.float64, 20).numpy() for r in range(N)]), rtol=1e-12)


def check_adasum_refused() -> None:
    """Not a power of two: NotImplementedError naming the fix on every rank; the job goes on."""
    for call in (lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum),
                 lambda: hvd.grouped_allreduce([torch.ones(3)], op=hvd.Adasum),
                 lambda: rc.allreduce(np.ones(3), op=rc.Adasum)):
        try:
            call()
        except NotImplementedError as exc:
            assert "power-of-two" in str(exc) and f"has {N}" in str(exc), exc
        else:
            raise AssertionError(f"rank {R}: Adasum at size {N} did not raise")
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(N)] * 2


def _model(seed: int = 5) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()


def _batch(r: int, step: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(1000 * step + r), dtype=torch.float64)


def check_adasum_optimizer() -> None:
    lr = 0.1
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    ref = _model()
    for step in range(2):
        # reference: every rank's SGD step from the same start, the deltas combined with Adasum
        deltas: list[list[np.ndarray]] = []
        for r in range(N):
            m = _model()
            m.load_state_dict(ref.state_dict())
            m.zero_grad()
            (m(_batch(r, step)) ** 2).mean().backward()
            deltas.append([(-lr * p.grad).numpy().ravel() for p in m.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p.add_(torch.from_numpy(tree([d[i] for d in deltas]).reshape(p.shape)))
        opt.zero_grad()
        (model(_batch(R, step)) ** 2).mean().backward()
        opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            close(p.detach(), q.detach().numpy(), f"Adasum DistributedOptimizer step {step} {name}", 1e-10)
            ranks_agree(p.detach(), f"Adasum DistributedOptimizer {name}")
    opt.synchronize()  # a no-op with Adasum, as in Horovod
    try:
        with opt.skip_synchronize():
            pass
    except AssertionError:
        pass
    else:
        raise AssertionError("skip_synchronize with Adasum did not raise")


def _sparse_input(r: int) -> torch.Tensor:
    """Rank r touches r + 2 rows of a (6, 2) matrix, some shared with other ranks, one of them twice."""
    rows = torch.tensor([(3 * r + k) % 6 for k in range(r + 2)] + [r % 6])
    values = torch.arange(2 * len(rows), dtype=torch.float32).reshape(-1, 2) + 10 * r
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, (6, 2), check_invariants=False)


def check_sparse_allreduce() -> None:
    dense_sum = sum(_sparse_input(r).to_dense() for r in range(N))
    for op, want in ((hvd.Sum, dense_sum), (hvd.Average, dense_sum / N)):
        h = hvd.sparse_allreduce_async(_sparse_input(R), name=f"sp.{int(op)}", op=op)
        got = h()
        assert got.is_sparse and got.shape == (6, 2)
        assert torch.allclose(got.to_dense(), want, rtol=1e-6), f"rank {R}: sparse {op}: {got.to_dense()} != {want}"
    got = hvd.synchronize(hvd.sparse_allreduce_async(_sparse_input(R), op=hvd.Sum))
    assert torch.equal(got.coalesce().to_dense(), dense_sum)
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0, 2), (6, 2), check_invariants=False)
    assert torch.equal(hvd.sparse_allreduce_async(empty, name="sp.empty", op=hvd.Sum)().to_dense(), torch.zeros(6, 2))


def _embedding_model(sparse: bool) -> torch.nn.Module:
    torch.manual_seed(9)
    return torch.nn.Sequential(torch.nn.Embedding(8, 3, sparse=sparse), torch.nn.Linear(3, 1))


def _tokens(r: int) -> torch.Tensor:
    return torch.tensor([[r % 8, (r + 3) % 8, 1]])


def check_sparse_optimizer() -> None:
    # reference: the dense average of every rank's gradient
    grads = []
    for r in range(N):
        m = _embedding_model(sparse=False)
        m(_tokens(r)).sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    want = [sum(g[i] for g in grads) / N for i in range(2)]
    for kwargs in ({}, {"groups": 1}, {"sparse_as_dense": True}):
        model = _embedding_model(sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **kwargs)
        model(_tokens(R)).sum().backward()
        opt.synchronize()
        emb, lin = model[0].weight, model[1].weight
        assert emb.grad.is_sparse, kwargs  # sparse_as_dense reduces densely, and hands back the layout
        assert torch.allclose(emb.grad.to_dense(), want[0], atol=1e-6), f"rank {R}: {kwargs}: embedding grad"
        assert torch.allclose(lin.grad, want[1], atol=1e-6), f"rank {R}: {kwargs}: linear grad"
        with opt.skip_synchronize():
            opt.step()
        ranks_agree(emb.detach(), f"embedding after a sparse step {kwargs}")
    # SparseAdam takes only sparse gradients: the reduced gradient must stay sparse
    emb_model = torch.nn.Embedding(10, 3, sparse=True)
    hvd.broadcast_parameters(emb_model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb_model.parameters()), lr=0.1),
                                   named_parameters=emb_model.named_parameters())
    emb_model((torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) + R) % 10).sum().backward()
    opt.step()
    ranks_agree(emb_model.weight.detach(), "embedding after a SparseAdam step")


if POW2:
    check_adasum_allreduce()
    check_adasum_optimizer()
else:
    check_adasum_refused()
check_sparse_allreduce()
check_sparse_optimizer()
hvd.shutdown()
print(f"CONFORMANCE OK rank={R}", flush=True)
