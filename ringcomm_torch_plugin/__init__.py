"""What torch runs at ``import torch`` for an installed ringcomm (entry point group ``torch.backends``).

It registers the ``"ringcomm"`` torch.distributed backend, so
``dist.init_process_group("ringcomm")`` works without importing anything first.  Outside a
``ringcomm-run`` job this costs ``import torch`` nothing more than the registration: the
backend (:mod:`ringcomm_torch.distributed`, with ringcomm and ZeroMQ) is imported when a
process group is first created on it.  Under ``ringcomm-run`` it is imported in :func:`load`,
so that torch's ``env://`` variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) are there
before ``init_process_group`` reads them.

torch imports this module before it calls :func:`load`, and turns any error of either into a
failed ``import torch``.  So this module is a package of its own, outside ``ringcomm``, and
imports nothing but the standard library at import time (and torch in :func:`load`): a broken
ringcomm install (a dependency missing) leaves ``import torch`` working, and creating a group
on the backend then raises an :class:`ImportError` that names what is missing and the fix.
torch's ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` switches this off (with every other such extension).
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("ringcomm.torch_plugin")

NAME = "ringcomm"


def _create(*args: Any, **kwargs: Any) -> Any:
    """torch's creator for the backend: imports the backend on first use and hands over to it."""
    try:
        from ringcomm_torch.distributed import create_process_group  # registers the rest (new_group, ...)
    except ImportError as exc:
        first = args[0] if args else None
        rank = getattr(first, "group_rank", os.environ.get("RANK", os.environ.get("RINGCOMM_RANK", "?")))
        raise ImportError(
            f"rank {rank}: the 'ringcomm' torch.distributed backend cannot start: importing it failed with "
            f"{type(exc).__name__}: {exc}. The ringcomm install is incomplete: reinstall it with its "
            f"dependencies (pip install --force-reinstall ringcomm), or pick another backend "
            f"(init_process_group('gloo'))") from exc
    return create_process_group(*args, **kwargs)


def load() -> None:
    """Register the ``"ringcomm"`` backend (under ``ringcomm-run``: import it); never raises."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
    except Exception as exc:  # torch would refuse to import at all if this raised
        log.warning("torch.distributed is unusable, so the 'ringcomm' backend is not registered: %s: %s",
                    type(exc).__name__, exc)
        return
    if "RINGCOMM_RANK" in os.environ or "RINGCOMM_SIZE" in os.environ:  # a ringcomm-run worker
        try:
            import ringcomm_torch.distributed  # noqa: F401  (registers "ringcomm", fills torch's env://)
            return
        except Exception as exc:
            log.warning("could not import the 'ringcomm' torch.distributed backend at import torch: %s: %s; "
                        "a process group on it will raise the error", type(exc).__name__, exc)
    try:
        if NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    except Exception as exc:
        log.warning("could not register the 'ringcomm' torch.distributed backend at import torch: %s: %s",
                    type(exc).__name__, exc)
