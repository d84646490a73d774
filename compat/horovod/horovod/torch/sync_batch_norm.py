"""``horovod.torch.sync_batch_norm``: ringcomm_torch's ``SyncBatchNorm``."""

from ringcomm_torch.sync_batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
