"""Elastic training on one process: the sampler's re-partitioning (hypothesis), TorchState's
commit/restore/sync, and the ``run`` decorator's recovery loop with an injected reset."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ringcomm_torch as hvd
from ringcomm.elastic.state import ObjectState, run_fn
from ringcomm.errors import HostsUpdatedInterrupt, PeerLostError
from ringcomm_torch.elastic import ElasticSampler, TorchState, partition_indices


@given(st.integers(0, 60), st.integers(1, 7), st.data())
def test_partition_covers_remaining_indices_evenly(n, replicas, data):
    indices = data.draw(st.permutations(range(n)))
    parts = [partition_indices(indices, r, replicas) for r in range(replicas)]
    per_rank = -(-n // replicas)
    assert all(len(p) == per_rank for p in parts)
    everything = collections.Counter(i for p in parts for i in p)
    assert set(everything) == set(indices)
    assert sum(everything.values()) - n == per_rank * replicas - n < replicas  # padding only


@given(st.integers(1, 80), st.integers(1, 5), st.integers(1, 5), st.integers(0, 6), st.integers(1, 4),
       st.booleans(), st.integers(0, 3))
def test_sampler_repartitions_only_unprocessed_indices_after_a_reset(n, before, after, batches, batch_size,
                                                                       shuffle, epoch):
    """`before` ranks process some batches and commit; the world becomes `after` ranks; what they are
    handed is exactly what nobody processed, split evenly."""
    dataset = list(range(n))
    samplers = [ElasticSampler(dataset, shuffle=shuffle, seed=7) for _ in range(before)]
    for r, s in enumerate(samplers):
        s.set_epoch(epoch)
        s.reset(rank=r, num_replicas=before)
        for b in range(batches):
            s.record_batch(b, batch_size)
    processed = set().union(*(s.processed_indices for s in samplers))  # what the commit gathers
    saved = {"epoch": epoch, "processed_indices": processed}
    fresh = [ElasticSampler(dataset, shuffle=shuffle, seed=7) for _ in range(after)]
    for r, s in enumerate(fresh):
        s.load_state_dict(saved)
        s.reset(rank=r, num_replicas=after)
    handed = [list(s) for s in fresh]
    remaining = set(dataset) - processed
    assert set(i for h in handed for i in h) == remaining
    assert not processed & set(i for h in handed for i in h)
    assert len({len(h) for h in handed}) == 1 and len(fresh[0]) == len(handed[0])
    # the same epoch gives the same order on every rank and after every reset
    assert fresh[0].remaining_indices == [i for i in _epoch_order(n, shuffle, epoch) if i not in processed]


def _epoch_order(n: int, shuffle: bool, epoch: int) -> list[int]:
    s = ElasticSampler(list(range(n)), shuffle=shuffle, seed=7)
    s.set_epoch(epoch)
    return s.remaining_indices


def test_set_epoch_clears_progress_and_changes_the_shuffle():
    s = ElasticSampler(list(range(20)), shuffle=True, seed=1)
    first = list(s)
    s.record_batch(0, 5)
    assert len(s.processed_indices) == 5 and len(s) == 20
    s.reset()
    assert len(s) == 15
    s.set_epoch(1)
    assert not s.processed_indices and len(s) == 20 and list(s) != first


@pytest.fixture
def single():
    hvd.init()
    yield
    hvd.shutdown()


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def _train_step(model, opt):
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()


def test_torch_state_restore_returns_to_the_commit(single):
    model, opt = _model_and_opt()
    sampler = ElasticSampler(list(range(10)), shuffle=False)
    state = TorchState(model, opt, sampler=sampler, epoch=0)
    _train_step(model, opt)
    state.epoch = 1
    sampler.record_batch(0, 2)
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    _train_step(model, opt)
    state.epoch = 2
    sampler.record_batch(1, 2)
    assert not torch.equal(model.weight, committed["weight"])
    state.restore()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in committed.items())
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)
    assert state.epoch == 1 and sampler.processed_indices == {0, 1} and list(sampler) == list(range(2, 10))
    state.sync()  # size 1: rank 0's own state
    assert all(torch.equal(model.state_dict()[k], v) for k, v in committed.items())


def test_object_state_saves_deep_copies():
    state = ObjectState(bcast_object=lambda o: o, get_rank=lambda: 0, seen=[1])
    state.seen.append(2)
    state.restore()
    assert state.seen == [1]
    state.seen.append(3)
    state.save()
    state.seen.append(4)
    state.restore()
    assert state.seen == [1, 3]


def test_run_restores_on_a_lost_worker_and_resets_on_new_hosts():
    """The recovery loop: a HorovodInternalError rolls back to the commit; HostsUpdatedInterrupt does not."""
    events = []
    state = ObjectState(bcast_object=lambda o: o, get_rank=lambda: 0, step=0)
    state.register_reset_callbacks([lambda: events.append("callback")])
    calls = []

    def train(state):
        calls.append(state.step)
        if len(calls) == 1:
            state.step = 5
            state.save()            # commit at 5
            state.step = 7          # uncommitted progress, lost with the worker
            raise PeerLostError("lost rank 1")
        if len(calls) == 2:
            state.step = 9
            state.commit()
            raise HostsUpdatedInterrupt("new hosts")
        return state.step

    wrapped = run_fn(train, reset=lambda: events.append("reset"))
    assert wrapped(state) == 9
    assert calls == [0, 5, 9]  # restored to the commit after the loss; kept 9 after new hosts
    assert events == ["reset", "callback", "reset", "callback"]


def test_hvd_elastic_namespace():
    assert hvd.elastic.TorchState is TorchState and callable(hvd.elastic.run)
    assert issubclass(hvd.elastic.HostsUpdatedInterrupt, RuntimeError)
