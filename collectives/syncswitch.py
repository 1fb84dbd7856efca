"""``SyncSwitch``: BSP, ASP and SSP in one job, switched in place by a policy (arXiv 2104.08364).

BSP steps go through an inner strategy (``bsp=AllReduce()`` by default, or
``DeAR()``: BSP steps then update shards, ZeRO-1, and ``sharded`` is True in
BSP only).  Asynchronous steps go through a
:class:`~collectives.paramstore.ParamStore` (one per bucket) in MPI one-sided
windows: after the local update, a rank pushes its change (``params - params
before the update``) atomically into the store and pulls the store back into
its parameters; SSP also ticks its clock and waits while it is more than
``staleness`` steps ahead of the slowest rank, before the pull.

Switching, inside the running job, with nothing lost or applied twice:

* BSP -> ASP/SSP (all ranks at the same step: BSP is lockstep and every
  policy decides the same on every rank): the inner strategy is flushed (DeAR's
  all-gathers land: the parameters are whole and identical), the
  store is loaded from the replicas (identical; each rank writes its own
  shard locally, between barriers, no data travels), clocks start at 0, the
  progress thread (if any) starts.
* ASP/SSP -> BSP (ranks arrive whenever they finish their step): each rank's
  last push is complete (pushes flush before returning), a barrier (commlib's,
  with its timeout) waits for all, then every rank pulls the same store
  contents: replicas are identical again.  Buffers registered with
  :meth:`register_state_buffers` (optimizer state such as momentum, which
  drifts apart while asynchronous) are averaged over ranks so that the
  replicas' optimizers agree too.

What a binding calls (the usual strategy lifecycle; ``sharded`` is the BSP
strategy's in BSP phases and False in asynchronous ones, so that over DeAR
the binding's ``on_switch`` callback moves the optimizer's state between this
rank's pieces and whole tensors, gathered leaving BSP and averaged then split
on the way back):

1. ``setup(comm, buckets, params, grads, shard_grads=None, broadcast=True)``
   once (collective; ``shard_grads`` as DeAR's, when ``needs_shard_grads``;
   the store's windows are made at the first switch out of BSP);
2. per step: ``bucket_ready(b)`` from backward; ``before_update()``; the
   optimizer's update of ``params`` (scale its learning rate by
   :attr:`lr_scale` and its momentum coefficient by :attr:`momentum_scale`);
   ``after_update()`` (asynchronous exchange, policy decision, switches);
3. ``flush()`` before evaluation / checkpoint; ``close()`` at the end
   (collective: replicas identical again; ``DistributedOptimizer.close()``
   calls it; without it the windows are still freed when the communicator
   closes, at interpreter exit too);
4. optional: :meth:`register_state_buffers` (flat optimizer-state arrays:
   zeroed when the policy asks for a momentum reset, averaged when returning
   to BSP) or :meth:`on_switch` callbacks ``fn(old, new, changes)`` for state
   that is not flat (torch optimizers' per-parameter momentum).

Without an optimizer (flat numpy buffers, plain SGD): fill ``grads`` and call
``step(lr)``: BSP averages the gradients and applies ``-lr * grad`` (over
DeAR: to this rank's shard, then all-gathered); ASP
pushes ``-lr * lr_scale * grad`` and pulls; SSP also waits on the clocks.

State (``state_dict()``): steps, phase, this rank's clock, the learning-rate
and momentum scales, the policy's state and the inner strategy's; in an
asynchronous phase also the parameter store as this rank reads it, which the
load writes back (each rank its piece).  A load that re-enters an
asynchronous phase is a collective: every rank loads.

Example:
    >>> from commlib.collectives import AllReduce
    >>> from commlib.collectives.policies import OfflinePolicy
    >>> ss = SyncSwitch(bsp=AllReduce(), policy=OfflinePolicy(0.25, total_steps=1000, lr_scale=0.5))
    >>> ss.setup(comm, buckets, params, grads)
    >>> for step in range(1000):
    ...     grads[0][:] = compute_gradient(params[0])
    ...     ss.step(lr=0.1)                  # BSP for 250 steps, then ASP
    >>> ss.close()
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from commlib import Communicator, ValidationError

from .allreduce import AllReduce
from .buckets import Bucket, Move
from .checks import check_choice, check_int, check_real
from .paramstore import LAYOUTS, STORE_DTYPES, ParamStore
from .policies import PHASES, Policy, SchedulePolicy
from .rma_progress import PROGRESS_MODES
from .strategy import Strategy, checked_inner

#: what a peer sees while a rank re-enters a checkpoint's phase (a rank loading alone is named with it)
LOADING = ("SyncSwitch.load_state_dict, re-entering the checkpoint's phase: a collective (every rank "
           "loads; or rank 0, then broadcast_optimizer_state)")


class SyncSwitch(Strategy):
    """Hybrid BSP / ASP / SSP training, switched in place by ``policy``.

    ``bsp``: the strategy of BSP steps (``AllReduce``, or ``DeAR``: sharded updates in
    BSP, whole ones in ASP).  ``policy``: an
    :class:`~collectives.policies.OfflinePolicy`,
    :class:`~collectives.policies.StragglerPolicy` or
    :class:`~collectives.policies.SchedulePolicy` (default: BSP throughout).
    ``staleness``: SSP's bound s.  ``layout``, ``progress``,
    ``progress_interval_s``: the parameter store's (see
    :mod:`collectives.paramstore`).  ``ssp_timeout``: seconds an SSP wait may
    last (default: the communicator's timeout; 0: no limit).

    Every setting is checked here, at construction (not at the first switch
    out of BSP): ``staleness`` an integer >= 0, ``layout`` one of
    ``"sharded"``, ``"server"``, ``progress`` one of ``"auto"``, ``"thread"``,
    ``"mpich"``, ``"none"``, ``progress_interval_s`` finite and > 0,
    ``ssp_timeout`` None or >= 0, ``policy`` a Policy.  ``repr()`` shows them
    all, with the policy's settings: bindings compare it over the ranks when
    they wrap the optimizer, so that ranks given different settings fail
    there, on every rank.

    Example:
        >>> ss = SyncSwitch(bsp=AllReduce(), policy=OfflinePolicy(0.25, total_steps=1000), staleness=2)
        >>> "total_steps=1000" in repr(ss), ss.staleness
        (True, 2)

    Tuning: ASP moves the same bytes per link as a ring all-reduce (sharded
    store), so it is faster per step only when ranks wait for each other
    (stragglers, uneven steps); switch to it for those, or, offline, after
    the first fraction of training where BSP matters for accuracy.
    """

    name = "syncswitch"
    updates_parameters = True      # ASP pushes parameter deltas and pulls parameters

    def __init__(self, bsp: Strategy | None = None, policy: Policy | None = None, staleness: int = 0,
                 layout: str = "sharded", progress: str = "auto", progress_interval_s: float = 1e-3,
                 ssp_timeout: float | None = None):
        where = "SyncSwitch"
        inner = checked_inner(bsp, "SyncSwitch(bsp=...)") if bsp is not None else AllReduce()
        if isinstance(inner, SyncSwitch):
            raise ValueError("SyncSwitch cannot wrap another SyncSwitch")
        if inner.updates_parameters:    # (SelSync: its local steps are not BSP's)
            raise ValueError(f"SyncSwitch(bsp={inner.name}): the BSP phase averages every step's "
                             f"gradients (AllReduce, DeAR), but {inner.name} writes the parameters itself "
                             "and synchronizes only some steps")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"SyncSwitch(policy={policy!r}): expected a Policy (OfflinePolicy(...), "
                            "StragglerPolicy(...), SchedulePolicy(...); one phase throughout: "
                            f"SchedulePolicy('asp')) or None (BSP throughout), got {type(policy).__name__}")
        staleness = check_int(where, "staleness", staleness, 0)
        layout = check_choice(where, "layout", layout, LAYOUTS)
        progress = check_choice(where, "progress", progress, PROGRESS_MODES)
        interval = check_real(where, "progress_interval_s", progress_interval_s,
                              "a finite number of seconds > 0", lambda v: 0.0 < v < math.inf)
        if ssp_timeout is not None:
            ssp_timeout = check_real(where, "ssp_timeout", ssp_timeout, "None or seconds >= 0 (0: no limit)",
                                     lambda v: v >= 0.0)
        super().__init__(cap_mb=inner.cap_bytes / (1 << 20),
                         first_cap_mb=(inner.first_cap_bytes or 0) / (1 << 20), tune=False)
        self.bsp = inner
        self.policy = policy if policy is not None else SchedulePolicy("bsp")
        self.staleness = staleness
        self.store_options = {"layout": layout, "progress": progress, "progress_interval_s": interval}
        self.ssp_timeout = ssp_timeout
        self.phase = "bsp"
        self.lr_scale = 1.0
        self.momentum_scale = 1.0
        self._bsp_throughout = False            # the last step ran in BSP and ended there (no switch)
        self.stores: list[ParamStore] = []      # made at the first switch out of BSP (_open_stores)
        self._live = False                       # set up and not closed: a load re-enters its phase
        self.switches: list[dict[str, Any]] = []
        self._state_buffers: list[Any] = []
        self._before: list[np.ndarray] = []
        self._delta: list[np.ndarray] = []
        self._compute_start: float | None = None
        self._compute = 0.0
        self._progress_base = 0.0
        self.stats.update({"asp_steps": 0, "ssp_steps": 0, "bsp_steps": 0, "switch_s": 0.0,
                           "ssp_wait_s": 0.0, "store_s": 0.0, "compute_s": 0.0})

    @property
    def sharded(self) -> bool:      # type: ignore[override]
        """The update about to run is on shards: in BSP phases over a sharded ``bsp`` (DeAR)."""
        return self.phase == "bsp" and self.bsp.sharded

    @property
    def needs_shard_grads(self) -> bool:
        return self.bsp.sharded

    @property
    def changes_momentum(self) -> bool:      # type: ignore[override]
        """The policy resets or ramps the momentum at a switch (``OfflinePolicy(momentum=...)``)."""
        return self.policy.changes_momentum

    # ------------------------------------------------------------------ lifecycle
    def setup(self, comm: Communicator, buckets: Sequence[Bucket], params: Sequence[Any],
              grads: Sequence[Any], shard_grads: Sequence[Any] | None = None,
              broadcast: bool = True, tree: str | None = None) -> None:
        held = sorted({b.dtype for b in buckets} - set(STORE_DTYPES))
        if held:    # refused now, on every rank, not at the first switch out of BSP
            raise ValidationError(
                f"{self.name}: parameters of dtype {', '.join(held)}: its ASP and SSP phases keep the "
                f"parameters in a one-sided parameter store of {', '.join(STORE_DTYPES)} only; keep the "
                "parameters in float32 (torch.autocast computes in 16 bits) or use AllReduce / DeAR")
        self.close_stores()
        shards = shard_grads if self.bsp.sharded else None
        super().setup(comm, buckets, params, grads, shards, broadcast, tree)
        self.bsp.setup(comm, buckets, params, grads, shards, broadcast=False, tree=tree)
        self._np_params = [np.asarray(p).reshape(-1) for p in self.params]
        self._np_grads = [np.asarray(g).reshape(-1) for g in self.grads]
        self._before = [np.empty_like(p) for p in self._np_params]
        self._delta = [np.empty_like(p) for p in self._np_params]
        self.policy.bind(comm, None)
        self._live = True
        self.phase = "bsp"
        first = self.policy.phase(self.steps)
        if first != "bsp":
            self._switch(first)
        self._compute_start = time.perf_counter()

    def register_state_buffers(self, buffers: Sequence[Any]) -> None:
        """Flat optimizer-state arrays (momentum): zeroed on a momentum reset, averaged on return to BSP."""
        self._state_buffers = list(buffers)

    def bucket_ready(self, b: int) -> None:
        self._ready[b] = True
        if self.phase == "bsp":
            self.bsp.bucket_ready(b)

    def launch(self, b: int) -> None:  # pragma: no cover - bucket_ready is overridden
        self.bsp.launch(b)

    @property
    def reopens(self) -> bool:      # type: ignore[override]
        """A pass after ``before_update()`` adds to the gradients: the BSP strategy's (AllReduce and
        DeAR can), and asynchronous steps', whose gradients are this rank's own."""
        return self.bsp.reopens

    def reopen(self) -> None:
        if not self.reopens:
            raise RuntimeError(f"{self.name} cannot reduce another backward pass onto a reduced gradient")
        if self.phase == "bsp":
            self.bsp.reopen()
        self._reset_step()

    def launch_remaining(self) -> None:
        if self.phase == "bsp":
            self.bsp.launch_remaining()

    def before_update(self) -> None:
        now = time.perf_counter()
        self._compute = now - (self._compute_start or now)     # (again after a reopen: the whole pass)
        if self.phase == "bsp":
            self.bsp.before_update()
        else:
            for before, p in zip(self._before, self._np_params):
                np.copyto(before, p)

    def before_forward(self, b: int) -> None:
        if self.phase == "bsp":
            self.bsp.before_forward(b)

    def after_update(self) -> None:
        """The update is applied to ``params``: exchange (asynchronous phases), decide, switch."""
        if self.phase == "bsp":
            self.bsp.after_update()
        else:
            for b in range(len(self._np_params)):
                np.subtract(self._np_params[b], self._before[b], out=self._delta[b])
            self._exchange(self._delta)
        self._end_step()

    def step(self, lr: float) -> None:
        """One plain-SGD step on flat numpy buffers: ``params -= lr * grad`` (averaged in BSP).

        The learning rate is multiplied by :attr:`lr_scale` (the policy's
        change at a switch).  Collective in BSP; in ASP/SSP it touches only
        the store.
        """
        eff = float(lr) * self.lr_scale
        if self.phase == "bsp":
            for b in range(len(self.buckets)):
                if not self._ready[b]:
                    self.bucket_ready(b)
            self.before_update()
            if self.bsp.sharded:        # this rank's shard, from the averaged shard (all-gathered after)
                rank = self.comm.rank
                for b, (p, sg) in enumerate(zip(self._np_params, self.shard_grads)):
                    p[self.buckets[b].shard(rank)] -= p.dtype.type(eff) * np.asarray(sg)
            else:
                for p, g in zip(self._np_params, self._np_grads):
                    p -= p.dtype.type(eff) * g
            self.after_update()
            return
        now = time.perf_counter()
        self._compute = now - (self._compute_start or now)
        for d, g in zip(self._delta, self._np_grads):
            np.multiply(g, d.dtype.type(-eff), out=d)
        self._exchange(self._delta)
        self._end_step()

    def _exchange(self, deltas: Sequence[np.ndarray]) -> None:
        t0 = time.perf_counter()
        if self.phase == "asp":
            for store, d, p in zip(self.stores, deltas, self._np_params):
                store.push_pull(d, p)
            self.stats["asp_steps"] += 1
            self.stores[0].tick()
        else:  # ssp
            for store, d in zip(self.stores, deltas):
                store.push(d)
            lead = self.stores[0]
            lead.tick()
            self.stats["ssp_wait_s"] += lead.wait_bounded(self.staleness)
            for store, p in zip(self.stores, self._np_params):
                store.pull(p)
            self.stats["ssp_steps"] += 1
        self.stats["store_s"] += time.perf_counter() - t0
        self.stats["bytes"] += sum(2 * d.nbytes * (self.comm.size - 1) / self.comm.size for d in deltas)

    def progress(self) -> float:
        """Training progress in BSP steps (worker steps / ranks), the same on every rank in BSP.

        BSP steps count one each; asynchronous steps count ``1 / size`` each,
        whichever rank made them (read from the SSP clocks, which ASP ticks
        too).  Loop on it (``while ss.progress() < total``) so that every rank
        stops at the same point; ``close()`` then joins them in BSP.
        """
        if self.phase == "bsp" or not self.stores:
            return self._progress_base
        return self._progress_base + float(self.stores[0].clocks().sum()) / self.comm.size

    def _end_step(self) -> None:
        was_bsp = self.phase == "bsp"
        if was_bsp:
            self.stats["bsp_steps"] += 1
            self._progress_base += 1.0
        step = self.steps
        self.steps += 1
        self._reset_step()
        self.stats["compute_s"] += self._compute
        new = self.policy.observe(step, self._compute, self.phase)
        if new is None:
            new = self.policy.phase(self.steps)
        self.momentum_scale = self.policy.momentum_scale(self.steps)
        if new != self.phase:
            self._switch(new)
        self._bsp_throughout = was_bsp and self.phase == "bsp"
        self._compute_start = time.perf_counter()

    def replicas_parted(self) -> bool:
        """Some ranks skipped ``step()`` where others updated: in a step that ran in BSP and stayed
        there, the replicas now differ for the rest of the phase (False: the binding raises, as under
        AllReduce); in an asynchronous step they differ by design, and a switch back to BSP makes
        them one (True)."""
        return not self._bsp_throughout

    # ------------------------------------------------------------------ switching
    def _switch(self, new: str, restoring: bool = False) -> None:
        """Leave this phase for ``new`` on every rank.  ``restoring``: a load re-entering its
        checkpoint's phase, which brings the switch's changes with it (the optimizer state as it
        was after them, the scales): none is applied again (a momentum reset zeroed the loaded
        momentum)."""
        if new not in PHASES:
            raise ValueError(f"policy chose phase {new!r}: expected one of {PHASES}")
        old = self.phase
        t0 = time.perf_counter()
        changes = {} if restoring else self.policy.changes(old, new, self.steps)
        if old == "bsp":
            self.bsp.flush()
            self._open_stores()
            for store, p in zip(self.stores, self._np_params):
                store.load(p)               # replicas are identical: no data travels
            if self.stores:
                self.stores[0].set_clocks(0)
            for store in self.stores:
                store.activate()
            if changes.get("momentum") == "reset":
                for buf in self._state_buffers:
                    np.asarray(buf)[...] = 0
        elif new == "bsp":
            for store in self.stores:
                store._win.Flush_all()      # this rank's pushes are complete (they flush anyway)
            self.comm.barrier(tag="syncswitch.to_bsp")
            if self.stores:                 # every rank reads the same final clocks
                self._progress_base += float(self.stores[0].clocks().sum()) / self.comm.size
            for store, p in zip(self.stores, self._np_params):
                store.pull(p)               # nobody pushes now: the same contents everywhere
            for store in self.stores:
                store.deactivate()
            for buf in self._state_buffers:
                self.comm.allreduce(buf, "avg", out=buf, tag="syncswitch.state")
        else:                               # asp <-> ssp: line the clocks up again
            self.comm.barrier(tag="syncswitch.async")
            if self.stores:
                self._progress_base += float(self.stores[0].clocks().sum()) / self.comm.size
                self.stores[0].set_clocks(0)
        self.phase = new
        self.policy.switched(old, new, self.steps)
        if "lr_scale" in changes:
            self.lr_scale = float(changes["lr_scale"])
        self.momentum_scale = float(changes.get("momentum_scale", self.momentum_scale))
        for fn in self._switch_callbacks:     # on every rank, at the same step out of BSP
            fn(old, new, changes)             # (the binding's optimizer state: timed with the switch)
        dt = time.perf_counter() - t0
        self.stats["switch_s"] += dt
        rec = {"step": self.steps, "from": old, "to": new, "seconds": dt, **changes}
        self.switches.append(rec)
        self.comm.tracer.instant("syncswitch.switch", **rec)

    def switch_to(self, phase: str) -> None:
        """Switch now (collective when leaving BSP or returning to it), regardless of the policy."""
        if phase != self.phase:
            self._switch(phase)

    # ------------------------------------------------------------------ end
    def flush(self) -> None:
        """BSP: the inner strategy's flush.  ASP/SSP: every rank's pushes land (a barrier: a
        collective, as a flush is), then the store's contents are pulled, the same on every rank."""
        if self.phase == "bsp":
            self.bsp.flush()
        else:
            self.comm.barrier()
            for store, p in zip(self.stores, self._np_params):
                store.pull(p)

    def complete(self) -> None:
        """BSP: the inner strategy's; asynchronous phases have nothing in flight after a step."""
        if self.phase == "bsp":
            self.bsp.complete()

    def writes_in_flight(self) -> bool:
        return self.phase == "bsp" and self.bsp.writes_in_flight()

    def gradients_are_local(self) -> bool:
        return self.phase != "bsp" or self.bsp.gradients_are_local()

    def step_reads_gradients(self) -> bool:
        """Only BSP steps read the gradient buckets (asynchronous ones push the update's change)."""
        return self.phase == "bsp"

    def _open_stores(self) -> None:
        """The parameter store, one per bucket, made at the first switch out of BSP (every rank
        switches at the same step: its windows are collective) and kept until :meth:`close`: a run
        that stays synchronous holds no windows (each took a copy of its bucket and MPI contexts)."""
        if not self.stores:
            self.stores = [ParamStore(self.comm, p.size, p.dtype, timeout=self.ssp_timeout,
                                      **self.store_options) for p in self._np_params]
            self.policy.bind(self.comm, self.stores[0] if self.stores else None)

    def close_stores(self) -> None:
        for store in self.stores:
            store.close()
        self.stores = []

    def close(self) -> None:
        """Collective: return to BSP (replicas identical) and free the windows."""
        if self.stores and self.phase != "bsp":
            self._switch("bsp")
        self.close_stores()
        self._live = False

    # ------------------------------------------------------------------ state
    def rescale_gradients(self, factor: float) -> None:
        self.bsp.rescale_gradients(factor)

    def replanned(self, moves: Sequence[Move]) -> None:
        self.bsp.replanned(moves)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd.update({"phase": self.phase, "clock": self.stores[0].clock if self.stores else 0,
                   "lr_scale": self.lr_scale, "momentum_scale": self.momentum_scale,
                   "staleness": self.staleness, "policy": self.policy.state_dict(),
                   "progress_base": self._progress_base,
                   "bsp": self.bsp.state_dict(), "switches": [dict(s) for s in self.switches],
                   # asynchronous: the store as this rank reads it now (a rank's replica may lag it),
                   # without the bucket's padding (the world size's: loadable on any number of ranks)
                   "store": [s.pull()[:b.numel] for s, b in zip(self.stores, self.buckets)]
                   if self.stores and self.phase != "bsp" else None})
        return sd

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        if state["phase"] not in PHASES:
            raise ValidationError(f"phase {state['phase']!r}: expected one of {PHASES}")
        saved = state.get("store") if self._live else None
        if saved is not None and (len(saved) != len(self.buckets) or any(
                len(v) < b.numel for v, b in zip(saved, self.buckets))):
            raise ValidationError(f"{self.name}: the checkpoint's parameter store holds buckets of "
                                  f"{[len(v) for v in saved]} elements, this model's "
                                  f"{[b.numel for b in self.buckets]} (another model, or other bucket caps)")
        self.bsp.check_state(state["bsp"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore (collective after ``setup``: the phase is re-entered with the current parameters,
        loaded before it, as a checkpoint's model is: in an asynchronous phase the parameter store
        takes them, whatever it held, then the store saved with the state, each rank writing its own
        piece of the store from the state it loads: its own checkpoint's, or one file's everywhere).

        Example:
            >>> model.load_state_dict(ckpt["model"]); ss.load_state_dict(ckpt["syncswitch"])
        """
        super().load_state_dict(state)
        saved = state.get("store") if self._live else None
        self.bsp.load_state_dict(state["bsp"])
        self.staleness = int(state["staleness"])
        if self.load_is_collective(state):      # a collective follows: a rank loading alone is named at once
            self.comm.allgather_object(None, label=LOADING)
        if self._live and self.phase != "bsp":      # a roll-back while asynchronous: every rank's pushes
            loaded = [p.copy() for p in self._np_params]     # land, then the loaded parameters stay
            self._switch("bsp", restoring=True)
            for p, mine in zip(self._np_params, loaded):
                np.copyto(p, mine)
        if self._live and state["phase"] != self.phase:
            self._switch(state["phase"], restoring=True)   # asynchronous: the stores take the parameters
            if saved is not None:       # then the store as saved: each rank's piece of its own
                for store, values, p, b in zip(self.stores, saved, self._np_params, self.buckets):
                    full = p.copy()     # the padding as this world size has it
                    full[:b.numel] = np.asarray(values)[:b.numel]   # (older checkpoints: padded)
                    store.load(full)
        self.policy.load_state_dict(state["policy"])      # after the switch, which tells the policy
        self._progress_base = float(state["progress_base"])
        self.switches = [dict(s) for s in state["switches"]]
        self.phase = state["phase"]
        self.lr_scale = float(state["lr_scale"])
        self.momentum_scale = float(state["momentum_scale"])
        if self.stores and self.phase == "ssp":
            self.stores[0].set_clocks(int(state["clock"]))

    def load_is_collective(self, state: dict[str, Any]) -> bool:
        """True where the load re-enters a phase (the checkpoint's, or BSP from an asynchronous one):
        the store's windows are collective."""
        return self._live and (self.phase != "bsp" or state["phase"] != self.phase)

    def __repr__(self) -> str:
        # every setting, deterministic (floats by repr, no object ids): bindings compare it over the ranks
        opts = ", ".join(f"{k}={v!r}" for k, v in self.store_options.items())
        return (f"SyncSwitch(bsp={self.bsp!r}, policy={self.policy!r}, staleness={self.staleness!r}, {opts}, "
                f"ssp_timeout={self.ssp_timeout!r}, phase={self.phase!r})")
