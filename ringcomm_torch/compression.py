"""Gradient compression applied around allreduce (Horovod's ``hvd.Compression``).

A compressor has ``compress(tensor) -> (compressed, ctx)`` and
``decompress(tensor, ctx) -> tensor``.  ``Compression.fp16`` halves the bytes
on the wire for floating-point tensors and leaves the others alone::

    c, ctx = hvd.Compression.fp16.compress(torch.ones(3))   # c.dtype == torch.float16, ctx == torch.float32
    hvd.Compression.fp16.decompress(c, ctx).dtype           # torch.float32
"""

from __future__ import annotations

import abc
from typing import Any

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor(abc.ABC):
    """Interface for compressing and decompressing a tensor (Horovod's; subclass it for your own)."""

    @staticmethod
    @abc.abstractmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to communicate and the context :meth:`decompress` needs."""

    @staticmethod
    @abc.abstractmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undo :meth:`compress` on the communicated tensor."""


class NoneCompressor(Compressor):
    """Leaves the tensor unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Casts floating-point tensors to float16 for the wire and back to their dtype afterwards."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype is not torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        dtype = ctx
        if dtype is not None and dtype.is_floating_point and tensor.dtype is not dtype:
            return tensor.to(dtype)
        return tensor


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
