"""``horovod.torch.optimizer``: ringcomm_torch's ``DistributedOptimizer``."""

from ringcomm_torch.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
