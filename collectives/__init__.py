"""How gradients travel: tensor fusion and the strategies of the training-step lifecycle.

Example:
    >>> from collectives import AllReduce, DeAR
    >>> strategy = DeAR(cap_mb=8)          # hand it to bindings.torch.DistributedOptimizer
"""

from .allreduce import AllReduce
from .buckets import Bucket, Slot, TensorSpec, plan_buckets
from .dear import DeAR
from .selsync import SelSync
from .strategy import Strategy

__all__ = ["Strategy", "AllReduce", "DeAR", "SelSync", "Bucket", "Slot", "TensorSpec", "plan_buckets"]
