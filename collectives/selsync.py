"""``SelSync``: a selective-sync gate that communicates only when the update matters (arXiv 2307.07950).

Each step the gate measures how *significant* the local update is: the
relative change between steps of the gradient's L2 norm, both smoothed by an
EWMA over ``window`` steps (:class:`SignificanceMeter`)::

    E_i = EWMA(||g_1||, ..., ||g_i||)          (bias-corrected: defined from step 1)
    significance_i = |E_i - E_{i-1}| / E_{i-1} (0 at step 1)

A rank *wants* to sync when ``significance_i >= delta``; one one-element MAX
all-reduce of that flag per step (the consensus, traced as ``allreduce``
with tag ``selsync.flag`` plus a ``selsync`` event on the ``control`` track
of the timeline) makes every rank sync when any rank wants to.  The first
``warmup`` steps (default: ``window``, while the EWMA fills) always sync, as
does every step with ``delta = 0`` (BSP); both are known on every rank, so
no consensus is needed then.  A huge ``delta`` is local SGD after warm-up.

Two aggregation modes:

* ``mode="params"`` (the paper's preferred mode): every step is a local
  update; on a sync step the parameter buffers are averaged *after* the
  update (unlike the prototype, which averaged before it and left replicas a
  step apart), and with them the optimizers' states (``sync_optimizer_state``,
  on by default in this mode; the prototype never averaged momentum), so
  replicas are identical after every sync step.  The
  averaging runs in the background and a bucket is waited for in
  ``before_forward(b)`` (as DeAR's all-gathers), or in ``flush()`` / the next
  ``before_update()``.  With a sharded inner strategy (DeAR) the average
  travels as DeAR's decoupled reduce-scatter + all-gather; else as one
  all-reduce per bucket.
* ``mode="grads"``: on a sync step the inner strategy averages the
  gradients before the update; a local step communicates nothing.  If local
  steps ran since the last sync (replicas drifted), the parameters are
  averaged after the update as well, and so is the optimizer's state
  (:meth:`syncs_optimizer_state`; the registered state buffers): momentum
  drifted with the replicas, and synchronized steps taken with differing
  momentum would take them apart again.  So replicas are identical after
  every sync step here too.

The inner strategy: the gate forwards the lifecycle to ``inner`` on sync
steps in grads mode (``AllReduce``, a sparse strategy, ``DeAR``).  Because
the decision needs the whole local gradient, the inner strategy's
communication starts after backward on sync steps (``before_update``): the
backward overlap of WFBP is given up; that is inherent to gating on this
step's significance.  Local steps need the full optimizer on every rank, so
the gate always presents ``sharded = False`` to the binding: with
``inner=DeAR()`` the gradients travel as DeAR's reduce-scatter (into shard
buffers the gate owns) followed by an all-gather of the averaged shards
back into the gradient buffers, and the full optimizer runs everywhere
(ZeRO-1's memory saving is given up under SelSync).

What a binding calls (the usual lifecycle; nothing extra is required):

1. ``setup(comm, buckets, params, grads, shard_grads=None, broadcast=True)``
   once (``shard_grads`` is not needed: ``sharded`` is False);
2. per step: ``before_forward(b)`` before bucket ``b``'s first module runs
   forward (needed in params mode: the parameter averaging of a sync step
   overlaps the next forward; pass ``overlap=False`` if the binding never
   calls it), ``bucket_ready(b)`` from backward (recorded; launched on sync
   steps only);
3. the optimizer step: ``before_update()`` (observes the local gradient norm
   from ``grads``, or takes the one handed over by ``observe_norm``, runs the
   consensus, and in grads mode on a sync step averages the gradients), then
   the optimizer's update on the full ``params``, then ``after_update()`` (in
   params mode on a sync step: launches the parameter averaging);
4. optimizer state in params mode (``sync_optimizer_state``, on there by default): register flat buffers
   once with :meth:`register_state_buffers` (averaged together with the parameters), or, after
   ``after_update()``, check :attr:`synced` and average the optimizer's tensors (e.g. momentum)
   with ``comm.allreduce(t, "avg", out=t)`` in the binding;
5. ``flush()`` before evaluation / checkpoint / end: waits for the averaging and, with
   ``average_on_flush=True`` (default), averages the parameters if replicas drifted;
6. between steps, ``rescale_gradients(f)`` (a changed loss scale): the norm average and inner follow.

Without a strategy lifecycle (a benchmark driving flat vectors): ``gate.observe(grads)``,
``gate.decide()``, then average yourself or call :meth:`average_params`; :meth:`end_step`.
Statistics (``gate.stats``): ``syncs``, ``local_steps``, ``lssr`` (local steps / all steps),
``bytes`` sent, ``bytes_saved`` (local steps times the bytes of a sync), ``consensus_s`` /
``consensus_calls`` (the flag's cost), ``observe_s`` (the norm's cost); ``gate.trace``: per
step ``(step, norm, ewma, significance, synced)``, the last ``trace_len`` steps.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from commlib import Communicator, Work
from commlib.arrays import INEXACT_DTYPES, as_view

from .allreduce import AllReduce
from .buckets import Bucket, Move
from .checks import check_bool, check_choice, check_int, check_real
from .significance import SignificanceMeter, l2_norm
from .strategy import Strategy, checked_inner, saved_elsewhere

MODES = ("params", "grads")


class SelSync(Strategy):
    """Selective synchronization: sync only when some rank's update is significant.

    ``inner``: the strategy that averages gradients on sync steps in grads
    mode (default :class:`AllReduce`); in params mode it chooses the pattern
    of the parameter average (a sharded ``inner`` such as DeAR: reduce-scatter
    + all-gather; else all-reduce).  ``delta``: the significance threshold
    (0: BSP; ``math.inf``: local SGD after warm-up; paper: 0.25-0.5).
    ``window``: the EWMA window (paper: 25).  ``warmup``: steps that always
    sync (default ``window``).  ``mode``: ``"params"`` or ``"grads"``.
    ``sync_optimizer_state``: average the buffers registered with
    :meth:`register_state_buffers` whenever parameters are averaged, and ask
    the binding to average its optimizer's state (:meth:`syncs_optimizer_state`);
    default (``None``): on in params mode, where each rank's momentum follows its
    own gradients on every step (the prototype never averaged it: replicas equal in
    their parameters went on with different momentum), off in grads mode, whose
    sync steps average the state only after local steps (``False`` in params mode: each
    rank keeps its own, and a sync step sends the parameters alone).
    ``overlap``: let the parameter average of a sync step overlap the next
    forward (waited for in ``before_forward``).  ``average_on_flush``:
    ``flush()`` averages drifted replicas.  ``trace_len``: steps of the
    metric's trace kept.

    Every setting is checked here (``delta`` a number >= 0, ``window`` an
    integer >= 1, ``warmup`` None or an integer >= 0, ``trace_len`` an
    integer >= 0, the switches True or False), and ``repr()`` shows each one
    that decides what the ranks call or compute (all but ``trace_len``, which
    is this rank's bookkeeping): bindings compare it over the ranks when they
    wrap the optimizer, so that ranks given different settings fail there, on
    every rank.

    Tuning: raise ``delta`` for fewer syncs (higher LSSR, faster) and lower it
    for BSP-like accuracy; look at ``gate.trace`` (significance per step) to
    choose it.  Pair it with :class:`collectives.data.SelDP` so that local
    steps see the whole data set.

    Example:
        >>> gate = SelSync(inner=AllReduce(), delta=0.3, window=25, mode="params")
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=gate)
        >>> ...                                    # train as usual
        >>> gate.stats["lssr"], gate.stats["bytes_saved"]
        >>> repr(SelSync(delta=0.3, window=25, warmup=5)).split("), ")[1][:30]
        'delta=0.3, window=25, warmup=5'
    """

    name = "selsync"
    sharded = False
    updates_parameters = True      # averages the replicas after local steps, in both modes
    measures_gradients = True      # decides on the local gradient's 2-norm (observe_norm)

    def __init__(self, inner: Strategy | None = None, delta: float = 0.3, window: int = 25,
                 mode: str = "params", sync_optimizer_state: bool | None = None, warmup: int | None = None,
                 overlap: bool = True, average_on_flush: bool = True, trace_len: int = 100_000):
        super().__init__()
        if inner is None:
            inner = AllReduce()
        checked_inner(inner, "SelSync(inner=...)")
        if isinstance(inner, SelSync):
            raise ValueError("SelSync cannot wrap another SelSync")
        if inner.updates_parameters:
            raise ValueError(f"SelSync(inner={inner.name}): the inner strategy averages the gradients of "
                             f"synchronized steps, but {inner.name} writes the parameters itself")
        where = "SelSync"
        mode = check_choice(where, "mode", mode, MODES)
        if mode == "params" and inner.sparse:
            raise ValueError(f"SelSync(inner={inner.name}, mode='params'): the parameters are averaged "
                             "whole on synchronized steps, so the sparse exchange would never run: use "
                             "mode='grads' (the inner strategy sends the gradients of synchronized steps)")
        delta = check_real(where, "delta", delta, "a number >= 0 (0 is BSP, inf is local SGD)",
                           lambda v: v >= 0.0)
        window = check_int(where, "window", window, 1)
        if warmup is not None:
            warmup = check_int(where, "warmup", warmup, 0)
        self.inner = inner
        self.delta = delta
        self.mode = mode
        self.meter = SignificanceMeter(window)
        self.warmup = self.meter.window if warmup is None else warmup
        # params mode: every step is a local update, so the optimizers' states (momentum) differ
        # on every sync step (the prototype never averaged them); grads mode: only after drift
        self.sync_optimizer_state = (mode == "params" if sync_optimizer_state is None else
                                     check_bool(where, "sync_optimizer_state", sync_optimizer_state))
        self.overlap = check_bool(where, "overlap", overlap)
        self.average_on_flush = check_bool(where, "average_on_flush", average_on_flush)
        self.trace_len = check_int(where, "trace_len", trace_len, 0)
        self.trace: list[tuple[int, float, float, float, bool]] = []
        self.state_buffers: list[Any] = []
        #: whether the current (or, after ``after_update``, the last) step synchronizes
        self.synced = False
        self.stats.update({"syncs": 0, "local_steps": 0, "lssr": 0.0, "bytes_saved": 0.0,
                           "sync_bytes": 0.0, "consensus_s": 0.0, "consensus_calls": 0,
                           "observe_s": 0.0, "flush_syncs": 0, "overflow_checks": 0})
        self._norm = self._significance = float("nan")    # this step's, once observed
        self._want: bool | None = None        # this step's local vote, once observed
        self._loaded_from: tuple[Any, Any] = (None, None)    # (rank, world size) of a state loaded
        self._finite = True                   # this step's local gradient norm is finite
        # params mode: a rank's gradient is not finite this step, so the gradients are averaged (the
        # overflow reaches every rank, whose GradScaler then skips, as one process's would)
        self._overflow = False
        self._decided: bool | None = None     # this step's consensus, once decided
        self._drift = False                   # local steps since the replicas were last averaged
        self._state_drift = False             # local steps since the optimizers were last averaged
        self._realigned = False               # grads mode: this sync step averaged both after drift
        self._avg_works: list[list[Work]] = []    # per bucket: its parameter average in flight
        self._avg_other: list[Work] = []
        self._inner_shards: list[Any] = []
        self._flag: Any = None
        self._carry: tuple[int, ...] = ()     # the binding's words for this step's flag (see carry)
        self._carried: Any = None

    # ------------------------------------------------------------------ lifecycle
    def setup(self, comm: Communicator, buckets: Sequence[Bucket], params: Sequence[Any],
              grads: Sequence[Any], shard_grads: Sequence[Any] | None = None,
              broadcast: bool = True, tree: str | None = None) -> None:
        self._wait_average()
        super().setup(comm, buckets, params, grads, None, broadcast, tree)
        if self.inner.sharded:
            self._inner_shards = []
            for b, g in zip(self.buckets, self.grads):
                v = as_view(g, "selsync: gradient buffer")
                self._inner_shards.append(v.wrap(v.empty(b.shard_numel), (b.shard_numel,)))
        self.inner.setup(comm, buckets, params, grads,
                         self._inner_shards if self.inner.sharded else None, broadcast=False, tree=tree)
        self._check_loaded_rank()
        self._avg_works = [[] for _ in self.buckets]
        v = as_view(self.grads[0], "selsync: gradient buffer") if self.grads else None
        if v is None or v.device == "cpu" or comm.backend == "mpi":
            self._flag = np.zeros(1, np.int32)     # an integer max: no float compare
        else:                # beside the gradients on the NCCL communicator's GPU
            with v.xp.cuda.Device(v.device_id):
                self._flag = v.xp.zeros(1, v.xp.int32)

    def syncs_optimizer_state(self) -> bool:
        """With ``sync_optimizer_state``, the step that just synchronized asks the
        binding to average the optimizer's state too (momentum agrees with the parameters);
        in grads mode, so does the synchronized step that re-aligns drifted replicas."""
        return self.synced and (self.sync_optimizer_state or self._realigned)

    def register_state_buffers(self, buffers: Sequence[Any]) -> None:
        """Flat optimizer-state buffers (e.g. momentum, laid out as the buckets) to
        average with the parameters when ``sync_optimizer_state`` is on."""
        for i, buf in enumerate(buffers):
            v = as_view(buf, f"selsync: state buffer {i}")
            if v.dtype not in INEXACT_DTYPES or not v.writable:
                raise ValueError(f"state buffer {i}: expected a writable floating (or complex) array, "
                                 f"got {v.dtype}")
        self.state_buffers = list(buffers)

    def bucket_ready(self, b: int) -> None:
        """Recorded only: whether this step syncs is decided after backward."""
        self._ready[b] = True

    def launch(self, b: int) -> None:   # the gate launches through ``inner``
        raise RuntimeError("SelSync launches through its inner strategy")

    def before_update(self) -> None:
        """Observe the local gradient, agree on sync, and in grads mode average the gradients."""
        self._wait_average()
        if self._want is None:
            self.observe()
        sync = self.decide() if self._decided is None else self._decided
        if sync and self._averages_gradients():
            inner = self.inner
            before = inner.stats["bytes"]
            for b in range(len(self.buckets)):
                inner.bucket_ready(b)
            inner.before_update()
            nbytes = inner.stats["bytes"] - before
            if inner.sharded:   # DeAR's reduce-scatter, then the averaged shards back into the gradients
                works = [self.comm.iallgather(self._inner_shards[b], out=self.grads[b], tag=f"selsync.ag{b}")
                         for b in range(len(self.buckets))]
                self._wait(works)
                n = self.comm.size
                nbytes += sum(bk.nbytes * (n - 1) / n for bk in self.buckets)
            self._count_bytes(nbytes)

    def after_update(self) -> None:
        """In params mode on a sync step (grads mode: after drift), start averaging the parameters."""
        sync = bool(self._decided)
        if sync and self._averages_gradients():
            if self.inner.sharded:
                Strategy.after_update(self.inner)   # its bookkeeping, not its all-gather of parameters
            else:
                self.inner.after_update()
        averages = self.step_reads_parameters()
        self._realigned = averages and self.mode == "grads"
        if self._realigned:
            self._state_drift = False
        if averages:
            self._count_bytes(self._start_average())
            if not self.overlap:
                self._wait_average()
        self.end_step()

    def before_forward(self, b: int) -> None:
        if self._avg_works and self._avg_works[b]:
            t0 = time.perf_counter()
            for w in self._avg_works[b]:
                w.wait()
            self._avg_works[b] = []
            self.stats["wait_s"] += time.perf_counter() - t0
        if self.mode == "grads":
            self.inner.before_forward(b)

    def flush(self) -> None:
        """Finish the averaging in flight; with ``average_on_flush``, average drifted replicas."""
        self._wait_average()
        if self.mode == "grads":
            self.inner.flush()
        if self.average_on_flush and self._drift and self.comm is not None and self.comm.size > 1:
            self.stats["bytes"] += self._start_average()
            self.stats["flush_syncs"] += 1
            self._wait_average()

    def complete(self) -> None:
        """Finish the averaging in flight (no new collective)."""
        self._wait_average()
        if self.mode == "grads":
            self.inner.complete()

    def step_reads_parameters(self) -> bool:
        """Only a synchronized step that averages the parameters (params mode; grads mode after drift)."""
        return bool(self._decided) and (self.mode == "params" or self._drift or self._state_drift)

    def gradients_are_local(self) -> bool:
        return not self.synced or not self._averages_gradients()

    def _averages_gradients(self) -> bool:
        """The gradients of a synchronized step are averaged: grads mode, or an overflow in params mode."""
        return self.mode == "grads" or self._overflow

    def writes_in_flight(self) -> bool:
        return (bool(self._avg_other) or any(self._avg_works)
                or (self.mode == "grads" and self.inner.writes_in_flight()))

    # ------------------------------------------------------------------ the gate, framework-free
    def observe(self, grads: Sequence[Any] | None = None) -> float:
        """Measure this step's local gradient (``grads``, default the setup's buffers):
        update the EWMA and return the significance.  Call once per step, before any
        communication touches the gradients.  A non-finite norm (an overflowed
        mixed-precision step, which a GradScaler skips) votes to sync and leaves
        the EWMA as it was; the other ranks' EWMAs take their own finite norms
        (each rank's meter follows its own gradient, skipped step or not)."""
        if self._want is not None:
            raise RuntimeError("observe() called twice in one step; finish the step with end_step()")
        t0 = time.perf_counter()
        return self._measured(l2_norm(self.grads if grads is None else grads), t0)

    def observe_norm(self, norm: float) -> None:
        """This step's local gradient 2-norm, measured by the binding where the gradient lives (JAX's,
        inside ``jax.jit``), before ``bucket_ready``: :meth:`observe` on it, then :meth:`decide` (the
        flag all-reduce), so that :meth:`step_reads_gradients` tells whether the buckets are needed.

        Example:
            >>> gate.observe_norm(float(jnp.sqrt(sum(jnp.vdot(g, g) for g in leaves))))
        """
        if self._want is not None:
            raise RuntimeError("observe_norm() called twice in one step; finish the step with end_step()")
        self._measured(float(norm), time.perf_counter())
        self.decide()

    def step_reads_gradients(self) -> bool:
        """Undecided: True; decided (:meth:`observe_norm`): only a synchronized step that averages the
        gradients (grads mode, or an overflow in params mode)."""
        return self._decided is None or (bool(self._decided) and self._averages_gradients())

    def _measured(self, norm: float, t0: float) -> float:
        significance = self.meter.update(norm) if math.isfinite(norm) else math.inf
        self.stats["observe_s"] += time.perf_counter() - t0
        self._want = not significance < self.delta       # NaN or inf: sync
        self._finite = math.isfinite(norm)
        self._norm, self._significance = norm, significance
        return significance

    @property
    def step_index(self) -> int:
        """1-based index of the step being decided."""
        return self.steps + 1

    def decide(self, want: bool | None = None) -> bool:
        """Agree on whether this step syncs: True when any rank wants to (one flag all-reduce).

        ``want`` overrides this rank's vote (e.g. to force a sync).  During warm-up and
        with ``delta = 0`` every rank knows the answer: no collective is made, but in params
        mode, where a rank's overflowed gradient would otherwise stay its own, the flag
        still goes round (4 bytes) to tell the ranks of one.
        """
        if self.comm is None:
            raise RuntimeError("SelSync.decide() before setup()")
        if want is None:
            if self._want is None:
                raise RuntimeError("SelSync.decide() before observe()")
            want = self._want
        forced = self.step_index <= self.warmup or self.delta == 0.0
        t0 = time.perf_counter()
        start_us = self.comm.tracer.now_us()
        if self.comm.size == 1 or (forced and self.mode == "grads"):
            sync = forced or bool(want)
            overflow = not self._finite
        else:       # 2: this rank's gradient is not finite (it votes to sync too)
            host = isinstance(self._flag, np.ndarray)
            words = self._carry if host else ()     # (a host flag only)
            if host and self._flag.size != 1 + len(words):
                self._flag = np.zeros(1 + len(words), np.int32)
            self._flag[0] = 2 if not self._finite else 1 if want else 0
            if words:
                self._flag[1:] = words
            self.comm.allreduce(self._flag, "max", out=self._flag, tag="selsync.flag")
            flag = float(self._flag[0])
            self._carried = self._flag[1:].copy() if words else None
            sync, overflow = forced or flag > 0, flag > 1
            if forced:
                self.stats["overflow_checks"] += 1
            else:
                self.stats["consensus_s"] += time.perf_counter() - t0
                self.stats["consensus_calls"] += 1
        self._overflow = overflow and self.mode == "params"
        tr = self.comm.tracer
        if tr.recording:
            tr.add("running", "selsync", "control", start_us, tr.now_us(), step=self.step_index,
                   sync=sync, want=bool(want), forced=forced,
                   significance=float(self._significance))
        self._decided = sync
        self.synced = sync
        return sync

    def average_params(self, params: Sequence[Any] | None = None, wait: bool = True) -> float:
        """Average ``params`` (default: the setup's buffers, plus the registered state
        buffers when ``sync_optimizer_state``) over the ranks; return the bytes sent."""
        nbytes = self._start_average(params)
        if wait:
            self._wait_average()
        return nbytes

    def end_step(self) -> None:
        """Close the step: count it, record the trace (``after_update`` calls it)."""
        sync = bool(self._decided)
        self.trace.append((self.step_index, self._norm, self.meter.value if self.meter.value is not None
                           else float("nan"), self._significance, sync))
        if len(self.trace) > self.trace_len:
            del self.trace[: len(self.trace) - self.trace_len]
        if sync:
            self.stats["syncs"] += 1
        else:
            self._drift = self._state_drift = True
            self.stats["local_steps"] += 1
            self.stats["bytes_saved"] += self._sync_cost()
        total = self.stats["syncs"] + self.stats["local_steps"]
        self.stats["lssr"] = self.stats["local_steps"] / total if total else 0.0
        Strategy.after_update(self)
        self._want = self._decided = None
        self._finite, self._overflow = True, False
        self._carry, self._carried = (), None

    def replicas_parted(self) -> bool:
        """A rank skipped ``step()`` where others updated (its GradScaler alone saw an inf it wrote
        into ``.grad`` after backward): the replicas and optimizers count as drifted, so that a
        later synchronized step averages them (grads mode; in params mode every one does)."""
        self._drift = self._state_drift = True
        return True

    def carry(self, words: Sequence[int]) -> None:
        """The binding's words ride on this step's flag all-reduce (a host flag; none is made in
        warm-up, where the step synchronizes and the binding agrees on them itself)."""
        self._carry = tuple(int(w) for w in words)

    def carried(self) -> Any:
        return self._carried

    # ------------------------------------------------------------------ helpers
    def _count_bytes(self, nbytes: float) -> None:
        self.stats["bytes"] += nbytes
        self.stats["sync_bytes"] += nbytes

    def _sync_cost(self) -> float:
        """Bytes one sync costs: measured over the sync steps so far, else the dense estimate."""
        if self.comm is None or self.comm.size == 1:
            return 0.0
        if self.stats["syncs"] and self.stats["sync_bytes"]:
            return self.stats["sync_bytes"] / self.stats["syncs"]
        return self._dense_bytes(self.params)

    def _dense_bytes(self, buffers: Sequence[Any]) -> float:
        n = self.comm.size if self.comm is not None else 1
        total = sum(as_view(buf, "selsync: buffer").nbytes for buf in buffers)
        return total * (2 * (n - 1) / n if self.inner.sharded else 1.0)

    def _start_average(self, params: Sequence[Any] | None = None) -> float:
        """Launch the average of the parameter (and state) buffers; return its bytes.

        Works on the setup's buckets are kept per bucket (``before_forward(b)``
        waits for its own); any others wait in :meth:`_wait_average`.
        """
        comm = self.comm
        if comm is None:
            raise RuntimeError("SelSync: average before setup()")
        self._drift = False
        if comm.size == 1:
            return 0.0
        own = params is None
        bufs = list(self.params if own else params)
        if self.sync_optimizer_state or self._realigned:
            bufs += self.state_buffers
        nbytes = 0.0
        # forward needs the last bucket first (buckets are numbered in backward order)
        for i in reversed(range(len(bufs))):
            works = self._average_one(bufs[i], i)
            nbytes += self._dense_bytes([bufs[i]])
            if own and i < len(self._avg_works):
                self._avg_works[i].extend(works)
            else:
                self._avg_other.extend(works)
        return nbytes

    def _average_one(self, p: Any, i: int) -> list[Work]:
        """One buffer's average: an all-reduce, or (sharded inner) reduce-scatter + all-gather, both
        queued at once (the engine runs them in order: the all-gather reads the shard written)."""
        comm = self.comm
        v = as_view(p, "selsync: parameter buffer")
        if not self.inner.sharded or v.count % comm.size:
            return [comm.iallreduce(p, "avg", out=p, tag=f"selsync.avg{i}")]
        s = v.count // comm.size
        shard = v.wrap(v.empty(s), (s,))
        return [comm.ireduce_scatter(p, "avg", out=shard, tag=f"selsync.rs{i}"),
                comm.iallgather(shard, out=p, tag=f"selsync.ag{i}")]

    def _wait_average(self) -> None:
        if not self._avg_other and not any(self._avg_works):
            return
        t0 = time.perf_counter()
        for works in [*self._avg_works, self._avg_other]:
            for w in works:
                w.wait()
            works.clear()
        self.stats["wait_s"] += time.perf_counter() - t0

    def rescale_gradients(self, factor: float) -> None:
        self.meter.rescale(factor)
        self.inner.rescale_gradients(factor)

    def replanned(self, moves: Sequence[Move]) -> None:
        self.inner.replanned(moves)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        st = super().state_dict()
        st.update({"delta": self.delta, "mode": self.mode, "warmup": self.warmup,
                   "meter": self.meter.state_dict(), "drift": self._drift, "state_drift": self._state_drift,
                   "stats": dict(self.stats), "trace": [list(t) for t in self.trace[-self.trace_len:]],
                   "rank": self._loaded_from[0] if self.comm is None else self.comm.rank,
                   "world_size": self._loaded_from[1] if self.comm is None else self.comm.size,
                   "inner": self.inner.state_dict()})
        return st

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        if state["mode"] != self.mode:
            raise ValueError(f"state of mode {state['mode']!r} given to a gate of mode {self.mode!r}")
        self.inner.check_state(state["inner"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        loaded = (float(state["delta"]), int(state["warmup"]))
        if loaded != (self.delta, self.warmup):
            warnings.warn(f"{self.name}: the checkpoint's delta={loaded[0]!r}, warmup={loaded[1]!r} "
                          f"replace this gate's delta={self.delta!r}, warmup={self.warmup!r}, as torch's "
                          "load_state_dict replaces the learning rate", stacklevel=3)
        self.delta, self.warmup = loaded
        self.meter.load_state_dict(state["meter"])
        self._drift = bool(state["drift"])
        self._state_drift = bool(state.get("state_drift", self._drift))
        self.stats.update(state["stats"])
        self.trace = [(int(s), float(n), float(e), float(g), bool(y)) for s, n, e, g, y in state["trace"]]
        self.inner.load_state_dict(state["inner"])
        self._want = self._decided = None
        self._finite, self._overflow = True, False
        self._loaded_from = (state.get("rank"), state.get("world_size"))
        if self.comm is not None:
            self._check_loaded_rank()

    def _check_loaded_rank(self) -> None:
        """Warn where the loaded state is another rank's: the meter's EWMA is the saving rank's
        (its gate decides from that rank's history; a rank's own checkpoint resumes exactly)."""
        rank, size = self._loaded_from
        self._loaded_from = (None, None)
        elsewhere = saved_elsewhere(rank, size, self.comm) if rank is not None else ""
        if elsewhere:
            warnings.warn(f"{self.name}: {elsewhere}: the significance EWMA is rank {rank}'s, so this rank's "
                          "gate votes from that rank's history (each rank's own state resumes exactly)",
                          stacklevel=3)

    def __repr__(self) -> str:
        # every setting that decides what the ranks call or compute, deterministic (floats by repr, no
        # object ids): bindings compare it over the ranks (trace_len, this rank's bookkeeping, is left out)
        return (f"SelSync(inner={self.inner!r}, delta={self.delta!r}, window={self.meter.window!r}, "
                f"warmup={self.warmup!r}, mode={self.mode!r}, "
                f"sync_optimizer_state={self.sync_optimizer_state!r}, overlap={self.overlap!r}, "
                f"average_on_flush={self.average_on_flush!r})")
