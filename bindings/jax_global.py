"""optax transformations that read the whole gradient, made to read it whole where the optimizer sees
shards: :func:`clip_by_global_norm` (its norm) and :func:`apply_if_finite` (whether every element is
finite).

Under :func:`bindings.jax_sharded.sharded_optimizer` the inner optax transformation runs on this rank's
flat shards of the buckets, so optax's own ``clip_by_global_norm`` would clip each rank's shard by the
norm of that shard alone, and optax's ``apply_if_finite`` would skip the update on the ranks whose shard
holds an inf only.  Ours take a sum over what they see (the squares; the non-finite elements) and hand it
to the function on top of :data:`SHARD_SUMS` (pushed by whatever runs the transformation on shards, with
:func:`summed_over_shards`), which returns the sum over every rank's shards: one scalar all-gather.
Anywhere else (after ``average_gradients``, in one process) they are optax's.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import commlib

__all__ = ["clip_by_global_norm", "apply_if_finite", "summed_over_shards", "ranks_sum", "over_shards"]


class _Stack(threading.local):
    def __init__(self) -> None:
        self.sums: list[Callable[[Any], Any]] = []


#: per thread (where tracing runs): the functions from this shard's sum to every shard's
SHARD_SUMS = _Stack()


@contextlib.contextmanager
def summed_over_shards(total: Callable[[Any], Any]) -> Iterator[None]:
    """While tracing or running a transformation on shards: ``total(sq)`` maps this shard's sum of
    squares, or of non-finite elements (a jax scalar), to the sum over all shards, for the
    transformations here inside it.

    Example:
        >>> with summed_over_shards(ranks_sum(comm)):
        ...     out, state = inner.update(shards, state, param_shards)
    """
    SHARD_SUMS.sums.append(total)
    try:
        yield
    finally:
        SHARD_SUMS.sums.pop()


def ranks_sum(comm: commlib.Communicator) -> Callable[[Any], Any]:
    """``total`` for :func:`summed_over_shards` over the ranks of ``comm``: an ordered
    ``io_callback`` that all-gathers each rank's sum (float64) and adds them in rank order, so that
    every rank gets the same value and so decides alike (a call every rank makes, in program order).

    Example:
        >>> total = ranks_sum(comm)        # total(sq) inside the traced update
    """
    import jax

    from .jax_host import host_call

    def gathered(sq: np.ndarray) -> np.ndarray:
        sums = comm.allgather(np.array([float(sq)], np.float64), tag="shard sums")
        return np.asarray(np.sum(sums), dtype=np.asarray(sq).dtype)

    def total(sq: Any) -> Any:
        return host_call(gathered, jax.ShapeDtypeStruct((), sq.dtype), sq)

    return total


def over_shards(local: Any) -> Any:
    """``local`` (this shard's sum, a jax scalar) summed over every shard where the transformation runs
    on shards (inside :func:`summed_over_shards`), else itself.

    Example:
        >>> sq = over_shards(jnp.sum(jnp.square(g)))      # the whole gradient's, inside sharded_optimizer
    """
    return SHARD_SUMS.sums[-1](local) if SHARD_SUMS.sums else local


def clip_by_global_norm(max_norm: float) -> Any:
    """optax's ``clip_by_global_norm`` that also clips by the global norm inside
    :func:`~bindings.jax_sharded.sharded_optimizer`, where each rank's update sees only its shard of the
    averaged gradient: there the norm is summed over the ranks' shards (one scalar all-gather per
    step, in the step's order, eagerly or inside ``jax.jit``) and every rank clips by the norm one
    process computes over the whole tree.  Elsewhere it is optax's own.  ``max_norm``: positive.

    Example:
        >>> from commlib.bindings.jax import clip_by_global_norm, sharded_optimizer
        >>> tx = sharded_optimizer(optax.chain(clip_by_global_norm(1.0), optax.adamw(1e-3)))
    """
    import jax
    import jax.numpy as jnp
    import optax

    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be a positive number, got {max_norm!r}")

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        # optax's sum of squares (tree.norm): |x|^2 summed per leaf, then over the leaves in order
        sq = jnp.asarray(functools.reduce(operator.add, [jnp.sum(jnp.square(x.real) + jnp.square(x.imag))
                                                         for x in jax.tree.leaves(updates)], 0))
        g_norm = jnp.sqrt(over_shards(sq))
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip(t: Any) -> Any:
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def apply_if_finite(inner: Any, max_consecutive_errors: int) -> Any:
    """optax's ``apply_if_finite`` (skip the update where the gradient holds an inf or a NaN, up to
    ``max_consecutive_errors`` steps in a row, then apply it) that also decides on the whole gradient
    inside :func:`~bindings.jax_sharded.sharded_optimizer`, where each rank's update sees only its shard:
    there the non-finite elements are counted over the ranks' shards (one scalar all-gather per step),
    so every rank skips the steps one process skips.  Elsewhere it is optax's.  Its state is optax's
    ``ApplyIfFiniteState``.

    Example:
        >>> from commlib.bindings.jax import apply_if_finite, sharded_optimizer
        >>> tx = sharded_optimizer(apply_if_finite(optax.adamw(1e-3), max_consecutive_errors=5))
    """
    import jax
    import jax.numpy as jnp
    import optax

    if isinstance(max_consecutive_errors, bool) or not isinstance(max_consecutive_errors, int) \
            or max_consecutive_errors < 0:
        raise ValueError(f"apply_if_finite: max_consecutive_errors must be an int >= 0, got "
                         f"{max_consecutive_errors!r}")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> Any:
        zero = jnp.zeros([], jnp.int32)
        return optax.ApplyIfFiniteState(notfinite_count=zero, last_finite=jnp.array(True, jnp.bool_),
                                        total_notfinite=zero, inner_state=inner.init(params))

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        bad = functools.reduce(operator.add, [jnp.sum(~jnp.isfinite(x), dtype=jnp.float32)
                                              for x in jax.tree.leaves(updates)], jnp.zeros([], jnp.float32))
        finite = over_shards(bad) == 0
        one = jnp.ones([], jnp.int32)
        count = jnp.where(finite, jnp.zeros([], jnp.int32), jnp.minimum(state.notfinite_count,
                                                                         jnp.iinfo(jnp.int32).max - 1) + one)
        new_updates, inner_state = jax.lax.cond(
            finite | (count > max_consecutive_errors),
            lambda: inner.update(updates, state.inner_state, params, **extra),
            lambda: (jax.tree.map(jnp.zeros_like, updates), state.inner_state))
        total = jnp.where(finite, state.total_notfinite,
                          jnp.minimum(state.total_notfinite, jnp.iinfo(jnp.int32).max - 1) + one)
        return new_updates, optax.ApplyIfFiniteState(notfinite_count=count, last_finite=finite,
                                                     total_notfinite=total, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
