"""Gradient pytrees averaged through fused host buffers (:class:`GradientSync`), and DeAR's
ZeRO-1 update driven by it (:func:`sharded_optimizer`): both run eagerly and inside ``jax.jit``
(ordered host calls, :func:`~commlib.bindings.jax_host.host_call`, over a communicator of their
own).  Documented with the rest of the binding in :mod:`bindings.jax`, which exports them."""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

import commlib
from commlib.arrays import INEXACT_DTYPES, is_tracer, numpy_dtype
from commlib.collectives import AllReduce, DeAR, Strategy, checked_strategy
from commlib.collectives.buckets import Bucket
from commlib.errors import ValidationError

from .jax_fusion import Plan, agree_plan, make_plan, shard_problem
from .jax_global import ranks_sum, summed_over_shards
from .jax_host import host_call
from .jax_state import shard_state, shards_problem, whole_state

_MAX_PLANS = 16            # bucket plans kept per GradientSync (least recently used dropped)
#: strategy -> the GradientSync that set it up last (weakly held): a strategy holds the buffers of
#: one plan at a time, so a GradientSync sets it up again after another one did
_SET_UP_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GradientSync:
    """Average gradient pytrees over the ranks through fused buffers and a strategy.

    ``comm``: a :class:`commlib.Communicator` (default :func:`commlib.world`).
    ``strategy``: a :class:`collectives.Strategy` (default
    ``AllReduce(cap_mb, first_cap_mb)``; give the caps to the strategy when
    you pass one).  A sharded strategy (``DeAR``) runs as a decoupled
    all-reduce: reduce-scatter (``avg``) of each bucket, then all-gather of
    the averaged shards.  ``check``: ``"first"`` compares a digest of the tree
    over the ranks on every call (a few words) and the whole tree when a structure is
    first seen or differs, ``"always"`` the whole tree on every call.

    Calls reuse the bucket plan and the host buffers of the tree structure
    (the last ``16`` structures are kept).  Works on concrete arrays and,
    through ordered host calls (:mod:`commlib.bindings.jax_host`), inside ``jax.jit``.  A strategy
    made with ``tune=...`` gets the time between calls (a step) and re-plans
    the buckets, on every rank at the same call, when its tuner moves the cap.

    One strategy object may serve several ``GradientSync`` s (each sets it up again for its
    tree), except a sparse one: its error feedback belongs to the tree it averages, so a second
    ``GradientSync`` using it raises ``ValueError`` on every rank before it communicates (give
    each its own).  A sparse strategy's state (residuals, selectors) is kept per tree structure
    when one ``GradientSync`` averages several (one optax transformation for two models).

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

    def _comm_for_jit(self) -> commlib.Communicator:
        """:attr:`jit_comm`, made when first needed: while tracing (every rank traces, on the thread
        that drives ``comm``)."""
        if self._jit_comm is None:
            self._jit_comm = self.comm.split(0)
            self.comm.close_with(self._jit_comm)    # closed with comm, on every rank alike (dropped
                                                    # with this object, it went whenever each rank's GC ran)
        return self._jit_comm

    def _checked(self, plan: Plan, comm: commlib.Communicator, problem: str | None = None) -> None:
        """Before a call's first collective, on every rank: one all-gather of a few words compares
        the tree's digest, whether this rank has a ``problem`` with it (a tree other than the one an
        optimizer was made for) and whether it was agreed before; where any of that differs, or it
        is new, :func:`agree_plan` on every rank (its error names the ranks and what differs).  A
        tree that changed on one rank after its first call raised there alone, while the peers
        trusted their cached plan and paired their all-reduce with its agreement (garbage of
        1e218 in their parameters, no error)."""
        row = np.array([plan.error is None and problem is None,
                        plan.agreed and self.check != "always", *plan.digest], np.int64)
        table = np.asarray(comm.allgather(row, tag="GradientSync-check")).reshape(comm.size, -1)
        if bool((table == table[0]).all()) and table[0, 0] and table[0, 1]:
            return
        try:
            agree_plan(comm, plan, "GradientSync", problem, settings=repr(self.strategy))
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
             comm: commlib.Communicator | None = None, into: Sequence[np.ndarray] | None = None,
             problem: str | None = None) -> list[np.ndarray]:
        """Drive the strategy over ``plan``'s buckets filled from ``leaves``: :meth:`_begin`, then
        :meth:`_finish` (``update``, ``comm``, ``into``, ``problem``: theirs; ``comm`` default
        ``self.comm``; the jitted path passes its own)."""
        with self._lock:
            self._begin(plan, leaves, comm if comm is not None else self.comm, problem)
            return self._finish(plan, update, into)

    def _begin(self, plan: Plan, leaves: Sequence[Any], comm: commlib.Communicator,
               problem: str | None = None) -> None:
        """The first half of a step: the buckets packed from ``leaves`` and launched over ``comm``; a
        sharded strategy's averaged shards are in ``plan.shards`` when it returns.  ``problem``: this
        rank's objection to the tree, raised on every rank by :meth:`_checked`."""
        s = self.strategy
        holder = _SET_UP_BY.get(s)
        holder = holder() if holder is not None else None
        if s.sparse and holder is not None and holder is not self:
            raise ValueError(f"{s!r} serves another GradientSync (average_gradients) already: a sparse "
                             "strategy keeps the error feedback of the tree it averages, so give each "
                             "its own strategy object")
        self._checked(plan, comm, problem)
        plan.allocate(s.sharded)
        self._last = plan
        try:
            if self._active is not plan or self._active_comm is not comm or holder is not self:
                before, self._active = (self._active if holder is self else None), None
                if s.sparse and before is not None:     # its residuals and selectors, for its next call
                    before.strategy_state = s.state_dict()
                s.setup(comm, plan.buckets, plan.buffers, plan.buffers,
                        plan.shards if s.sharded else None, broadcast=False)
                _SET_UP_BY[s] = weakref.ref(self)
                if s.sparse and plan.strategy_state is not None:
                    state, plan.strategy_state = plan.strategy_state, None
                    s.load_state_dict(state)
                self._active, self._active_comm = plan, comm
            for b in range(len(plan.buckets)):
                plan.pack(b, leaves)
                s.bucket_ready(b)        # bucket b travels while later ones are packed
            s.before_update()
        except BaseException:
            self._active = None          # set the strategy up afresh next time
            raise

    def _finish(self, plan: Plan, update: Callable[[list[np.ndarray]], None] | None = None,
                into: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """The second half: ``update`` (sharded strategy: called with the averaged gradient shards,
        it writes this rank's shard of each bucket of the result into ``plan.buffers``; default: the
        averaged gradients themselves), the gathers, and the result's leaves (written ``into``
        arrays shaped as the leaves where given: XLA's result buffers inside ``jax.jit``)."""
        s = self.strategy
        try:
            if s.sharded:
                if update is None:
                    rank = self.comm.rank
                    for b, bucket in enumerate(plan.buckets):
                        plan.buffers[b][bucket.shard(rank)] = plan.shards[b]
                else:
                    update(plan.shards)
            s.after_update()
            s.flush()
            out = plan.unpack(into=into)
            self._tune()
        except BaseException:
            self._active = None
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
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        jit_comm = self._comm_for_jit()
        n = len(leaves)

        def host(*arrays: np.ndarray) -> None:       # the leaves, then XLA's buffers of the results
            self._run(plan, arrays[:n], comm=jit_comm, into=arrays[n:])

        out = host_call(host, shapes, *leaves, into=True)
        return jax.tree_util.tree_unflatten(plan.treedef, out)

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

    problem = shard_problem(inner)
    if problem:
        raise ValueError(f"sharded_optimizer: the update runs on flat shards of the buckets: {problem}; "
                         "use optax.chain(average_gradients(...), inner) instead (its state then on every "
                         "rank), or an elementwise transformation (to clip by the global norm or skip "
                         "non-finite steps: commlib.bindings.jax.clip_by_global_norm or apply_if_finite, "
                         "which read the whole gradient over the ranks' shards)")
    strategy = checked_strategy(strategy, "sharded_optimizer") if strategy is not None else DeAR()
    if not strategy.sharded:
        raise ValueError(f"sharded_optimizer needs a sharded strategy (DeAR), got {strategy!r}")
    if strategy.tune:
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
        raised on every rank by the update's tree check (:meth:`GradientSync._checked`), which
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
        plan, leaves = sync._plan(tree)
        return plan, leaves, any(is_tracer(x) for x in leaves)

    def init_fn(params: Any) -> ShardedState:
        plan, leaves = sync._plan(params)
        sync._checked(plan, sync.comm)      # inside jax.jit: while tracing, which every rank does
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

        arrays = sync._run(plan, leaves, update, problem=problem)
        return (jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(arrays)),
                ShardedState(new_state[0], owned()))

    def traced_update(plan: Plan, leaves: list[Any], state: ShardedState,
                      pleaves: list[Any] | None, problem: str | None) -> tuple[Any, ShardedState]:
        """Inside ``jax.jit``: the reduce-scatter in one ordered callback (after the owner's check),
        ``inner.update`` traced on the shards (the parameters' taken in the traced code), the
        all-gather in another."""
        jit_comm = sync._comm_for_jit()
        if problem is not None:     # the check raises on every rank; nothing past it is traced
            def refuse(owner: np.ndarray, *gleaves: np.ndarray) -> list[np.ndarray]:
                sync._begin(plan, gleaves, jit_comm, problem)
                return [owner]

            got = host_call(refuse, [jax.ShapeDtypeStruct((3,), np.int32)], state.owner, *leaves)
            return (jax.tree_util.tree_unflatten(plan.treedef, list(leaves)),
                    ShardedState(state.inner, got[0]))
        shard_types = [jax.ShapeDtypeStruct((bk.shard_numel,), numpy_dtype(bk.dtype)) for bk in plan.buckets]

        def begin(owner: np.ndarray, *gleaves: np.ndarray) -> list[np.ndarray]:
            sync._begin(plan, gleaves, jit_comm, owner_problem(owner, jit_comm))
            return [owned(), *plan.shards]        # (copied into XLA's buffers)

        got = host_call(begin, [jax.ShapeDtypeStruct((3,), np.int32), *shard_types], state.owner, *leaves)
        pshards = None if pleaves is None else plan.shards_of(pleaves, sync.comm.rank)
        with summed_over_shards(ranks_sum(jit_comm)):
            out, inner_state = inner.update(list(got[1:]), state.inner, pshards)

        k = len(out)

        def finish(*arrays: np.ndarray) -> None:      # the updated shards, then XLA's buffers of the leaves
            sync._finish(plan, lambda _: write_shards(plan, arrays[:k]), into=arrays[k:])

        leaf_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        full = host_call(finish, leaf_types, *out, into=True)
        return jax.tree_util.tree_unflatten(plan.treedef, list(full)), ShardedState(inner_state, got[0])

    def eager(tree: Any, who: str) -> Plan:
        plan, leaves = sync._plan(tree)
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
