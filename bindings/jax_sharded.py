"""DeAR's ZeRO-1 update over gradient pytrees (:func:`sharded_optimizer`): an optax
transformation whose inner update runs on this rank's shard of each bucket, driven through a
:class:`~bindings.jax_sync.GradientSync` (its :meth:`~bindings.jax_sync.GradientSync.plan`,
``begin`` and ``finish``), eagerly and inside ``jax.jit``; its per-rank state
(:class:`ShardedState`) made whole and cut again for checkpoints (:mod:`bindings.jax_state`).
Documented with the rest of the binding in :mod:`bindings.jax`, which exports them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

import commlib
from commlib.arrays import is_tracer, numpy_dtype
from commlib.collectives import DeAR, Strategy, checked_strategy
from commlib.errors import ValidationError

from .jax_fusion import Plan, agree_plan, shard_problem, tree_problem
from .jax_global import ranks_sum, summed_over_shards
from .jax_host import host_call
from .jax_state import shard_state, shards_problem, whole_state
from .jax_sync import GradientSync


class ShardedState(NamedTuple):
    """State of :func:`sharded_optimizer`: the inner optimizer's state over this
    rank's shard of each bucket (a list of 1-D arrays, one per bucket), and
    ``owner``, an int32 array ``[rank, size, tag]``: the rank whose shard it is, of how
    many, and a random tag of the optimizer that handed it out (in the state, so that a
    checkpoint keeps them): each rank must restore its own."""

    inner: Any
    owner: Any


def sharded_optimizer(inner: Any, comm: commlib.Communicator | None = None,
                      strategy: Strategy | None = None) -> Any:
    """DeAR with a sharded update: ``inner`` runs on this rank's shard of each bucket.

    ``update(grads, state, params)`` reduce-scatters (``avg``) the fused gradients, applies
    ``inner`` (any *elementwise* optax transformation: sgd with momentum or Nesterov, adam,
    adamw, schedules, and :func:`~bindings.jax_global.clip_by_global_norm` and
    :func:`~bindings.jax_global.apply_if_finite`, which read the whole gradient over the ranks' shards;
    not ones that look across leaves, such as optax's ``clip_by_global_norm``, LAMB, optax's
    ``apply_if_finite`` or masks keyed by the tree: tried on a small problem first, refused
    with ``ValueError``) to the gradient and parameter shards, and all-gathers the updates,
    which come back as a full pytree for ``optax.apply_updates``.  Optimizer
    state costs 1/world_size (it differs per rank: checkpoint every rank's and
    restore each its own; a state restored on another rank is refused, on
    every rank, at the first update, before it communicates).
    ``strategy`` must be sharded (default ``DeAR()``).  ``update`` runs eagerly or inside
    ``jax.jit`` (the reduce-scatter and the all-gather in ordered host calls around the
    traced inner update, over a communicator of their own, as :class:`GradientSync`'s); so does
    ``init`` (the tree compared over the ranks while tracing).

    The returned transformation has two more methods, for checkpoints that do not depend on
    the ranks: ``tx.whole_state(state, params)`` gathers every rank's shards into the state
    ``inner`` keeps over the whole of ``params`` (a call every rank makes; the same on every rank,
    so rank 0 may save it alone, and one process may train on with ``inner``), and
    ``tx.shard_state(whole, params)`` cuts such a state into this rank's ``ShardedState``, on
    any number of ranks (no communication), as FSDP's full optimizer state dict.

    Example:
        >>> tx = sharded_optimizer(optax.adamw(1e-3), strategy=DeAR(cap_mb=8))
        >>> state = tx.init(params)                  # after broadcast_params
        >>> @jax.jit
        ... def step(params, state, x, y):
        ...     updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
        ...     return optax.apply_updates(params, updates), state
        >>> whole = tx.whole_state(state, params)    # every rank; rank 0 saves it
        >>> state = tx.shard_state(whole, params)    # on resume, on any number of ranks
    """
    import jax.numpy as jnp

    instead = ("use optax.chain(average_gradients(...), inner) instead (its state then on every rank), or "
               "an elementwise transformation (to clip by the global norm or skip non-finite steps: "
               "commlib.bindings.jax.clip_by_global_norm or apply_if_finite, which read the whole "
               "gradient over the ranks' shards)")
    problem = shard_problem(inner)
    if problem:
        raise ValueError(f"sharded_optimizer: the update runs on flat shards of the buckets: {problem}; "
                         f"{instead}")
    strategy = checked_strategy(strategy, "sharded_optimizer") if strategy is not None else DeAR()
    if not strategy.sharded:
        raise ValueError(f"sharded_optimizer needs a sharded strategy (DeAR), got {strategy!r}")
    if strategy.tuned:
        raise ValueError("sharded_optimizer: tuning the cap re-plans the buckets, which would re-shard "
                         "the optimizer state; give the strategy a fixed cap_mb")
    sync = GradientSync(comm, strategy)
    # a function of its own: its trace binds this optimizer's communicator (clip_by_global_norm's sum)
    inner_update = jax.jit(lambda u, s, p: inner.update(u, s, p))
    digest: list[tuple[int, int]] = []
    tag = int(np.random.default_rng().integers(1, 2**31 - 1))    # of this optimizer's states

    def owned() -> np.ndarray:
        return np.array([sync.comm.rank, sync.comm.size, tag], np.int32)

    def owner_problem(owner: Any, comm: commlib.Communicator) -> str | None:
        """This rank's objection to the owner of a state given to an update (``None``: its own),
        raised on every rank by the update's tree check (:meth:`GradientSync.check_tree`), which
        every rank makes whatever its state (an all-gather of the owners on the ranks whose state
        this optimizer had not handed out, alone, aborted the communicator: a mismatch)."""
        rank, size = [int(v) for v in np.asarray(owner).reshape(-1)][:2]
        if [rank, size] == [comm.rank, comm.size]:
            return None
        return (f"sharded_optimizer: rank {comm.rank} holds rank {rank} of {size}'s optimizer state "
                "(each rank holds its own shard's): save every rank's state and restore each its own "
                "(on as many ranks), or use optax.chain(average_gradients(...), inner), whose state "
                "is the same on every rank")

    def write_shards(plan: Plan, shards: Sequence[Any]) -> None:
        """The updated shards into this rank's shard of each bucket (gathered next)."""
        rank = sync.comm.rank
        for b, bucket in enumerate(plan.buckets):
            plan.buffers[b][bucket.shard(rank)] = np.asarray(shards[b])

    def planned(tree: Any) -> tuple[Plan, list[Any], bool]:
        plan, leaves = sync.plan(tree)
        return plan, leaves, any(is_tracer(x) for x in leaves)

    def init_fn(params: Any) -> ShardedState:
        plan, leaves = sync.plan(params)
        sync.check_tree(plan, sync.comm)      # inside jax.jit: while tracing, which every rank does
        problem = tree_problem(inner, params)     # the same tree on every rank: the same verdict
        if problem:
            raise ValueError(f"sharded_optimizer: the update runs on flat shards of the buckets: {problem}; "
                             f"{instead}")
        digest[:] = [plan.digest]
        return ShardedState(inner.init(plan.shards_of(leaves, sync.comm.rank)), owned())

    def update_fn(updates: Any, state: ShardedState, params: Any = None) -> tuple[Any, ShardedState]:
        # a problem with the trees goes to every rank through the step's tree check (raised here
        # alone, it left the peers in the step's collectives until their timeout)
        plan, leaves, traced = planned(updates)
        problem = None
        if digest and plan.digest != digest[0]:
            problem = ("sharded_optimizer: the gradient pytree differs from the parameters given to "
                       "init (structure, shapes or dtypes)")
        pleaves = None
        if params is not None:
            pplan, pleaves, ptraced = planned(params)
            traced = traced or ptraced
            if pplan.digest != plan.digest:
                problem = problem or ("sharded_optimizer: params and gradients differ in structure, "
                                      "shapes or dtypes")
                pleaves = None
        if traced:
            return traced_update(plan, leaves, state, pleaves, problem)
        problem = problem or owner_problem(state.owner, sync.comm)
        shard_params = None if pleaves is None else plan.shards_of(pleaves, sync.comm.rank)
        new_state: list[Any] = []

        def update(shards: list[np.ndarray]) -> None:
            with summed_over_shards(ranks_sum(sync.comm)):      # a global norm or count: over the ranks
                out, st = inner_update([jnp.asarray(s.copy()) for s in shards], state.inner, shard_params)
            new_state.append(st)
            write_shards(plan, out)

        arrays = sync.run(plan, leaves, update, problem=problem)
        return (jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(arrays)),
                ShardedState(new_state[0], owned()))

    def traced_update(plan: Plan, leaves: list[Any], state: ShardedState,
                      pleaves: list[Any] | None, problem: str | None) -> tuple[Any, ShardedState]:
        """Inside ``jax.jit``: the reduce-scatter in one ordered callback (after the owner's check),
        ``inner.update`` traced on the shards (the parameters' taken in the traced code), the
        all-gather in another."""
        jit_comm = sync.comm_for_jit()
        if problem is not None:     # the check raises on every rank; nothing past it is traced
            def refuse(owner: np.ndarray, *gleaves: np.ndarray) -> list[np.ndarray]:
                sync.begin(plan, gleaves, jit_comm, problem)
                return [owner]

            got = host_call(refuse, [jax.ShapeDtypeStruct((3,), np.int32)], state.owner, *leaves)
            return (jax.tree_util.tree_unflatten(plan.treedef, list(leaves)),
                    ShardedState(state.inner, got[0]))
        shard_types = [jax.ShapeDtypeStruct((bk.shard_numel,), numpy_dtype(bk.dtype)) for bk in plan.buckets]

        def begin(owner: np.ndarray, *gleaves: np.ndarray) -> list[np.ndarray]:
            sync.begin(plan, gleaves, jit_comm, owner_problem(owner, jit_comm))
            return [owned(), *plan.shards]        # (copied into XLA's buffers)

        got = host_call(begin, [jax.ShapeDtypeStruct((3,), np.int32), *shard_types], state.owner, *leaves)
        pshards = None if pleaves is None else plan.shards_of(pleaves, sync.comm.rank)
        with summed_over_shards(ranks_sum(jit_comm)):
            out, inner_state = inner.update(list(got[1:]), state.inner, pshards)

        k = len(out)

        def finish(*arrays: np.ndarray) -> None:      # the updated shards, then XLA's buffers of the leaves
            sync.finish(plan, lambda _: write_shards(plan, arrays[:k]), into=arrays[k:])

        leaf_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        full = host_call(finish, leaf_types, *out, into=True)
        return jax.tree_util.tree_unflatten(plan.treedef, list(full)), ShardedState(inner_state, got[0])

    def eager(tree: Any, who: str) -> Plan:
        plan, leaves = sync.plan(tree)
        if any(is_tracer(x) for x in leaves):
            raise TypeError(f"sharded_optimizer.{who} runs eagerly (a checkpoint's step): call it outside "
                            "jax.jit")
        if plan.error:
            raise ValidationError(f"sharded_optimizer.{who}: {plan.error}")
        if digest and plan.digest != digest[0]:
            raise ValidationError(f"sharded_optimizer.{who}: params differ from those given to init "
                                  "(structure, shapes or dtypes)")
        return plan

    def whole_fn(state: ShardedState, params: Any) -> Any:
        plan = eager(params, "whole_state")
        comm = sync.comm
        owner = [int(v) for v in np.asarray(state.owner).reshape(-1)][:2]
        problem = (shards_problem(plan, inner, state.inner) if owner == [comm.rank, comm.size] else
                   f"it holds rank {owner[0]} of {owner[1]}'s state: restore each rank its own")
        # the same tree, and each rank's own state of its shards, on every rank before the gathers
        agree_plan(comm, plan, "sharded_optimizer.whole_state", problem)
        return whole_state(comm, plan, inner, state.inner, params)

    def shard_fn(whole: Any, params: Any) -> ShardedState:
        plan = eager(params, "shard_state")
        digest[:] = [plan.digest]
        return ShardedState(shard_state(plan, sync.comm.rank, inner, whole, params), owned())

    return sharded_transformation()(init_fn, update_fn, whole_fn, shard_fn)


@functools.cache
def sharded_transformation() -> type:
    """The class of :func:`sharded_optimizer`'s result, made when optax is first needed (the binding
    imports without it): optax's ``GradientTransformation`` pair plus the state made whole and cut."""
    import optax

    class ShardedTransformation(optax.GradientTransformation):
        """optax's ``(init, update)`` pair of :func:`sharded_optimizer`, plus :meth:`whole_state` and
        :meth:`shard_state` (checkpoints that do not depend on the ranks).

        Example:
            >>> whole = tx.whole_state(state, params)
        """

        def __new__(cls, init: Any, update: Any, whole: Any, shard: Any) -> Any:
            self = super().__new__(cls, init, update)
            self._whole, self._shard = whole, shard
            return self

        def whole_state(self, state: ShardedState, params: Any) -> Any:
            """``inner``'s state over the whole of ``params``, gathered from every rank's shards (a
            call every rank makes; the same on every rank; eagerly).

            Example:
                >>> whole = tx.whole_state(state, params)        # on every rank
                >>> if comm.rank == 0: pickle.dump(whole, f)
            """
            return self._whole(state, params)

        def shard_state(self, whole: Any, params: Any) -> ShardedState:
            """This rank's state cut from ``whole`` (``inner``'s state over the whole of ``params``,
            from :meth:`whole_state` on any number of ranks or ``inner`` in one process; eagerly).

            Example:
                >>> state = tx.shard_state(pickle.load(f), params)
            """
            return self._shard(whole, params)

    return ShardedTransformation
