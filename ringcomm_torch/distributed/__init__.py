"""ringcomm as a torch.distributed backend: ``dist.init_process_group("ringcomm")``.

    import torch.distributed as dist
    import ringcomm_torch.distributed  # registers "ringcomm" (installed packages: torch loads it itself)

    dist.init_process_group("ringcomm")          # was: "gloo"
    model = torch.nn.parallel.DistributedDataParallel(model)

Works under ``ringcomm-run``, torchrun, ``mp.spawn`` with ``init_method="tcp://..."`` or
``env://``, and Slurm (with the init_method the script builds).  The backend joins ringcomm's
job through torch's store (:mod:`.init`), runs every collective asynchronously on ringcomm's
engine (:mod:`.backend`, :mod:`.work`) and fails every pending collective with an error that
names a lost rank within seconds.

Two torch functions learn about the backend when this module is imported:

* ``dist.new_group(ranks)`` (and DeviceMesh's, one per mesh dimension) first registers a ringcomm process set with those ranks on
  every rank (torch calls a backend only on the group's members, while ringcomm registers a
  set on every rank); the group's collectives then run on that set.
* ``dist.monitored_barrier()`` (torch runs it only on gloo) runs on a ringcomm group too and
  names the ranks that did not arrive.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
from typing import Any

import torch.distributed as dist

import ringcomm as rc
from ringcomm.errors import InvalidInputError

from . import init as _init
from .arguments import reduce_op
from .backend import NAME, RingcommProcessGroup
from .work import RingcommWork

__all__ = ["NAME", "RingcommProcessGroup", "RingcommWork", "register", "reduce_op", "new_group"]

_sets: dict[tuple[int, ...], rc.ProcessSet] = {}  # ranks -> the ringcomm set registered for new_group(ranks)


def create_process_group(opts: Any, _backend_options: Any = None) -> RingcommProcessGroup:
    """torch's creator (extended API): the store, this rank in the group, its size, the group's global ranks."""
    store, rank, size = opts.store, int(opts.group_rank), int(opts.group_size)
    timeout = opts.timeout if isinstance(opts.timeout, datetime.timedelta) else None
    creating_world = dist.distributed_c10d.GroupMember.WORLD is None
    ranks = tuple(int(r) for r in (opts.global_ranks_in_group or ())) or tuple(range(size))
    owns = False
    if creating_world or not rc.is_initialized():
        if not creating_world and ranks != tuple(range(size)):
            raise InvalidInputError(
                f"new_group(backend='ringcomm', ranks={list(ranks)}): ringcomm runs in this process only once "
                "the default group uses it; call init_process_group('ringcomm') first")
        owns = _init.join(store, ranks[rank], len(ranks) if creating_world else size, timeout) != "initialized"
    if ranks == tuple(range(rc.size())):
        pset: Any = rc.global_process_set
    else:
        found = _sets.get(ranks)
        if found is None:
            raise InvalidInputError(
                f"new_group(ranks={list(ranks)}) on rank {rc.rank()}: no ringcomm process set is registered for "
                "these ranks; create the group with dist.new_group on every rank after importing "
                "ringcomm_torch.distributed (use_local_synchronization=False), or use backend='gloo' for it")
        pset = found
    pg = RingcommProcessGroup(rank, size, ranks, pset, timeout, owns_runtime=owns and creating_world)
    pg._store = store
    return pg


def _default_is_ringcomm() -> bool:
    return dist.is_initialized() and dist.get_backend() == NAME and rc.is_initialized()


def _wrap_new_group(original: Any) -> Any:
    @functools.wraps(original)
    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[1] if len(args) > 1 else None)
        if ranks is not None and _default_is_ringcomm() and backend in (None, NAME, dist.Backend(NAME)):
            members = tuple(sorted(int(r) for r in ranks))
            if members and members != tuple(range(rc.size())) and members not in _sets:
                if kwargs.get("use_local_synchronization"):
                    raise InvalidInputError(
                        f"new_group(ranks={list(members)}, use_local_synchronization=True) on rank {rc.rank()}: "
                        "the ringcomm backend registers a group on every rank; leave use_local_synchronization "
                        "False (and call new_group on every rank)")
                _sets[members] = rc.add_process_set(list(members))
        return original(ranks, *args, **kwargs)
    new_group._ringcomm_wrapped = True  # type: ignore[attr-defined]
    return new_group


def _wrap_monitored_barrier(original: Any) -> Any:
    @functools.wraps(original)
    def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        pg = dist.distributed_c10d._get_default_group() if group is None else group
        if isinstance(pg, RingcommProcessGroup):
            if isinstance(timeout, (int, float)):
                timeout = datetime.timedelta(seconds=timeout)
            return pg.monitored_barrier(timeout, wait_all_ranks)
        return original(group, timeout, wait_all_ranks)
    monitored_barrier._ringcomm_wrapped = True  # type: ignore[attr-defined]
    return monitored_barrier


def register() -> None:
    """Register backend ``"ringcomm"`` with torch.distributed (idempotent); ``ringcomm-run`` jobs also get
    torch's ``env://`` variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) where missing."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, create_process_group, extended_api=True, devices=["cpu", "cuda"])
    for mod in (dist, dist.distributed_c10d):
        if not getattr(mod.new_group, "_ringcomm_wrapped", False):
            mod.new_group = _wrap_new_group(mod.new_group)  # type: ignore[attr-defined]
        if not getattr(mod.monitored_barrier, "_ringcomm_wrapped", False):
            mod.monitored_barrier = _wrap_monitored_barrier(mod.monitored_barrier)  # type: ignore[attr-defined]
    # DeviceMesh makes its groups through the new_group it imported (one per mesh dimension)
    mesh: Any = sys.modules.get("torch.distributed.device_mesh")
    if hasattr(mesh, "new_group") and not getattr(mesh.new_group, "_ringcomm_wrapped", False):
        mesh.new_group = _wrap_new_group(mesh.new_group)
    _init.torch_env_for_ringcomm_run(os.environ)


new_group = _wrap_new_group(dist.distributed_c10d.new_group)

register()
