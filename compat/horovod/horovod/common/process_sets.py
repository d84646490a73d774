"""``horovod.common.process_sets``: ringcomm's process sets under Horovod's names (the same objects)."""

from ringcomm import add_process_set, remove_process_set
from ringcomm.core.process_sets import ProcessSet, global_process_set

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]
