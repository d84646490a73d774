"""``hvd.elastic``: Horovod's elastic training API for ``ringcomm_torch``.

Start with ``ringcomm-run -np 4 --min-np 2 --max-np 6 --host-discovery-script ./hosts.sh python train.py``::

    import ringcomm_torch as hvd

    hvd.init()
    model, sampler = ..., hvd.elastic.ElasticSampler(dataset)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < 5:
            for i, (x, y) in enumerate(loader):      # loader uses `sampler`
                ...; optimizer.step()
                state.sampler.record_batch(i, batch_size)
                if i % 10 == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)

On a lost worker the survivors roll back to the last commit, re-form with
the new membership and go on; new workers join at the next commit and get
the state from rank 0 (see :mod:`ringcomm.elastic.state`).
"""

from __future__ import annotations

from ringcomm.elastic.state import ObjectState, State, run, run_fn
from ringcomm.errors import HorovodInternalError, HostsUpdatedInterrupt

from .sampler import ElasticSampler, partition_indices
from .state import TorchState

__all__ = ["run", "run_fn", "State", "ObjectState", "TorchState", "ElasticSampler", "partition_indices",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
