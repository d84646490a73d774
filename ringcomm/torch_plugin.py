"""What torch runs at ``import torch`` for an installed ringcomm (entry point group ``torch.backends``).

It registers the ``"ringcomm"`` torch.distributed backend, so
``dist.init_process_group("ringcomm")`` works without importing anything first.  Outside a
``ringcomm-run`` job this costs ``import torch`` nothing more than the registration: the
backend (:mod:`ringcomm_torch.distributed`, with ringcomm and ZeroMQ) is imported when a
process group is first created on it.  Under ``ringcomm-run`` it is imported at once, so that
torch's ``env://`` variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) are there before
``init_process_group`` reads them.

A failure never breaks ``import torch``: it is logged, and the backend is then available only
after ``import ringcomm_torch.distributed`` (which raises the error itself).  torch's
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` switches this off (with every other such extension).
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("ringcomm.torch_plugin")

NAME = "ringcomm"


def _create(*args: Any, **kwargs: Any) -> Any:
    """torch's creator for the backend: imports the backend on first use and hands over to it."""
    from ringcomm_torch.distributed import create_process_group  # registers the rest (new_group, ...)

    return create_process_group(*args, **kwargs)


def load() -> None:
    """Register the ``"ringcomm"`` backend (under ``ringcomm-run``: import it); never raises."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        if "RINGCOMM_RANK" in os.environ or "RINGCOMM_SIZE" in os.environ:  # a ringcomm-run worker
            import ringcomm_torch.distributed  # noqa: F401  (registers "ringcomm", fills torch's env://)
        elif NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    except Exception as exc:  # torch would refuse to import at all if this raised
        log.warning("could not register the 'ringcomm' torch.distributed backend at import torch: %s: %s; "
                    "import ringcomm_torch.distributed to see the full error", type(exc).__name__, exc)
