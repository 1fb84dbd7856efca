"""Short name for the PyTorch binding: ``from commlib.torch import DistributedOptimizer``."""

from commlib.bindings.torch import *  # noqa: F401,F403
from commlib.bindings.torch import __all__  # noqa: F401
