"""``horovod.torch.functions``: ringcomm_torch's parameter, optimizer-state and object broadcasts."""

from ringcomm_torch.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]
