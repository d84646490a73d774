"""``horovod.torch.elastic.state``: ringcomm_torch's ``TorchState``."""

from ringcomm_torch.elastic.state import TorchState

__all__ = ["TorchState"]
