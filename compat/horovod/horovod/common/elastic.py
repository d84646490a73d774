"""``horovod.common.elastic``: ringcomm's elastic state and its reset loop under Horovod's names."""

from ringcomm.elastic.state import ObjectState, State, run_fn

__all__ = ["State", "ObjectState", "run_fn"]
