"""``TorchState``: models, optimizers, LR schedulers and samplers that survive membership changes.

Each keyword argument of a known type gets a handler (how to save, restore and
sync it); anything else is a plain attribute handled like ``ObjectState``::

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    state.commit()     # every rank: model/optimizer state copied to memory, sampler progress gathered
    state.restore()    # every rank: back to that copy (after a lost worker)
    state.sync()       # every rank: rank 0's model, optimizer, sampler progress and attributes
"""

from __future__ import annotations

import abc

import copy
from typing import Any

import torch

import ringcomm as _rc
from ringcomm.elastic.state import ObjectState

from ..functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .sampler import ElasticSampler

__all__ = ["TorchState", "StateHandler", "ModelStateHandler", "OptimizerStateHandler",
           "LRSchedulerStateHandler", "SamplerStateHandler"]


class StateHandler(abc.ABC):
    """How one object is saved, restored and synced."""

    def __init__(self, value: Any) -> None:
        self.value = value

    @abc.abstractmethod
    def save(self) -> None:
        """Save this state (subclasses)."""

    @abc.abstractmethod
    def restore(self) -> None:
        """Restore this state (subclasses)."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Sync this state (subclasses)."""

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    """``model.state_dict()`` copied at save, loaded at restore, broadcast from rank 0 at sync."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._saved = copy.deepcopy(model.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """The optimizer's ``state_dict()`` (momentum buffers, steps, lr); synced with ``broadcast_optimizer_state``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._saved = copy.deepcopy(optimizer.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class LRSchedulerStateHandler(StateHandler):
    """An LR scheduler's ``state_dict()``; synced as an object from rank 0."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)
        self._saved = copy.deepcopy(scheduler.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`: at save, every rank's processed indices are gathered (collective)."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved = copy.deepcopy(sampler.state_dict())

    def save(self) -> None:
        everyone = allgather_object(self.value.processed_indices) if _rc.is_initialized() else []
        # the live sampler learns the others' progress too, so a sync without restore (new hosts) has it
        self.value.processed_indices = set().union(self.value.processed_indices, *everyone)
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


def _handler_for(value: Any) -> StateHandler | None:
    if isinstance(value, torch.nn.Module):
        return ModelStateHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return OptimizerStateHandler(value)
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        return LRSchedulerStateHandler(value)
    if isinstance(value, ElasticSampler):
        return SamplerStateHandler(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch training process; ``model``, ``optimizer`` and any keyword are attributes.

    Modules, optimizers (including ``DistributedOptimizer``), LR schedulers and
    ``ElasticSampler`` get handlers; other values (epoch, batch, ...) are
    deep-copied Python objects.  Assigning a new model/optimizer to an attribute
    re-targets its handler and saves it.
    """

    _handlers: dict[str, StateHandler]

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is not None:
                handlers[name] = handler
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=lambda obj: broadcast_object(obj, 0), get_rank=_rc.rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and self.__dict__.get(name) is not value:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
