"""Gradient pytrees averaged through fused host buffers (:class:`GradientSync`), eagerly and inside
``jax.jit`` (ordered host calls, :func:`~commlib.bindings.jax_host.host_call`, over a communicator of
their own); :func:`~bindings.jax_sharded.sharded_optimizer` drives it step by step (its
:meth:`~GradientSync.plan`, :meth:`~GradientSync.begin` and :meth:`~GradientSync.finish`).
Documented with the rest of the binding in :mod:`bindings.jax`, which exports them."""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import commlib
from commlib.arrays import INEXACT_DTYPES, is_tracer, numpy_dtype
from commlib.collectives import AllReduce, Strategy, checked_strategy
from commlib.collectives.buckets import Bucket
from commlib.errors import ValidationError

from .jax_fusion import Plan, agree_plan, make_plan
from .jax_host import host_call

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
    first seen or differs, ``"always"`` the whole tree on every call.  ``jit_comm``: the
    communicator of the jitted path (default ``comm.split(0)``, made when a call is first traced:
    on every rank, so not where the ranks trace apart, as in Sync-Switch's ASP); a driver whose
    communicator carries nothing but its own ordered host calls passes ``comm`` itself.

    Calls reuse the bucket plan and the host buffers of the tree structure
    (the last ``16`` structures are kept).  Works on concrete arrays and,
    through ordered host calls (:mod:`commlib.bindings.jax_host`), inside ``jax.jit``.  A strategy
    made with ``tune=...`` gets the time between calls (a step) and re-plans
    the buckets, on every rank at the same call, when its tuner moves the cap.

    One strategy object may serve several ``GradientSync`` s (each sets it up again for its
    tree), except a sparse one: its error feedback belongs to the tree it averages, so a second
    ``GradientSync`` using it raises ``ValueError`` on every rank before it communicates (give
    each its own).  A sparse strategy's state (residuals, selectors) is kept per tree structure
    when one ``GradientSync`` averages several (one optax transformation for two models), and its
    ``state_dict()`` holds every tree's (each goes back to its own tree after a load).

    Example:
        >>> sync = GradientSync(strategy=DeAR(cap_mb=4))
        >>> grads = sync(jax.grad(loss)(params, x, y))
        >>> sync.describe()            # the fusion plan: one dict per bucket
    """

    def __init__(self, comm: commlib.Communicator | None = None, strategy: Strategy | None = None,
                 cap_mb: float | None = None, first_cap_mb: float | None = None, check: str = "first",
                 jit_comm: commlib.Communicator | None = None):
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
        self.comm = commlib.as_communicator(comm, "GradientSync")
        self.strategy = strategy
        self.check = check
        self._plans: OrderedDict[Any, Plan] = OrderedDict()
        self._active: Plan | None = None
        self._active_comm: commlib.Communicator | None = None
        self._jit_comm: commlib.Communicator | None = jit_comm
        self._last: Plan | None = None
        self._last_call: float | None = None
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ plans
    # A driver of its own steps (sharded_optimizer) calls plan, then begin and finish (or run:
    # both), with comm_for_jit's communicator inside jax.jit; check_tree is begin's first step.
    def plan(self, tree: Any, allowed: Sequence[str] = INEXACT_DTYPES) -> tuple[Plan, list[Any]]:
        """The bucket plan of ``tree`` (kept per structure, shapes, dtypes, shardings and caps: the
        last 16) and its leaves; ``allowed``: the dtypes it may hold.

        Example:
            >>> plan, leaves = sync.plan(grads)
            >>> plan.describe()
        """
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

    def comm_for_jit(self) -> commlib.Communicator:
        """:attr:`jit_comm`, made when first needed: while tracing (every rank traces, on the thread
        that drives ``comm``).

        Example:
            >>> jit_comm = sync.comm_for_jit()      # inside the traced function
        """
        if self._jit_comm is None:
            self._jit_comm = self.comm.split(0)
            self.comm.close_with(self._jit_comm)    # closed with comm, on every rank alike (dropped
                                                    # with this object, it went whenever each rank's GC ran)
        return self._jit_comm

    def check_tree(self, plan: Plan, comm: commlib.Communicator, problem: str | None = None) -> None:
        """Before a call's first collective, on every rank: one all-gather of a few words compares
        the tree's digest, whether this rank has a ``problem`` with it (a tree other than the one an
        optimizer was made for) and whether it was agreed before; where any of that differs, or it
        is new, :func:`agree_plan` on every rank (its error names the ranks and what differs).  A
        tree that changed on one rank after its first call raised there alone, while the peers
        trusted their cached plan and paired their all-reduce with its agreement (garbage of
        1e218 in their parameters, no error).

        Example:
            >>> sync.check_tree(plan, sync.comm, None if mine else "not this rank's tree")
        """
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
    def run(self, plan: Plan, leaves: Sequence[Any],
             update: Callable[[list[np.ndarray]], None] | None = None,
             comm: commlib.Communicator | None = None, into: Sequence[np.ndarray] | None = None,
             problem: str | None = None) -> list[np.ndarray]:
        """Drive the strategy over ``plan``'s buckets filled from ``leaves``: :meth:`begin`, then
        :meth:`finish` (``update``, ``comm``, ``into``, ``problem``: theirs; ``comm`` default
        ``self.comm``; the jitted path passes its own).

        Example:
            >>> averaged = sync.run(*sync.plan(grads))       # flat host arrays, one per leaf
        """
        with self._lock:
            self.begin(plan, leaves, comm if comm is not None else self.comm, problem)
            return self.finish(plan, update, into)

    def begin(self, plan: Plan, leaves: Sequence[Any], comm: commlib.Communicator,
               problem: str | None = None) -> None:
        """The first half of a step: the buckets packed from ``leaves`` and launched over ``comm``; a
        sharded strategy's averaged shards are in ``plan.shards`` when it returns.  ``problem``: this
        rank's objection to the tree, raised on every rank by :meth:`check_tree`.

        Example:
            >>> sync.begin(plan, leaves, sync.comm)
            >>> out = sync.finish(plan, update=write_my_shards)
        """
        s = self.strategy
        holder = _SET_UP_BY.get(s)
        holder = holder() if holder is not None else None
        if s.sparse and holder is not None and holder is not self:
            raise ValueError(f"{s!r} serves another GradientSync (average_gradients) already: a sparse "
                             "strategy keeps the error feedback of the tree it averages, so give each "
                             "its own strategy object")
        self.check_tree(plan, comm, problem)
        plan.allocate(s.sharded)
        self._last = plan
        try:
            if self._active is not plan or self._active_comm is not comm or holder is not self:
                self._active = None      # a sparse strategy keeps each tree's state by its key
                s.setup(comm, plan.buckets, plan.buffers, plan.buffers,
                        plan.shards if s.sharded else None, broadcast=False, tree=plan.key)
                _SET_UP_BY[s] = weakref.ref(self)
                self._active, self._active_comm = plan, comm
            for b in range(len(plan.buckets)):
                plan.pack(b, leaves)
                s.bucket_ready(b)        # bucket b travels while later ones are packed
            s.before_update()
        except BaseException:
            self._active = None          # set the strategy up afresh next time
            raise

    def finish(self, plan: Plan, update: Callable[[list[np.ndarray]], None] | None = None,
                into: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """The second half: ``update`` (sharded strategy: called with the averaged gradient shards,
        it writes this rank's shard of each bucket of the result into ``plan.buffers``; default: the
        averaged gradients themselves), the gathers, and the result's leaves (written ``into``
        arrays shaped as the leaves where given: XLA's result buffers inside ``jax.jit``).

        Example:
            >>> out = sync.finish(plan)       # the averaged gradients' leaves
        """
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
        if tuner is not None and not tuner.done:      # a broadcast: the same step on every rank
            new_cap = tuner.observe(None if self._last_call is None else now - self._last_call)
            if new_cap is not None:
                self.strategy.cap_bytes = int(new_cap)       # part of the plan key
                now = time.perf_counter()
        self._last_call = now

    def __call__(self, grads: Any) -> Any:
        """The average over the ranks of ``grads`` (a pytree), as a pytree of jax arrays."""
        plan, leaves = self.plan(grads)
        if any(is_tracer(x) for x in leaves):
            return self._traced(plan, leaves)
        return jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(self.run(plan, leaves)))

    def _traced(self, plan: Plan, leaves: Sequence[Any]) -> Any:
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        jit_comm = self.comm_for_jit()
        n = len(leaves)
        strategy = self.strategy
        traced_caps = (strategy.cap_bytes, strategy.first_cap_bytes)

        def host(*arrays: np.ndarray) -> None:       # the leaves, then XLA's buffers of the results
            now = plan
            if (strategy.cap_bytes, strategy.first_cap_bytes) != traced_caps:   # tuned since traced:
                now, _ = self.plan(jax.tree_util.tree_unflatten(plan.treedef, list(arrays[:n])))  # its plan
            self.run(now, arrays[:n], comm=jit_comm, into=arrays[n:])

        out = host_call(host, shapes, *leaves, into=True)
        return jax.tree_util.tree_unflatten(plan.treedef, out)

    def flatten(self, tree: Any) -> list[np.ndarray]:
        """The fused host buffers of ``tree`` (copies; no communication): for inspection."""
        plan, leaves = self.plan(tree)
        if plan.error:
            raise ValidationError(f"GradientSync: {plan.error}")
        bufs = [np.zeros(b.padded, numpy_dtype(b.dtype)) for b in plan.buckets]
        for b in range(len(bufs)):
            plan.pack(b, leaves, into=bufs)
        return bufs

    def unflatten(self, buffers: Sequence[np.ndarray], like: Any) -> Any:
        """Inverse of :meth:`flatten`: a pytree shaped like ``like`` from fused buffers."""
        plan, _ = self.plan(like)
        if len(buffers) != len(plan.buckets):
            raise ValidationError(f"{len(buffers)} buffers for {len(plan.buckets)} buckets")
        arrays = plan.unpack([np.asarray(b) for b in buffers])
        return jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(arrays))

    def __repr__(self) -> str:
        return f"GradientSync({self.strategy!r}, {self.comm!r})"
