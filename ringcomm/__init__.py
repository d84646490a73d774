"""ringcomm: collective communication for data-parallel training, in pure Python over ZeroMQ.

    import ringcomm as rc
    rc.init()
    grads = rc.allreduce(grads)          # Average across ranks, Horovod semantics

Start a job with ``ringcomm-run -np 4 python train.py``.
"""

from .api import (
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    broadcast_object,
    cross_rank,
    cross_size,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    poll,
    process_set_ids,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    synchronize,
)
from .errors import (
    DuplicateNameError,
    ForkedProcessError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidInputError,
    InvalidTypeError,
    MismatchError,
    NotInitializedError,
    PeerLostError,
    ProtocolError,
    RendezvousError,
    RendezvousTimeoutError,
    RingcommError,
    ShutdownError,
    StallError,
)
from .handles import GroupHandle, Handle
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .process_sets import ProcessSet, global_process_set

__version__ = "0.1.0"

__all__ = [name for name in dir() if not name.startswith("_")]
