"""Horovod's gradient compression: ``Compression.none`` and ``Compression.fp16``.

Example:
    >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
    ...                                compression=hvd.Compression.fp16)
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` before the exchange, ``decompress`` after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Compress ``tensor``; returns it and what :meth:`decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undo :meth:`compress`."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression.

    Example:
        >>> t, ctx = NoneCompressor.compress(g)      # t is g
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 and come back in their dtype; others pass unchanged.

    Example:
        >>> t, ctx = FP16Compressor.compress(torch.ones(3))     # t.dtype == torch.float16
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.type(ctx)
        return tensor


class Compression:
    """The compression algorithms: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
