"""``horovod.common.exceptions``: ringcomm's errors under Horovod's names (the same classes)."""

from ringcomm.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
