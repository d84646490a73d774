"""PyTorch Lightning on ringcomm: the ``"ddp_ringcomm"`` strategy name.

Lightning's DDP strategy runs on any torch.distributed backend, so ringcomm needs no strategy
class of its own: ``DDPStrategy(process_group_backend="ringcomm")`` is the whole change.
Importing this module registers that configuration under one word, for Lightning's
``Trainer`` (``lightning.pytorch``, and ``pytorch_lightning`` where that package is
installed) and for Fabric::

    import ringcomm_torch.lightning  # noqa: F401
    trainer = lightning.pytorch.Trainer(strategy="ddp_ringcomm", accelerator="cpu", devices=2)

The names registered are listed in :data:`STRATEGIES`.  Registering again is a no-op.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The names this module registers and the DDP start method each uses (Lightning's own "ddp"
#: starts the other ranks by running the script again, "ddp_spawn" by torch.multiprocessing).
STRATEGIES = {"ddp_ringcomm": "popen", "ddp_spawn_ringcomm": "spawn"}

#: The Lightning packages whose strategy registries get the names, with their DDP strategy classes.
_PACKAGES = (
    ("lightning.pytorch.strategies", "StrategyRegistry", "DDPStrategy"),
    ("pytorch_lightning.strategies", "StrategyRegistry", "DDPStrategy"),
    ("lightning.fabric.strategies", "STRATEGY_REGISTRY", "DDPStrategy"),
)


def register() -> list[str]:
    """Register :data:`STRATEGIES` in every installed Lightning registry; returns the packages that got them.

    Raises ImportError, naming the extra to install, where no Lightning package is installed.
    """
    done = []
    for module_name, registry_name, class_name in _PACKAGES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        registry: Any = getattr(module, registry_name)
        strategy = getattr(module, class_name)
        for name, start_method in STRATEGIES.items():
            if name not in registry:
                registry.register(name, strategy, description=f"DDP over the ringcomm backend ({start_method})",
                                  process_group_backend="ringcomm", start_method=start_method)
        done.append(module_name)
    if not done:
        raise ImportError("ringcomm_torch.lightning registers Lightning strategies, but neither lightning nor "
                          "pytorch_lightning is installed: pip install 'ringcomm[frameworks]'")
    return done


register()
