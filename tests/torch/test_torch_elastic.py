"""Elastic training on one process: the sampler's re-partitioning (hypothesis), TorchState's
commit/restore/sync, and the ``run`` decorator's recovery loop with an injected reset."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import ringcomm_torch as hvd  # noqa: E402
from ringcomm.elastic.state import ObjectState, run_fn  # noqa: E402
from ringcomm.errors import HostsUpdatedInterrupt, PeerLostError  # noqa: E402
from ringcomm_torch.elastic import ElasticSampler, TorchState, partition_indices  # noqa: E402


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
def test_sampler_repartitions_only_unprocessed_samples_after_a_reset(n, before, after, batches, batch_size,
                                                                    shuffle, epoch):
    """`before` ranks step through some batches together and commit; the world becomes `after` ranks;
    what they are handed is exactly what nobody was handed in those batches, split evenly."""
    dataset = list(range(n))
    samplers = [ElasticSampler(dataset, shuffle=shuffle, seed=7) for _ in range(before)]
    handed_before: set[int] = set()
    for r, s in enumerate(samplers):
        s.set_epoch(epoch)
        s.reset(rank=r, num_replicas=before)
        for b in range(batches):
            handed_before.update(s.get_indices(b, batch_size))
            s.record_batch(b, batch_size)
    assert len({s.processed_num for s in samplers}) == 1
    assert samplers[0].processed_num == batches * batch_size * before
    saved = samplers[0].state_dict()
    fresh = [ElasticSampler(dataset, shuffle=shuffle, seed=7) for _ in range(after)]
    for r, s in enumerate(fresh):
        s.load_state_dict(saved)
        s.reset(rank=r, num_replicas=after)
    handed = [list(s) for s in fresh]
    order = _epoch_order(n, shuffle, epoch)
    remaining = order[saved["processed_num"]:]
    assert set(i for h in handed for i in h) == set(remaining)
    if len(handed_before) == min(n, saved["processed_num"]):  # no padding was handed out: exactly the rest
        assert set(remaining) == set(dataset) - handed_before
    assert len({len(h) for h in handed}) == 1 and len(fresh[0]) == len(handed[0])
    assert fresh[0].remaining_indices == remaining  # the same order on every rank and after every reset


def test_recorded_indices_are_left_out_after_a_reset_too():
    s = ElasticSampler(list(range(10)), shuffle=False)
    s.reset(rank=0, num_replicas=2)
    s.record_batch(0, 2)  # samples 0..3 done on both ranks
    s.record_indices([7, 9])  # and a rank that ran ahead did these
    saved = s.state_dict()
    assert saved == {"epoch": 0, "processed_num": 4, "processed_indices": {7, 9}}
    t = ElasticSampler(list(range(10)), shuffle=False)
    t.load_state_dict(saved)
    t.reset(rank=1, num_replicas=2)
    assert t.remaining_indices == [4, 5, 6, 8] and list(t) == [5, 8]
    t.load_state_dict({"epoch": 0, "processed_num": 6})  # a state without indices (as Horovod's)
    assert t.remaining_indices == [6, 7, 8, 9]


def test_horovod_style_epochs_repeat_until_set_epoch_and_count_on_one_rank():
    s = ElasticSampler(list(range(8)), shuffle=True)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, sampler=s)
    for epoch in range(2):
        s.set_epoch(epoch)
        for i, _ in enumerate(loader):
            s.record_batch(i, 2)
            assert s.processed_num == 2 * (i + 1)
    assert sum(1 for _ in loader) == 4  # no set_epoch: the same samples again, progress kept
    assert s.processed_num == len(s) == 8
    s.set_epoch(2)
    s.record_batch(0, 2)
    s.record_batch(1, 2)
    s.load_state_dict(s.state_dict())
    assert len(s) == 4 and sum(1 for _ in loader) == 2
    s.set_epoch(3)
    assert s.processed_num == 0 and len(s) == 8


def _epoch_order(n: int, shuffle: bool, epoch: int) -> list[int]:
    s = ElasticSampler(list(range(n)), shuffle=shuffle, seed=7)
    s.set_epoch(epoch)
    return s.remaining_indices


def test_set_epoch_clears_progress_and_changes_the_shuffle():
    s = ElasticSampler(list(range(20)), shuffle=True, seed=1)
    first = list(s)
    s.record_batch(0, 5)
    assert s.processed_num == 5 and len(s) == 20
    s.reset()
    assert len(s) == 15
    s.set_epoch(1)
    assert s.processed_num == 0 and not s.processed_indices and len(s) == 20 and list(s) != first


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
    assert state.epoch == 1 and sampler.processed_num == 2 and list(sampler) == list(range(2, 10))
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
