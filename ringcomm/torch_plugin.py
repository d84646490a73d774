"""What torch runs at ``import torch`` for an installed ringcomm (entry point group ``torch.backends``).

It registers the ``"ringcomm"`` torch.distributed backend (:mod:`ringcomm_torch.distributed`),
so ``dist.init_process_group("ringcomm")`` works without importing anything first.  A
failure never breaks ``import torch``: it is logged, and the backend is then available only
after ``import ringcomm_torch.distributed`` (which raises the error itself).  torch's
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` switches this off (with every other such extension).
"""

from __future__ import annotations

import logging

log = logging.getLogger("ringcomm.torch_plugin")


def load() -> None:
    """Import :mod:`ringcomm_torch.distributed`, which registers the backend; never raises."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        import ringcomm_torch.distributed  # noqa: F401  (registers "ringcomm" on import)
    except Exception as exc:  # torch would refuse to import at all if this raised
        log.warning("could not register the 'ringcomm' torch.distributed backend at import torch: %s: %s; "
                    "import ringcomm_torch.distributed to see the full error", type(exc).__name__, exc)
