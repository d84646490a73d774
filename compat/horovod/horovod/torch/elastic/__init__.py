"""``horovod.torch.elastic``: ringcomm_torch's elastic training API (``run``, ``TorchState``, ``ElasticSampler``)."""

from ringcomm_torch.elastic import (
    ElasticSampler,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    TorchState,
    run,
    run_fn,
)

from . import sampler, state  # noqa: F401

__all__ = ["run", "run_fn", "State", "ObjectState", "TorchState", "ElasticSampler", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
