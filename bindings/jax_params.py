"""JAX binding for strategies that read and write the parameters: SelSync and Sync-Switch under optax.

:func:`~bindings.jax.average_gradients` sees gradients only, which is all
``AllReduce``, ``DeAR`` and ``SparseAllReduce`` need.  :class:`SelSync`
averages the *parameters* after local steps and :class:`SyncSwitch`'s
asynchronous phases push parameter changes and pull the parameter store, so
they need the parameters before and after the local update.
:class:`DistributedOptimizer` is an optax transformation (``init`` /
``update``) that wraps the whole optimizer and drives the strategy's
lifecycle around it, once per step:

1. a strategy that decides on the local gradient's 2-norm
   (``measures_gradients``: SelSync's gate) is handed it first
   (``observe_norm``: the ranks agree whether to synchronize); the gradients
   are packed into fused host buckets (the plan
   :func:`~bindings.jax.average_gradients` uses) where the step reads them
   (``step_reads_gradients()``: not SelSync's local steps, nor Sync-Switch's
   asynchronous ones), and the parameters too on the steps whose parameters
   the strategy reads (``step_reads_parameters()``: every Sync-Switch step,
   SelSync's averaging steps; on the others, local steps among them, the
   inner updates come back as they are);
2. ``bucket_ready`` for every bucket, then ``before_update()`` (in SelSync's
   grads mode, or in Sync-Switch's BSP, the gradients are averaged);
3. ``inner.update`` runs on the (averaged or local) gradients, its updates
   times the strategy's ``lr_scale`` (Sync-Switch's asynchronous phases: for
   optax's optimizers, whose updates are proportional to the learning rate,
   that is the learning rate scaled) are added to the parameter buckets;
4. ``after_update()`` (SelSync's parameter average on a synchronized step,
   Sync-Switch's push and pull, the policy's switch), and the optimizer
   state's floating leaves are averaged when the strategy asks for it
   (``SelSync(sync_optimizer_state=True)`` on a synchronized step, every return
   of Sync-Switch to BSP);
5. the returned updates are what takes each rank's parameters to the
   buckets' new contents.

Example (under ``mpiexec -n 4``):

    >>> from commlib.bindings.jax import DistributedOptimizer, broadcast_params
    >>> from commlib.collectives import SelSync
    >>> params = broadcast_params(params)                      # the same start everywhere
    >>> tx = DistributedOptimizer(optax.sgd(0.1, 0.9), strategy=SelSync(delta=0.3))
    >>> state = tx.init(params)                                # collective
    >>> for x, y in my_slice_of_each_batch:
    ...     grads = jax.grad(loss)(params, x, y)               # this rank's gradient
    ...     updates, state = tx.update(grads, state, params)   # collective on synchronized steps
    ...     params = optax.apply_updates(params, updates)
    >>> params = tx.flush(params)                              # replicas averaged: evaluate, save
    >>> params, state = tx.close(params, state)                # end of training

Inside ``jax.jit`` (the whole training step jitted) the same lifecycle runs as
ordered host calls (:mod:`commlib.bindings.jax_host`) around the traced ``inner.update``, each array
crossing to the host (a copy) only under a ``lax.cond`` on what the step
reads: the 2-norm computed in the traced code, the gradients, the parameters,
the averaged gradients back, the inner updates and the parameters' new values
(their difference to the parameters taken in the traced code), the optimizer
state averaged where the strategy asks.  The strategy's
collectives run over a communicator of the optimizer's own (``comm.split(0)``,
made by ``init``), so that a call you make on ``comm`` right after a jitted step
never interleaves with them on XLA's callback thread; the other methods wait
for the jitted steps' callbacks first (``jax.effects_barrier``).

Sharp bits: ``flush``, ``close`` and the state's methods run eagerly (``init`` jits
too: the tree compared while tracing, the values and the set-up in a callback);
``init`` and ``update`` are collective (every rank, in the same order); the
parameters given to ``init`` must be the same on every rank
(:func:`~bindings.jax.broadcast_params`), or ``init`` raises on every rank.
After a synchronized step every rank's bucket holds the same average; the
updates returned carry each rank there up to one rounding of
``params + (average - params)`` (exact wherever both lie within a factor of
two of each other, as after a few local steps).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import commlib
from commlib.arrays import INEXACT_DTYPES, is_tracer, numpy_dtype
from commlib.collectives import AllReduce, Strategy, checked_strategy
from commlib.collectives.buckets import MiB
from commlib.collectives.significance import l2_norm
from commlib.errors import MismatchError, ValidationError
from commlib.ops import agree

from .jax_fusion import Plan, agree_plan, make_plan
from .jax_host import host_call
from .jax_sync import GradientSync

__all__ = ["DistributedOptimizer"]


def _l2_norm(leaves: Sequence[Any]) -> Any:
    """The 2-norm of a traced gradient's leaves (what :func:`collectives.significance.l2_norm` gives on
    the host), accumulated in float32 at least."""
    squares = [jnp.square(jnp.abs(g).astype(jnp.promote_types(g.dtype, jnp.float32))) for g in leaves]
    return jnp.sqrt(sum(jnp.sum(x) for x in squares))


class DistributedOptimizer:
    """An optax ``GradientTransformation`` (``init``, ``update``) that runs ``inner`` under ``strategy``.

    ``inner``: the whole optax optimizer (``optax.sgd``, ``optax.adamw``, a
    chain).  ``strategy``: any strategy whose update runs on whole leaves:
    :class:`~collectives.SelSync` (both modes, over AllReduce, DeAR or a
    sparse strategy), :class:`~collectives.SyncSwitch` over ``AllReduce``
    (not ``bsp=DeAR()``, whose BSP update runs on shards: use it from torch),
    ``AllReduce`` or ``SparseAllReduce`` (the same as
    ``optax.chain(average_gradients(strategy=...), inner)``, eagerly).  A policy
    that resets or ramps momentum at a switch is refused (an optax optimizer's
    momentum cannot be changed from outside), as is ``tune`` (give a fixed
    ``cap_mb``).  ``comm``: default :func:`commlib.world` (the strategy runs on a
    split of it, made by :meth:`init`).  ``update`` runs eagerly or inside ``jax.jit``.

    Beyond optax's pair: :meth:`flush` (parameters current on every rank:
    SelSync averages drifted replicas, Sync-Switch's asynchronous phases pull
    the store), :meth:`close` (end of training: Sync-Switch returns to BSP),
    :meth:`state_dict` / :meth:`load_state_dict` (the strategy's state: the
    gate's meter, the phase, the policy; each rank its own, beside optax's
    state).

    Example:
        >>> tx = DistributedOptimizer(optax.adamw(1e-3), strategy=SelSync(delta=0.3, mode="grads"))
        >>> state = tx.init(params)
        >>> @jax.jit
        ... def train_step(params, state, x, y):
        ...     updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
        ...     return optax.apply_updates(params, updates), state
        >>> params, state = train_step(params, state, x, y)
        >>> tx.strategy.stats["lssr"]                 # the share of local steps
    """

    def __init__(self, inner: Any, strategy: Strategy | None = None,
                 comm: commlib.Communicator | None = None):
        strategy = checked_strategy(strategy, "DistributedOptimizer") if strategy is not None else AllReduce()
        if strategy.needs_shard_grads:
            raise ValueError(f"DistributedOptimizer: {strategy!r} runs the update on shards of the buckets; "
                             "here optax updates whole leaves: use bsp=AllReduce() for Sync-Switch, "
                             "sharded_optimizer(inner) for DeAR's ZeRO-1 update, or "
                             "optax.chain(average_gradients(strategy=DeAR()), inner)")
        if strategy.changes_momentum:
            raise ValueError(f"DistributedOptimizer: {strategy!r} resets or ramps momentum at a switch, "
                             "which an optax optimizer cannot be told: use momentum='keep' in the policy")
        if strategy.tuned:
            raise ValueError("DistributedOptimizer: tuning the cap re-plans the buckets, which this "
                             "transformation does not do; give the strategy a fixed cap_mb")
        if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
            raise TypeError(f"DistributedOptimizer: inner must be an optax GradientTransformation, "
                            f"got {type(inner).__name__}")
        self.inner = inner
        self.strategy = strategy
        self.comm = commlib.as_communicator(comm, "DistributedOptimizer")
        self._inner_update = jax.jit(inner.update)
        self._plan: Plan | None = None
        self._params: list[np.ndarray] = []      # the parameter buckets the strategy reads and writes
        self._updates: list[np.ndarray] = []     # the local update, packed
        self._state_sync: Any = None             # a GradientSync: the optimizer state's average
        self._average_state = False              # a switch back to BSP asked for it
        self._closed = False
        self._comm: commlib.Communicator | None = None     # the strategy's: a split of comm (init)
        self._averages: list[np.ndarray] | None = None      # this step's averaged gradients, unpacked
        strategy.on_switch(self._on_switch)

    # ------------------------------------------------------------------ optax's pair
    def init(self, params: Any, same_start: bool = True) -> Any:
        """``inner.init(params)``, after setting the strategy up on the buckets of ``params``
        (collective: the tree is compared over the ranks, and with ``same_start`` the values too;
        either differing raises on every rank).  ``same_start=False``: each rank resumes its own
        checkpoint, whose replicas may have drifted apart (SelSync's local steps, Sync-Switch's ASP).
        Eagerly or inside ``jax.jit`` (a jitted ``TrainState.create``): the tree is then compared
        while tracing, and the values and the set-up run in an ordered ``io_callback``, before the
        steps' callbacks (a disagreement surfaces, on every rank, at the next step).

        Example:
            >>> state = tx.init(params)              # params = broadcast_params(...) before
        """
        leaves, treedef = jax.tree_util.tree_flatten(params)
        self._plan = None
        if self._comm is None:      # every rank (tracing too): the strategy's collectives never meet yours
            self._comm = self.comm.split(0)
            self.comm.close_with(self._comm)        # at the latest with comm (its windows freed first)
        s, comm = self.strategy, self._comm
        plan = make_plan(params, leaves, treedef, INEXACT_DTYPES, comm.size, s.cap_bytes, s.first_cap_bytes)
        agree_plan(comm, plan, "DistributedOptimizer", settings=repr(s))
        plan.allocate(False)
        self._params = [np.zeros(b.padded, numpy_dtype(b.dtype)) for b in plan.buckets]
        self._updates = [np.zeros(b.padded, numpy_dtype(b.dtype)) for b in plan.buckets]

        def set_up(*values: Any) -> np.int32:
            for b in range(len(plan.buckets)):
                plan.pack(b, values, into=self._params)
            if same_start:
                self._agree_values(self._params, comm)
            s.setup(comm, plan.buckets, self._params, plan.buffers, None, broadcast=False)
            return np.int32(0)

        if any(is_tracer(x) for x in leaves):
            host_call(set_up, jax.ShapeDtypeStruct((), np.int32), *leaves)
        else:
            jax.effects_barrier()                 # a jitted step's callbacks have run
            set_up(*leaves)
        self._plan, self._closed, self._average_state = plan, False, False
        return self.inner.init(params)

    def update(self, updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        """One step: ``updates`` are this rank's gradients; returns the updates that take
        ``params`` to the step's result (``optax.apply_updates``) and the new optimizer state.
        Eagerly or inside ``jax.jit`` (see the module's doc)."""
        plan = self._ready("update")
        s = self.strategy
        if params is None and s.updates_parameters:
            raise ValueError(f"DistributedOptimizer.update: {s.name} reads and writes the parameters: "
                             "call update(grads, state, params)")
        gleaves = self._leaves(updates, "gradients", None)
        pleaves = self._leaves(params, "parameters", None) if params is not None else []
        if any(is_tracer(x) for x in (*gleaves, *pleaves)):
            return self._traced(gleaves, state, pleaves, params)
        jax.effects_barrier()                     # a jitted step's callbacks have run
        packed, reads = self._host_begin([l2_norm(gleaves)] if s.measures_gradients else [])
        if packed:
            self._take(pleaves)
        after, scale, average, averaged = self._host_before(gleaves if reads else [])
        if averaged:                              # else this rank's own are what it gave
            updates = jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(self._host_averages()))
        local, state = self._inner_update(updates, state, params)
        if not after:                             # the update alone makes the step (a local one)
            if scale != 1.0:
                local = jax.tree_util.tree_map(lambda u: u * np.asarray(scale, u.dtype), local)
            return local, self._averaged(state) if average else state
        if not packed:
            self._take(pleaves)
        moved = self._apply(self._leaves(local, "inner's updates", "update"), pleaves)
        state = self._state_after_step(state)
        return jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(moved)), state

    def _apply(self, uleaves: Sequence[Any], pleaves: Sequence[Any]) -> list[np.ndarray]:
        """The inner updates (times ``lr_scale``) added to the parameter buckets, ``after_update()``;
        returns what takes each of ``pleaves`` to its bucket's result (none for none)."""
        plan, s = self._plan, self.strategy
        scale = float(s.lr_scale)
        for b in range(len(plan.buckets)):
            u, p = self._updates[b], self._params[b]
            plan.pack(b, uleaves, into=self._updates)
            if scale != 1.0:
                np.multiply(u, u.dtype.type(scale), out=u)
            np.add(p, u, out=p)
        s.after_update()
        s.complete()
        if not pleaves:
            return []
        return [np.subtract(new, np.asarray(old)) for new, old in zip(plan.unpack(self._params), pleaves)]

    # ------------------------------------------------------------------ inside jax.jit
    def _traced(self, gleaves: list[Any], state: Any, pleaves: list[Any], params: Any) -> tuple[Any, Any]:
        """:meth:`update` inside ``jax.jit``: its host part (:meth:`_host_begin`, :meth:`_host_before`,
        :meth:`_host_after`) as ordered callbacks around the traced inner update, each array crossing
        to the host only on the steps that read it there (a crossing is a copy: about 3 ms for 7.4 MB
        here): the parameters where the strategy reads them, the gradients where it reads them (not
        SelSync's local steps, whose 2-norm is measured here, nor Sync-Switch's asynchronous ones),
        the averaged gradients back where they were averaged.  A local step (nothing averaged, nothing
        written back) takes a branch of its own: the inner update alone."""
        plan, flag = self._plan, jax.ShapeDtypeStruct((), np.int32)
        scalar = jax.ShapeDtypeStruct((), jax.dtypes.canonicalize_dtype(np.float64))
        like = [jax.ShapeDtypeStruct(shape, numpy_dtype(dt)) for shape, dt in zip(plan.shapes, plan.dtypes)]

        def call(fn: Any, out: Any, *args: Any) -> Any:
            return host_call(fn, out, *args)

        def take() -> Any:
            return call(self._host_take, flag, pleaves)

        def skip() -> Any:
            return np.int32(0)

        norm = [_l2_norm(gleaves)] if self.strategy.measures_gradients else []
        packed, reads = call(self._host_begin, [flag, flag], norm)
        jax.lax.cond(packed > 0, take, skip)
        out, before = [flag, scalar, flag, flag], self._host_before
        after, scale, average, averaged = jax.lax.cond(
            reads > 0, lambda: call(before, out, gleaves), lambda: call(before, out, []))

        def averages() -> list[Any]:
            return [a.astype(g.dtype) for a, g in zip(call(self._host_averages, like), gleaves)]

        def inner_update(grads: list[Any]) -> tuple[list[Any], Any]:
            local, st = self.inner.update(jax.tree_util.tree_unflatten(plan.treedef, grads), state, params)
            return self._leaves(local, "inner's updates", None), st

        def with_parameters(uleaves: list[Any]) -> tuple[list[Any], Any]:
            jax.lax.cond(packed > 0, skip, take)
            *new, average = call(self._host_after, [*like, flag], uleaves)
            return [(n - p).astype(u.dtype) for n, p, u in zip(new, pleaves, uleaves)], average

        def local_only(uleaves: list[Any]) -> tuple[list[Any], Any]:
            return [u * scale.astype(u.dtype) for u in uleaves], average

        def local_step() -> tuple[list[Any], Any]:       # SelSync's local steps: the update alone
            uleaves, st = inner_update(gleaves)
            return local_only(uleaves)[0], st

        def any_step() -> tuple[list[Any], Any]:
            uleaves, st = inner_update(jax.lax.cond(averaged > 0, averages, lambda: gleaves))
            if pleaves:
                moved, avg = jax.lax.cond(after > 0, with_parameters, local_only, uleaves)
            else:       # no parameters given: a strategy that never reads them (AllReduce, sparse)
                moved, avg = local_only(uleaves)
            return moved, jax.lax.cond(avg > 0, self._averaged, lambda x: x, st)

        # one branch whose outputs are the step's: a cond carrying arrays copies them (1.3 ms per 7.4 MB)
        plain = (averaged == 0) & (after == 0) & (average == 0)
        moved, state = jax.lax.cond(plain, local_step, any_step)
        return jax.tree_util.tree_unflatten(plan.treedef, moved), state

    def _host_begin(self, norm: Sequence[Any]) -> list[np.int32]:
        """A step begins: where the strategy measures the gradients, their 2-norm handed over (``norm``:
        ``[norm]``; SelSync's gate decides on it).  Returns whether the step reads the parameters
        before the update and whether it reads the gradients' values."""
        s = self.strategy
        packed = s.step_reads_parameters()
        if norm:
            s.observe_norm(float(np.asarray(norm[0])))
        return [np.int32(packed), np.int32(s.step_reads_gradients())]

    def _host_take(self, pleaves: list[np.ndarray]) -> np.int32:
        self._take(pleaves)
        return np.int32(0)

    def _host_before(self, gleaves: Sequence[Any]) -> list[Any]:
        """The gradients packed (where given), ``bucket_ready``, ``before_update()``; returns whether
        the step reads the parameters after the update (else ``after_update()`` is done here),
        ``lr_scale``, whether the optimizer state is averaged (on a step without the parameters)
        and whether the gradients were averaged."""
        plan, s = self._plan, self.strategy
        for b in range(len(plan.buckets)):
            if gleaves:
                plan.pack(b, gleaves)
            s.bucket_ready(b)
        s.before_update()
        averaged = not s.gradients_are_local()
        self._averages = plan.unpack() if averaged else None     # read before after_update()
        after = s.step_reads_parameters()
        if not after:
            s.after_update()
            s.complete()
        average = not after and self._wants_state_average()
        scale = np.asarray(s.lr_scale, jax.dtypes.canonicalize_dtype(np.float64))
        return [np.int32(after), scale, np.int32(average), np.int32(averaged)]

    def _host_averages(self) -> list[np.ndarray]:
        """The averaged gradients :meth:`_host_before` read (once)."""
        averages, self._averages = self._averages, None
        return averages

    def _host_after(self, uleaves: list[np.ndarray]) -> list[Any]:
        """:meth:`_apply` (the parameters taken before); returns the parameters' new values and whether
        the optimizer state is averaged."""
        self._apply(uleaves, ())
        return [*self._plan.unpack(self._params), np.int32(self._wants_state_average())]

    # ------------------------------------------------------------------ beyond optax
    def flush(self, params: Any) -> Any:
        """``params`` made current on every rank (collective): SelSync's drifted replicas
        averaged (``average_on_flush``), Sync-Switch's store pulled in an asynchronous phase.
        Call before evaluating or saving.

        Example:
            >>> params = tx.flush(params)
        """
        self._ready("flush")
        jax.effects_barrier()
        self._take(self._leaves(params, "parameters", "flush"))
        self.strategy.flush()
        return self._result()

    def close(self, params: Any, state: Any) -> tuple[Any, Any]:
        """End of training (collective): the parameters flushed, Sync-Switch back to BSP with
        the optimizer state averaged, the strategy's windows freed.  Returns ``(params, state)``.

        Example:
            >>> params, state = tx.close(params, state)
        """
        self._ready("close")
        jax.effects_barrier()
        self._take(self._leaves(params, "parameters", "close"))
        self.strategy.flush()
        self.strategy.close()
        self._closed = True
        if self._average_state:
            state, self._average_state = self._averaged(state), False
        self._comm.close()          # the strategy's communicator (a later init makes another)
        self._comm = self._state_sync = None
        return self._result(), state

    def state_dict(self) -> dict[str, Any]:
        """The strategy's state (this rank's; save it beside optax's state).

        Example:
            >>> ckpt = {"params": params, "opt": state, "strategy": tx.state_dict()}
        """
        jax.effects_barrier()
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any], params: Any) -> None:
        """Restore the strategy's state after :meth:`init`, with the parameters being resumed
        (collective for Sync-Switch, which re-enters the checkpoint's phase from them).

        Example:
            >>> opt_state = tx.init(ckpt["params"]); tx.load_state_dict(ckpt["strategy"], ckpt["params"])
        """
        self._ready("load_state_dict")
        jax.effects_barrier()
        self._take(self._leaves(params, "parameters", "load_state_dict"))
        self.strategy.load_state_dict(state)
        self._average_state = False         # a roll-back's switch: the checkpoint's optimizer state stands

    # ------------------------------------------------------------------ helpers
    def _wants_state_average(self) -> bool:
        """After ``after_update()``: whether the optimizer state is averaged now (the request taken)."""
        wants = self.strategy.syncs_optimizer_state() or self._average_state
        self._average_state = False
        return wants

    def _state_after_step(self, state: Any) -> Any:
        return self._averaged(state) if self._wants_state_average() else state

    def _on_switch(self, old: str, new: str, changes: dict[str, Any]) -> None:
        if new == "bsp" and not self._closed:
            self._average_state = True

    def _ready(self, what: str) -> Plan:
        if self._plan is None:
            raise RuntimeError(f"DistributedOptimizer.{what} before init(params) (call init on every rank)")
        if self._closed:
            raise RuntimeError(f"DistributedOptimizer.{what} after close()")
        return self._plan

    @staticmethod
    def _eager(leaves: Sequence[Any], what: str) -> None:
        if any(is_tracer(x) for x in leaves):
            raise TypeError(f"DistributedOptimizer.{what} runs eagerly: call it outside jax.jit "
                            "(between jitted steps; update works inside)")

    def _leaves(self, tree: Any, what: str, call: str | None) -> list[Any]:
        """``tree``'s leaves, which must match the tree given to ``init`` (checked on this rank,
        refused as its next operation on the strategy's communicator: a peer that makes it raises
        too, instead of waiting there for this rank until its timeout); concrete ones unless
        ``call`` is None."""
        plan = self._plan
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if call is not None:
            self._eager(leaves, call)
        if treedef != plan.treedef or [tuple(np.shape(x)) for x in leaves] != plan.shapes:
            self._comm.refuse(f"DistributedOptimizer.{call or 'update'}", ValidationError(
                f"DistributedOptimizer: the {what} differ from the parameters given to init in "
                f"structure or shapes ({treedef} against {plan.treedef})"))
        return leaves

    def _take(self, leaves: Sequence[Any]) -> None:
        """The parameters' leaves into the parameter buckets."""
        for b in range(len(self._plan.buckets)):
            self._plan.pack(b, leaves, into=self._params)

    def _result(self) -> Any:
        plan = self._plan
        return jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(plan.unpack(self._params)))

    @staticmethod
    def _agree_values(buffers: Sequence[np.ndarray], comm: commlib.Communicator) -> None:
        digest = hashlib.sha256()
        for buf in buffers:
            digest.update(np.ascontiguousarray(buf).view(np.uint8))
        try:
            agree(comm, "DistributedOptimizer.init", digest.hexdigest(), noun="parameters")
        except MismatchError as e:
            raise ValidationError(f"DistributedOptimizer.init: the parameters differ across ranks (ranks "
                                  f"{e.ranks} against rank 0): start every rank from the same ones, "
                                  "params = broadcast_params(params)") from None

    def _averaged(self, state: Any) -> Any:
        """``state`` with its floating leaves averaged over the ranks (fused, collective)."""
        comm = self._comm
        leaves, treedef = jax.tree_util.tree_flatten(state)
        which = [i for i, x in enumerate(leaves)
                 if hasattr(x, "dtype") and np.dtype(x.dtype).name in INEXACT_DTYPES and np.size(x)]
        if comm.size == 1 or not which:
            return state
        if self._state_sync is None:    # traced in any phase, also where the ranks trace apart (ASP):
            # over the optimizer's own communicator, which its ordered host calls alone use
            self._state_sync = GradientSync(comm, AllReduce(self.strategy.cap_bytes / MiB), jit_comm=comm)
        for i, x in zip(which, self._state_sync([leaves[i] for i in which])):
            leaves[i] = x
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.strategy!r}, {self.comm!r})"
