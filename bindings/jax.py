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
state and update cost 1/world_size), and the updates are all-gathered.

Sharp bits (what a user must know):

* The collectives run on the host, outside XLA.  Eagerly (outside
  ``jax.jit``) a call blocks until the gradients are computed and averaged.
  Inside ``jax.jit`` the transformation calls commlib through
  ``jax.experimental.io_callback(ordered=True)``: the jitted step then runs
  the collectives in program order, exactly once per call, but it cannot be
  used under ``jax.vmap``, ``pmap`` or ``shard_map``, and an error raised by
  a rank (bad input, timeout) surfaces as JAX's runtime error wrapping
  commlib's message.  :func:`sharded_optimizer` runs eagerly only.
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

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

import commlib
from commlib.arrays import DTYPES, INEXACT_DTYPES, is_tracer, numpy_dtype
from commlib.collectives import AllReduce, DeAR, Strategy, checked_strategy
from commlib.collectives.buckets import Bucket, MiB
from commlib.errors import ValidationError

from .jax_fusion import Plan, agree_plan, make_plan, shard_problem
from .jax_ops import allgather, allreduce, broadcast
from .jax_params import DistributedOptimizer

__all__ = ["GradientSync", "average_gradients", "sharded_optimizer", "allreduce_gradients",
           "broadcast_params", "ShardedState", "allreduce", "allgather", "broadcast", "DistributedOptimizer"]

_MAX_PLANS = 16            # bucket plans kept per GradientSync (least recently used dropped)


class GradientSync:
    """Average gradient pytrees over the ranks through fused buffers and a strategy.

    ``comm``: a :class:`commlib.Communicator` (default :func:`commlib.world`).
    ``strategy``: a :class:`collectives.Strategy` (default
    ``AllReduce(cap_mb, first_cap_mb)``; give the caps to the strategy when
    you pass one).  A sharded strategy (``DeAR``) runs as a decoupled
    all-reduce: reduce-scatter (``avg``) of each bucket, then all-gather of
    the averaged shards.  ``check``: ``"first"`` compares the tree over the
    ranks when a structure is first seen, ``"always"`` on every call.

    Calls reuse the bucket plan and the host buffers of the tree structure
    (the last ``16`` structures are kept).  Works on concrete arrays and,
    through ``io_callback(ordered=True)``, inside ``jax.jit``.  A strategy
    made with ``tune=...`` gets the time between calls (a step) and re-plans
    the buckets, on every rank at the same call, when its tuner moves the cap.

    Example:
        >>> sync = GradientSync(strategy=DeAR(cap_mb=4))
        >>> grads = sync(jax.grad(loss)(params, x, y))
        >>> sync.describe()            # the fusion plan: one dict per bucket
    """

    def __init__(self, comm: commlib.Communicator | None = None, strategy: Strategy | None = None,
                 cap_mb: float | None = None, first_cap_mb: float | None = None, check: str = "first"):
        if strategy is not None and (cap_mb is not None or first_cap_mb is not None):
            raise ValueError("give cap_mb / first_cap_mb to the strategy you pass, not to GradientSync")
        if check not in ("first", "always"):
            raise ValueError(f"check {check!r}: expected 'first' or 'always'")
        if strategy is None:
            kw = {k: v for k, v in (("cap_mb", cap_mb), ("first_cap_mb", first_cap_mb)) if v is not None}
            strategy = AllReduce(**kw)
        checked_strategy(strategy, "GradientSync")
        if strategy.updates_parameters:
            raise ValueError(f"{strategy.name} reads and writes the parameters, but GradientSync only "
                             "sees gradients: use AllReduce, DeAR or SparseAllReduce here, or wrap the "
                             "whole optimizer: DistributedOptimizer(inner, strategy=...)")
        self.comm = comm if comm is not None else commlib.world()
        self.strategy = strategy
        self.check = check
        self._plans: OrderedDict[Any, Plan] = OrderedDict()
        self._active: Plan | None = None
        self._active_comm: commlib.Communicator | None = None
        self._jit_comm: commlib.Communicator | None = None
        self._last: Plan | None = None
        self._last_call: float | None = None
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ plans
    def _plan(self, tree: Any, allowed: Sequence[str] = INEXACT_DTYPES) -> tuple[Plan, list[Any]]:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        s = self.strategy
        meta = tuple((None if is_tracer(x) else getattr(x, "sharding", None), np.shape(x),
                      x.dtype if hasattr(x, "dtype") else type(x)) for x in leaves)
        key = (treedef, meta, tuple(allowed), s.cap_bytes, s.first_cap_bytes)
        plan = self._plans.get(key)
        if plan is None:
            plan = make_plan(tree, leaves, treedef, allowed, self.comm.size, s.cap_bytes,
                              s.first_cap_bytes)
            self._plans[key] = plan
            while len(self._plans) > _MAX_PLANS:
                old = self._plans.popitem(last=False)[1]
                if old is self._active:
                    self._active = None
        else:
            self._plans.move_to_end(key)
        return plan, leaves

    @property
    def jit_comm(self) -> commlib.Communicator | None:
        """The communicator of the jitted path (``comm.split(0)``), once a jitted call was traced."""
        return self._jit_comm

    def _checked(self, plan: Plan, comm: commlib.Communicator) -> None:
        if not plan.agreed or self.check == "always":
            try:
                agree_plan(comm, plan, "GradientSync")
            except commlib.CommlibError:
                self._drop(plan)
                raise

    def _drop(self, plan: Plan) -> None:
        for k, p in list(self._plans.items()):
            if p is plan:
                del self._plans[k]

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets of the last tree averaged."""
        return self._last.buckets if self._last is not None else []

    def describe(self) -> list[dict]:
        """The fusion plan of the last tree: one dict per bucket (tensors, bytes, dtype)."""
        return self._last.describe() if self._last is not None else []

    # ------------------------------------------------------------------ running
    def _run(self, plan: Plan, leaves: Sequence[Any],
             update: Callable[[list[np.ndarray]], None] | None = None,
             comm: commlib.Communicator | None = None) -> list[np.ndarray]:
        """Drive the strategy over ``plan``'s buckets filled from ``leaves``.

        ``update``: for a sharded strategy, called with the averaged gradient
        shards; it writes this rank's shard of each bucket of the result into
        ``plan.buffers`` (default: the averaged gradients themselves).  ``comm``:
        default ``self.comm`` (the jitted path passes its own).
        """
        comm = comm if comm is not None else self.comm
        with self._lock:
            self._checked(plan, comm)
            s = self.strategy
            plan.allocate(s.sharded)
            self._last = plan
            try:
                if self._active is not plan or self._active_comm is not comm:
                    self._active = None
                    s.setup(comm, plan.buckets, plan.buffers, plan.buffers,
                            plan.shards if s.sharded else None, broadcast=False)
                    self._active, self._active_comm = plan, comm
                for b in range(len(plan.buckets)):
                    plan.pack(b, leaves)
                    s.bucket_ready(b)        # bucket b travels while later ones are packed
                s.before_update()
                if s.sharded:
                    if update is None:
                        rank = self.comm.rank
                        for b, bucket in enumerate(plan.buckets):
                            plan.buffers[b][bucket.shard(rank)] = plan.shards[b]
                    else:
                        update(plan.shards)
                s.after_update()
                s.flush()
                out = plan.unpack()
                self._tune()
            except BaseException:
                self._active = None          # set the strategy up afresh next time
                raise
            return out

    def _tune(self) -> None:
        """``strategy.tune``: feed the tuner call-to-call times; a new cap re-plans the next call."""
        now = time.perf_counter()
        tuner = self.strategy.tuner
        if tuner is not None and not tuner.done and self._last_call is not None:
            new_cap = tuner.observe(now - self._last_call)    # a broadcast: the same step on every rank
            if new_cap is not None:
                self.strategy.cap_bytes = int(new_cap)       # part of the plan key
                now = time.perf_counter()
        self._last_call = now

    def __call__(self, grads: Any) -> Any:
        """The average over the ranks of ``grads`` (a pytree), as a pytree of jax arrays."""
        plan, leaves = self._plan(grads)
        if any(is_tracer(x) for x in leaves):
            return self._traced(plan, leaves)
        return jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(self._run(plan, leaves)))

    def _traced(self, plan: Plan, leaves: Sequence[Any]) -> Any:
        from jax.experimental import io_callback

        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        if self._jit_comm is None:        # tracing: every rank, on the thread that drives comm
            self._jit_comm = self.comm.split(0)
        jit_comm = self._jit_comm

        def host(*arrays: Any) -> list[np.ndarray]:
            return self._run(plan, arrays, comm=jit_comm)

        out = io_callback(host, shapes, *leaves, ordered=True)
        return jax.tree_util.tree_unflatten(plan.treedef, list(out))

    def flatten(self, tree: Any) -> list[np.ndarray]:
        """The fused host buffers of ``tree`` (copies; no communication): for inspection."""
        plan, leaves = self._plan(tree)
        if plan.error:
            raise ValidationError(f"GradientSync: {plan.error}")
        bufs = [np.zeros(b.padded, numpy_dtype(b.dtype)) for b in plan.buckets]
        for b in range(len(bufs)):
            plan.pack(b, leaves, into=bufs)
        return bufs

    def unflatten(self, buffers: Sequence[np.ndarray], like: Any) -> Any:
        """Inverse of :meth:`flatten`: a pytree shaped like ``like`` from fused buffers."""
        plan, _ = self._plan(like)
        if len(buffers) != len(plan.buckets):
            raise ValidationError(f"{len(buffers)} buffers for {len(plan.buckets)} buckets")
        arrays = plan.unpack([np.asarray(b) for b in buffers])
        return jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(arrays))

    def __repr__(self) -> str:
        return f"GradientSync({self.strategy!r}, {self.comm!r})"


# ---------------------------------------------------------------------- functions
_DEFAULT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def allreduce_gradients(grads: Any, comm: commlib.Communicator | None = None) -> Any:
    """Average the gradient pytree ``grads`` over the ranks (fused all-reduce).

    Keeps one :class:`GradientSync` per communicator, so repeated calls reuse
    buffers.

    Example:
        >>> grads = allreduce_gradients(jax.grad(loss)(params, x, y))
    """
    comm = comm if comm is not None else commlib.world()
    sync = _DEFAULT.get(comm)
    if sync is None:
        sync = _DEFAULT[comm] = GradientSync(comm)
    return sync(grads)


def broadcast_params(params: Any, root: int = 0, comm: commlib.Communicator | None = None,
                     cap_mb: float = 64) -> Any:
    """Every rank gets ``root``'s ``params`` (any pytree of float16, bfloat16,
    float32, float64, int32 or int64 arrays: parameters, optimizer state),
    fused into buckets of ``cap_mb``.  Leaves come back as jax arrays on the
    caller's device.  Eager only (call it outside ``jax.jit``).

    Example:
        >>> params = broadcast_params(init(jax.random.key(rank)))   # rank 0's init everywhere
        >>> opt_state = broadcast_params(opt_state)
    """
    comm = comm if comm is not None else commlib.world()
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
    ``io_callback(ordered=True)``; not under ``vmap``/``pmap``).  A strategy's own
    state (sparse residuals, a tuned cap) stays in it: checkpoint ``strategy.state_dict()``
    too, and ``load_state_dict`` it before the first update after a restore.

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


class ShardedState(NamedTuple):
    """State of :func:`sharded_optimizer`: the inner optimizer's state over this
    rank's shard of each bucket (a list of 1-D arrays, one per bucket), and
    ``owner``, ``[rank, size]`` of the rank whose shard it is (an int32 array, so
    that a checkpoint keeps it): each rank must restore its own."""

    inner: Any
    owner: Any


def sharded_optimizer(inner: Any, comm: commlib.Communicator | None = None,
                      strategy: Strategy | None = None) -> Any:
    """DeAR with a sharded update: ``inner`` runs on this rank's shard of each bucket.

    ``update(grads, state, params)`` reduce-scatters (``avg``) the fused gradients, applies
    ``inner`` (any *elementwise* optax transformation: sgd with momentum or Nesterov, adam,
    adamw, schedules; not ones that look across leaves, such as ``clip_by_global_norm``, LAMB,
    ``apply_if_finite`` or masks keyed by the tree: tried on a small problem first, refused
    with ``ValueError``) to the gradient and parameter shards, and all-gathers the updates,
    which come back as a full pytree for ``optax.apply_updates``.  Optimizer
    state costs 1/world_size (it differs per rank: checkpoint every rank's and
    restore each its own; a state restored on another rank is refused, on
    every rank, at the first update).
    ``strategy`` must be sharded (default ``DeAR()``).  Eager only.

    Example:
        >>> tx = sharded_optimizer(optax.adamw(1e-3), strategy=DeAR(cap_mb=8))
        >>> state = tx.init(params)                  # after broadcast_params
        >>> updates, state = tx.update(grads, state, params)
        >>> params = optax.apply_updates(params, updates)
    """
    import jax.numpy as jnp
    import optax

    problem = shard_problem(inner)
    if problem:
        raise ValueError(f"sharded_optimizer: the update runs on flat shards of the buckets: {problem}; "
                         "use optax.chain(average_gradients(...), inner) instead (its state then on every "
                         "rank), or an elementwise transformation")
    strategy = checked_strategy(strategy, "sharded_optimizer") if strategy is not None else DeAR()
    if not strategy.sharded:
        raise ValueError(f"sharded_optimizer needs a sharded strategy (DeAR), got {strategy!r}")
    if strategy.tune:
        raise ValueError("sharded_optimizer: tuning the cap re-plans the buckets, which would re-shard "
                         "the optimizer state; give the strategy a fixed cap_mb")
    sync = GradientSync(comm, strategy)
    inner_update = jax.jit(inner.update)
    digest: list[tuple[int, int]] = []
    handed: list[ShardedState] = []     # the state this rank's update last returned (or init)

    def hand_out(state: ShardedState) -> ShardedState:
        handed[:] = [state]
        return state

    def check_owner(state: ShardedState) -> None:
        """A state this rank did not hand out (restored): is each rank's its own? (all learn it)"""
        comm = sync.comm
        owner = [int(v) for v in np.asarray(state.owner).reshape(-1)]
        wrong = comm.allgather_object(None if owner == [comm.rank, comm.size] else owner,
                                      label="sharded_optimizer: the state's owner")
        bad = [f"rank {r} holds rank {o[0]} of {o[1]}'s" for r, o in enumerate(wrong) if o is not None]
        if bad:
            raise ValidationError(f"sharded_optimizer: the optimizer state is per rank (each holds its "
                                  f"own shard's), but {', '.join(bad)}: save every rank's state and "
                                  "restore each its own (on as many ranks), or use optax.chain("
                                  "average_gradients(...), inner), whose state is the same on every rank")

    def shard_leaves(plan: Plan, leaves: Sequence[Any]) -> list[Any]:
        rank = sync.comm.rank
        plan.allocate(True)
        if not plan.extra:
            plan.extra = [np.zeros(b.padded, numpy_dtype(b.dtype)) for b in plan.buckets]
        for b in range(len(plan.buckets)):
            plan.pack_shard(b, leaves, rank, plan.extra)
        return [jnp.asarray(plan.extra[b][bk.shard(rank)].copy()) for b, bk in enumerate(plan.buckets)]

    def eager(tree: Any, what: str) -> tuple[Plan, list[Any]]:
        plan, leaves = sync._plan(tree)
        if any(is_tracer(x) for x in leaves):
            raise TypeError(f"sharded_optimizer.{what} runs eagerly: call it outside jax.jit "
                            "(or use average_gradients, which works inside jit)")
        return plan, leaves

    def init_fn(params: Any) -> ShardedState:
        plan, leaves = eager(params, "init")
        sync._checked(plan, sync.comm)
        digest[:] = [plan.digest]
        owner = np.array([sync.comm.rank, sync.comm.size], np.int32)
        return hand_out(ShardedState(inner.init(shard_leaves(plan, leaves)), owner))

    def update_fn(updates: Any, state: ShardedState, params: Any = None) -> tuple[Any, ShardedState]:
        plan, leaves = eager(updates, "update")
        if digest and plan.digest != digest[0]:
            raise ValidationError("sharded_optimizer: the gradient pytree differs from the parameters "
                                  "given to init (structure, shapes or dtypes)")
        shard_params = None
        if params is not None:
            pplan, pleaves = eager(params, "update")
            if pplan.digest != plan.digest:
                raise ValidationError("sharded_optimizer: params and gradients differ in structure, "
                                      "shapes or dtypes")
            shard_params = shard_leaves(plan, pleaves)
        if not handed or state is not handed[0]:
            check_owner(state)
        new_state: list[Any] = []

        def update(shards: list[np.ndarray]) -> None:
            grads = [jnp.asarray(s.copy()) for s in shards]
            out, st = inner_update(grads, state.inner, shard_params)
            new_state.append(st)
            rank = sync.comm.rank
            for b, bucket in enumerate(plan.buckets):
                plan.buffers[b][bucket.shard(rank)] = np.asarray(out[b])

        arrays = sync._run(plan, leaves, update)
        return (jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(arrays)),
                hand_out(ShardedState(new_state[0], state.owner)))

    return optax.GradientTransformation(init_fn, update_fn)
