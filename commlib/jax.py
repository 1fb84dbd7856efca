"""Short name for the JAX binding: ``from commlib.jax import average_gradients``."""

from commlib.bindings.jax import *  # noqa: F401,F403
from commlib.bindings.jax import __all__  # noqa: F401
