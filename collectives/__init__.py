"""How gradients travel: tensor fusion and the strategies of the training-step lifecycle.

Example:
    >>> from commlib.collectives import AllReduce, DeAR
    >>> strategy = DeAR(cap_mb=8)          # hand it to bindings.torch.DistributedOptimizer
"""

from .allreduce import AllReduce
from .buckets import Bucket, Move, Slot, TensorSpec, plan_buckets
from .dear import DeAR
from .paramstore import ParamStore
from .policies import OfflinePolicy, SchedulePolicy, StragglerPolicy, find_bsp_fraction
from .selsync import SelSync
from .strategy import Strategy, checked_strategy
from .syncswitch import SyncSwitch

__all__ = ["Strategy", "AllReduce", "DeAR", "SelSync", "SyncSwitch", "ParamStore", "OfflinePolicy",
           "SchedulePolicy", "StragglerPolicy", "find_bsp_fraction", "Bucket", "Slot", "TensorSpec",
           "Move", "plan_buckets", "checked_strategy"]
