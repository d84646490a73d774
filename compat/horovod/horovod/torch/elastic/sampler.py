"""``horovod.torch.elastic.sampler``: ringcomm_torch's ``ElasticSampler``."""

from ringcomm_torch.elastic.sampler import ElasticSampler

__all__ = ["ElasticSampler"]
