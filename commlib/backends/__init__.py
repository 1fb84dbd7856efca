"""Backends: how bytes move. Each returns a :class:`~commlib.backends.base.Pending` per operation."""

from .base import REDUCE_OPS, Pending, split_counts

__all__ = ["Pending", "REDUCE_OPS", "split_counts"]
