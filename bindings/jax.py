"""JAX binding: gradient pytrees through commlib's fusion buckets and strategies.

A pytree of gradients is flattened into a few fused flat buffers on the host
(:func:`collectives.plan_buckets`: leaves in reverse order, as backward makes
them ready; buckets homogeneous in dtype, capped in bytes, padded to a
multiple of the world size), a :class:`collectives.Strategy` averages them
over the ranks, and the buffers are unflattened into a pytree of jax arrays
with the original shapes, dtypes and devices.

=================================  =====================================================
:class:`GradientSync`              ``sync(grads) -> averaged grads``; buffers and the bucket
                                   plan are reused across calls (keyed by tree structure)
:func:`average_gradients`          an optax ``GradientTransformation`` that averages the
                                   updates over ranks (eager or inside ``jax.jit``)
:func:`sharded_optimizer`          DeAR's ZeRO-1 update: reduce-scatter, an elementwise
                                   optax optimizer on this rank's shard, all-gather
:func:`clip_by_global_norm`        optax's, whose norm inside ``sharded_optimizer`` is summed
                                   over the ranks' shards (``jax_global``)
:func:`apply_if_finite`            optax's, whose check inside ``sharded_optimizer`` counts
                                   the non-finite elements of every rank's shards
:class:`DistributedOptimizer`      the whole optax optimizer under SelSync or Sync-Switch
                                   (their parameter averages and pushes): ``jax_params``
:func:`allreduce_gradients`        one-shot average of a gradient pytree
:func:`broadcast_params`           every rank gets ``root``'s pytree (parameters, optimizer state)
:func:`allreduce`                  one array reduced over the ranks, eagerly, inside ``jax.jit``
:func:`allgather`                  and under ``jax.grad`` (mpi4jax's calls: ``jax_ops``)
:func:`broadcast`
=================================  =====================================================

Example (under ``mpiexec -n 4``):

    >>> import optax
    >>> from commlib.bindings.jax import average_gradients, broadcast_params
    >>> from commlib.collectives import DeAR
    >>> params = broadcast_params(init_params(key))            # same start everywhere
    >>> tx = optax.chain(average_gradients(strategy=DeAR()), optax.adamw(1e-3))
    >>> state = tx.init(params)
    >>> for x, y in my_slice_of_each_batch:
    ...     grads = jax.grad(loss)(params, x, y)               # this rank's gradient
    ...     updates, state = tx.update(grads, state, params)   # averaged over ranks
    ...     params = optax.apply_updates(params, updates)

Strategies. :class:`~collectives.AllReduce` all-reduces each bucket (``avg``).
:class:`~collectives.DeAR` is sharded: with :func:`average_gradients` and
:class:`GradientSync` it runs as a *decoupled all-reduce* (reduce-scatter of
each bucket, the averaged shard written back as the "update", all-gather of
the averaged gradients), so any optax chain after it stays unchanged; with
:func:`sharded_optimizer` the optimizer itself runs on the shard (ZeRO-1:
state and update cost 1/world_size), and the updates are all-gathered; its
``whole_state`` / ``shard_state`` turn the per-rank state into the inner
optimizer's state over the whole tree and back (``jax_state``), for
checkpoints rank 0 writes alone and resumes on any number of ranks.

Sharp bits (what a user must know):

* The collectives run on the host, outside XLA.  Eagerly (outside
  ``jax.jit``) a call blocks until the gradients are computed and averaged.
  Inside ``jax.jit`` the transformation calls commlib through an ordered
  host call (:func:`~commlib.bindings.jax_host.host_call`: an XLA FFI call on
  XLA's own buffers on CPU, else ``io_callback(ordered=True)``): the jitted step then runs
  the collectives in program order, exactly once per call, but it cannot be
  used under ``jax.vmap``, ``pmap`` or ``shard_map``, and an error raised by
  a rank (bad input, timeout) surfaces as JAX's runtime error wrapping
  commlib's message.  :func:`sharded_optimizer` jits too (the reduce-scatter
  and the all-gather in two callbacks around the traced inner update on the
  shards).
* The jitted path has a communicator of its own (``comm.split(0)``, made
  once, collectively, when the first jitted call is traced: trace on every
  rank, from the thread that drives ``comm``), so that its collectives,
  which run on whichever thread XLA runs the callback, never interleave with
  eager commlib calls on ``comm`` (a metrics all-reduce right after a step).
* Every rank must call in the same order with the same tree structure,
  shapes and dtypes.  The first call with a new structure compares a
  fingerprint of it over the ranks (one small all-gather) and raises
  :class:`commlib.MismatchError` on every rank when they differ; later calls
  trust the cached plan (``check="always"`` compares on every call, or run
  with ``COMMLIB_CHECK=1`` to have commlib compare every collective).
* Gradient leaves must be floating (float16, bfloat16, float32, float64) or complex
  (complex64, complex128), each on one device, all on the same device; integer or
  ``float0`` leaves (``jax.grad(..., allow_int=True)``) and arrays sharded over several
  devices are rejected on every rank with :class:`commlib.ValidationError`.
  :func:`broadcast_params` also takes int32 and int64 leaves.
* Buffers live in host memory: on GPU each step copies the gradients to the
  host and back (a cupy/NCCL staging path is future work).
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import numpy as np

import commlib
from commlib.arrays import DTYPES, is_tracer
from commlib.collectives import Strategy
from commlib.collectives.buckets import MiB
from commlib.errors import ValidationError

from .jax_fusion import agree_plan, make_plan
from .jax_global import apply_if_finite, clip_by_global_norm
from .jax_ops import allgather, allreduce, broadcast
from .jax_params import DistributedOptimizer
from .jax_sharded import ShardedState, sharded_optimizer
from .jax_sync import GradientSync

__all__ = ["GradientSync", "average_gradients", "sharded_optimizer", "clip_by_global_norm", "apply_if_finite",
           "allreduce_gradients", "broadcast_params", "ShardedState", "allreduce", "allgather", "broadcast",
           "DistributedOptimizer"]

# ---------------------------------------------------------------------- functions
_DEFAULT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def allreduce_gradients(grads: Any, comm: commlib.Communicator | None = None) -> Any:
    """Average the gradient pytree ``grads`` over the ranks (fused all-reduce).

    Keeps one :class:`GradientSync` per communicator, so repeated calls reuse
    buffers.

    Example:
        >>> grads = allreduce_gradients(jax.grad(loss)(params, x, y))
    """
    comm = commlib.as_communicator(comm, "allreduce_gradients")
    sync = _DEFAULT.get(comm)
    if sync is None:
        sync = _DEFAULT[comm] = GradientSync(comm)
    return sync(grads)


def broadcast_params(params: Any, root: int = 0, comm: commlib.Communicator | None = None,
                     cap_mb: float = 64) -> Any:
    """Every rank gets ``root``'s ``params`` (any pytree of float16, bfloat16,
    float32, float64, complex64, complex128, int32 or int64 arrays: parameters, optimizer state),
    fused into buckets of ``cap_mb``.  Leaves come back as jax arrays on the
    caller's device.  Eager only (call it outside ``jax.jit``).

    Example:
        >>> params = broadcast_params(init(jax.random.key(rank)))   # rank 0's init everywhere
        >>> opt_state = broadcast_params(opt_state)
    """
    comm = commlib.as_communicator(comm, "broadcast_params")
    leaves, treedef = jax.tree_util.tree_flatten(params)
    if any(is_tracer(x) for x in leaves):
        raise TypeError("broadcast_params runs outside jax.jit (call it once before training)")
    if not isinstance(root, (int, np.integer)) or not 0 <= root < comm.size:
        raise ValidationError(f"broadcast_params: root {root!r} is not a rank of 0..{comm.size - 1}")
    cap = int(cap_mb * MiB)
    plan = make_plan(params, leaves, treedef, DTYPES, comm.size, cap, None)
    agree_plan(comm, plan, "broadcast_params")
    plan.allocate(False)
    works = []
    for b in range(len(plan.buckets)):
        if comm.rank == root:
            plan.pack(b, leaves)
        works.append(comm.ibroadcast(plan.buffers[b], int(root), out=plan.buffers[b], tag=f"bcast-jax{b}"))
    for w in works:
        w.wait()
    return jax.tree_util.tree_unflatten(treedef, plan.to_jax(plan.unpack()))


def average_gradients(comm: commlib.Communicator | None = None, strategy: Strategy | None = None,
                      cap_mb: float | None = None, check: str = "first") -> Any:
    """An optax ``GradientTransformation`` that averages the updates over the ranks.

    Put it first in a chain: ``optax.chain(average_gradients(), optax.sgd(0.1, 0.9))``, and
    inside nothing that decides per rank (``optax.apply_if_finite`` goes after it).
    ``init`` returns ``optax.EmptyState()``; ``update`` averages through a
    :class:`GradientSync` (``strategy`` ``AllReduce`` by default; ``DeAR`` runs
    as a decoupled all-reduce).  Works eagerly and inside ``jax.jit`` (through
    ordered host calls, :func:`~commlib.bindings.jax_host.host_call`; not under
    ``vmap``/``pmap``).  A strategy's own state (sparse residuals, a tuned cap) stays in
    it: checkpoint ``strategy.state_dict()`` too, and ``load_state_dict`` it before the
    first update after a restore.

    Example:
        >>> tx = optax.chain(average_gradients(strategy=DeAR()), optax.adamw(1e-3))
        >>> updates, state = jax.jit(tx.update)(grads, state, params)
    """
    import optax

    sync = GradientSync(comm, strategy, cap_mb=cap_mb, check=check)

    def init_fn(params: Any) -> Any:
        del params
        return optax.EmptyState()

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        return sync(updates), state

    tx = optax.GradientTransformation(init_fn, update_fn)
    return tx
