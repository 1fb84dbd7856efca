"""The strategy lifecycle: the moments of a training step at which a strategy communicates.

A binding (``bindings.torch``, ``bindings.jax``) owns the model and the
optimizer and tells the strategy what the training loop is doing:

=====================  ==================================================  ==========================
moment                 called by the binding                               e.g.
=====================  ==================================================  ==========================
``setup``              once, with the buckets and their flat buffers        broadcast from rank 0
``bucket_ready(b)``    backward filled bucket ``b``'s gradients            WFBP all-reduce, DeAR RS
``before_update()``    optimizer step, before the update                   wait for the gradients
``reopen()``           backward runs again before the update (``reopens``)  a second loss's backward
``after_update()``     optimizer step, after the update                    DeAR's all-gathers
``before_forward(b)``  before the first module of bucket ``b`` runs        wait for bucket ``b``
``flush()``            evaluation, checkpoint, end of training             parameters current
``state_dict()``       checkpoint                                          tuner, meters, phase
``close()``            end of training (after ``flush()``; collective)     Sync-Switch back to BSP
=====================  ==================================================  ==========================

What a strategy tells the binding (every strategy has these; the base
answers for a strategy that needs nothing from the optimizer):

- ``lr_scale``, ``momentum_scale``: factors on the learning rate and the
  momentum coefficient for the update about to run (1.0; Sync-Switch's ASP
  phase sets them); ``changes_momentum``: whether the strategy may ever ask
  for a momentum change (False; Sync-Switch under an ``OfflinePolicy`` that
  resets or ramps momentum);
- ``on_switch(fn)``: ``fn(old, new, changes)`` after a phase switch (never,
  for a strategy with one phase), e.g. to reset momentum;
- ``writes_in_flight()``: whether communication in flight will still write
  the parameters (False; DeAR's all-gathers between a step and the forward
  that waits for them), so that the binding can tell whether parameters
  read now are current;
- ``syncs_optimizer_state()``: after ``after_update()``, whether to average
  the optimizer's state over the ranks now (False; SelSync's synced steps);
- ``replicas_parted()``: the step's agreement found that some ranks skipped
  ``step()`` where others updated; whether the strategy brings the replicas
  together again itself (False: the binding raises on every rank; SelSync
  counts it as drift, Sync-Switch outside a step that stayed in BSP);
- ``gradients_are_local()``: after ``before_update()``, whether the update
  reads this rank's own gradient (False; SelSync's local steps, Sync-Switch's
  ASP), so that the binding agrees with no other rank on what it leaves out
  (the gradient buffers then hold what the binding put there);
- ``step_reads_parameters()``: after ``before_update()``, whether
  ``after_update()`` reads or writes ``params`` on this step
  (``updates_parameters``; SelSync only on the steps whose parameters it
  averages), so that a binding whose parameters live outside the buckets
  (JAX's) packs them only then;
- ``measures_gradients`` / ``observe_norm(norm)`` / ``step_reads_gradients()``:
  a strategy that first decides on the local gradient's 2-norm (SelSync) takes
  it from the binding before ``bucket_ready``, and says whether the step then
  reads the gradients' values at all (not SelSync's local steps, nor
  Sync-Switch's asynchronous ones), so that a binding that copies them into
  the buckets (JAX's) does so only then;
- ``rescale_gradients(factor)``: between steps, the gradients handed over
  from now on are ``factor`` times those before (a changed loss scale), so
  that state in their units follows (residuals, thresholds, norm averages);
- ``tuner``: the cap search the binding feeds step times (``tune=True``);
- ``reopens``: the reduction is linear in the gradient (False; AllReduce,
  DeAR, and Sync-Switch over either), so that a backward pass after ``before_update()`` and before the
  update (a second loss's backward, as DDP allows: DCGAN's discriminator) can
  be reduced onto the gradients already averaged: the binding calls
  ``reopen()``, makes every rank's gradient buffers hold the whole average
  (a sharded strategy's binding all-gathers the shards), lets the pass
  accumulate into them and signals the buckets again;
- ``updates_parameters``: the strategy also reads and writes ``params``
  (averages drifted replicas, exchanges parameter deltas), so its binding must
  hand it the model's parameters and run the update between
  ``before_update()`` and ``after_update()`` (False: gradients only, which a
  gradient transformation such as the JAX binding's can drive).

Buffers are flat arrays of any kind commlib accepts (numpy, cupy, torch via
DLPack).  ``params[b]`` holds bucket ``b``'s parameters (the framework's
parameters are views of it), ``grads[b]`` its gradients; a strategy with
``sharded = True`` also gets ``shard_grads[b]`` (``bucket.shard_numel``
elements) and the binding then runs the optimizer on this rank's shard of
each bucket only (ZeRO-1), reading gradients from ``shard_grads`` and
updating ``params[b][bucket.shard(rank)]``.  ``sharded`` may change only at
a phase switch (Sync-Switch over DeAR: sharded in BSP, whole in ASP): the
binding's ``on_switch`` callback then moves the optimizer's state between
pieces and whole tensors; ``needs_shard_grads`` says whether ``setup``
takes ``shard_grads`` at all.

Buckets are launched in index order on every rank (a bucket that is ready
early waits for the ones before it), so that all ranks call the same
collectives in the same order even when gradients arrive in another order.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from commlib import Communicator, Work

from .buckets import DEFAULT_CAP, DEFAULT_FIRST_CAP, Bucket, MiB, Move
from .tuning import CapTuner

#: the settings a ``tune`` dict may give (:class:`CapTuner`'s keywords)
_TUNER_SETTINGS = frozenset({"low_mb", "high_mb", "trials", "window", "skip", "seed"})


def checked_strategy(strategy: Any, where: str) -> "Strategy":
    """``strategy`` itself if it is a :class:`Strategy`, else ``TypeError`` saying what is expected
    (at construction, before any collective: the same on every rank).

    Example:
        >>> self.strategy = checked_strategy(strategy, "DistributedOptimizer")
    """
    if isinstance(strategy, Strategy):
        return strategy
    hint = (" (a gradient selector goes in commlib.sparsify.SparseAllReduce(selector=...))"
            if type(strategy).__module__.startswith(("commlib.sparsify", "sparsify")) else "")
    raise TypeError(f"{where}: expected a commlib.collectives Strategy (AllReduce(), DeAR(), SelSync(...), "
                    f"SyncSwitch(...), SparseAllReduce(...)), got {type(strategy).__name__}{hint}")


def saved_elsewhere(rank: Any, size: Any, comm: Any) -> str:
    """``"state saved by rank R of W loaded on rank r of w"`` where a strategy's state was saved by
    another rank or world than ``comm``'s (its per-rank parts, residuals or a meter, are that
    rank's); ``""`` where it is this rank's own.

    Example:
        >>> saved_elsewhere(0, 2, comm)          # on rank 1 of 2
        'state saved by rank 0 of 2 loaded on rank 1 of 2'
    """
    if (rank, size) == (comm.rank, comm.size):
        return ""
    return f"state saved by rank {rank} of {size} loaded on rank {comm.rank} of {comm.size}"


def checked_inner(strategy: Any, where: str) -> "Strategy":
    """:func:`checked_strategy` for a strategy that another wraps (``where``: ``"SelSync(inner=...)"``),
    refused also when made with ``tune=``: the wrapper plans the buckets, so its tuner would never be fed.

    Example:
        >>> self.inner = checked_inner(inner, "SelSync(inner=...)")
    """
    inner = checked_strategy(strategy, where)
    if inner.tuned:
        raise ValueError(f"{where.replace('...', inner.name + '(tune=...)')}: the cap of a wrapped strategy "
                         "is not tuned (the tuner would never be fed); give it a fixed cap_mb")
    return inner


class Strategy:
    """Base of every strategy; subclasses override :meth:`launch` and the moments they need.

    ``cap_mb`` / ``first_cap_mb`` / ``last_cap_mb``: the bucket caps in MiB
    (the first bucket to be ready, the rest, and the model's first layers,
    which are ready last; 0: no special first or last bucket).  ``tune``: search the cap online
    (:class:`collectives.tuning.CapTuner`) during the first steps; a dict
    passes its settings (``trials``, ``window``, ``low_mb``, ``high_mb``).

    Example (what a binding does each step):
        >>> s = AllReduce()
        >>> s.setup(comm, buckets, params, grads)
        >>> for b in range(len(buckets)): s.bucket_ready(b)     # from backward hooks
        >>> s.before_update(); optimizer.step(); s.after_update()
    """

    name = "strategy"
    sharded = False
    #: factor on the optimizer's learning rate for the update about to run
    lr_scale = 1.0
    #: factor on the optimizer's momentum coefficient for the update about to run
    momentum_scale = 1.0
    #: the strategy reads and writes ``params`` too (not only ``grads``)
    updates_parameters = False
    #: the strategy sends a selection of the gradient (error feedback keeps the rest), not its average
    sparse = False
    #: a backward pass after ``before_update()`` may be reduced onto its result (see :meth:`reopen`)
    reopens = False
    #: at some step the strategy may ask for a momentum change (``momentum_scale`` other than 1, or a
    #: reset at a switch): a binding that cannot change its optimizer's momentum refuses the strategy
    changes_momentum = False
    #: ``before_update()`` first measures the local gradient by its 2-norm alone (SelSync's gate): a
    #: binding may measure it where the gradient lives and hand it over (:meth:`observe_norm`)
    measures_gradients = False

    @property
    def tuned(self) -> bool:
        """Whether the bucket cap is searched online (``tune=True``, or a dict of settings: ``{}``
        is the defaults)."""
        return self.tune is not False

    @property
    def needs_shard_grads(self) -> bool:
        """Whether :meth:`setup` takes ``shard_grads``: the update runs on shards (``sharded``) at
        some step, if not at every one (Sync-Switch over DeAR: its BSP phases only)."""
        return self.sharded

    def __init__(self, cap_mb: float = DEFAULT_CAP / MiB, first_cap_mb: float = DEFAULT_FIRST_CAP / MiB,
                 tune: bool | dict[str, Any] = False, last_cap_mb: float = DEFAULT_FIRST_CAP / MiB):
        if not cap_mb > 0:
            raise ValueError(f"cap_mb {cap_mb!r}: expected > 0")
        if not first_cap_mb >= 0:
            raise ValueError(f"first_cap_mb {first_cap_mb!r}: expected >= 0")
        self.cap_bytes = int(cap_mb * MiB)
        self.first_cap_bytes = int(first_cap_mb * MiB) or None
        if not last_cap_mb >= 0:
            raise ValueError(f"last_cap_mb {last_cap_mb!r}: expected >= 0")
        self.last_cap_bytes = int(last_cap_mb * MiB) or None
        if not isinstance(tune, (bool, dict)):
            raise TypeError(f"tune={tune!r}: expected True, False or a dict of CapTuner's settings")
        if isinstance(tune, dict):
            unknown = sorted(set(tune) - _TUNER_SETTINGS)
            if unknown:
                raise TypeError(f"tune: unknown setting(s) {unknown} (CapTuner takes "
                                f"{', '.join(sorted(_TUNER_SETTINGS))})")
        self.tune = tune
        self.tuner: CapTuner | None = None
        self._tuner_state: dict[str, Any] | None = None   # a load's, until setup() makes the tuner
        self.comm: Communicator | None = None
        self.buckets: list[Bucket] = []
        self.params: list[Any] = []
        self.grads: list[Any] = []
        self.shard_grads: list[Any] = []
        #: the name of the tree the buckets hold, where one binding averages several trees through
        #: this strategy (JAX's ``average_gradients`` over two models); ``None``: one tree
        self.tree: str | None = None
        self.steps = 0
        self.stats: dict[str, float] = {"wait_s": 0.0, "bytes": 0.0}
        self._ready: list[bool] = []
        self._next = 0
        self._switch_callbacks: list[Callable[[str, str, dict[str, Any]], None]] = []

    # ------------------------------------------------------------------ lifecycle
    def setup(self, comm: Communicator, buckets: Sequence[Bucket], params: Sequence[Any],
              grads: Sequence[Any], shard_grads: Sequence[Any] | None = None,
              broadcast: bool = True, tree: str | None = None) -> None:
        """Take the buckets and their buffers; with ``broadcast``, make every
        rank start from rank 0's parameters.  Called again after a re-plan.  ``tree``: the name of
        the tree the buckets hold where a binding averages several (the same name on every rank
        and across restarts): a strategy with state per element (the sparse ones' residuals)
        keeps one per tree, and its :meth:`state_dict` holds them all."""
        if len(params) != len(buckets) or len(grads) != len(buckets):
            raise ValueError(f"{len(buckets)} buckets but {len(params)} parameter and "
                             f"{len(grads)} gradient buffers")
        if self.needs_shard_grads and (shard_grads is None or len(shard_grads) != len(buckets)):
            raise ValueError(f"{self.name} updates shards: it needs one shard gradient buffer per bucket")
        self.comm = comm
        self.tree = tree
        if self.tuned and self.tuner is None:
            self.tuner = self._new_tuner(comm)
            if self._tuner_state is not None:                # loaded before the first setup
                self.tuner.load_state_dict(self._tuner_state)
                self._tuner_state = None
        self.buckets = list(buckets)
        self.params, self.grads = list(params), list(grads)
        self.shard_grads = list(shard_grads or [])
        self._reset_step()
        if broadcast:
            for b, p in enumerate(self.params):
                comm.broadcast(p, 0, out=p, tag=f"bcast{b}")

    def replanned(self, moves: Sequence[Move]) -> None:
        """After the :meth:`setup` of a re-plan (a parameter frozen or unfrozen, a group added, a
        tuned cap): where each tensor that trains in both plans moved.  A strategy that keeps state
        per element (the sparse strategies' residuals) carries it over; nothing for most.

        Example (what a binding does after a re-plan's setup):
            >>> strategy.replanned([Move(old_bucket=0, old_offset=0, bucket=1, offset=16, numel=8)])
        """

    def _reset_step(self) -> None:
        self._ready = [False] * len(self.buckets)
        self._next = 0

    def bucket_ready(self, b: int) -> None:
        """Backward has filled bucket ``b``'s gradients; launch what may start."""
        self._ready[b] = True
        while self._next < len(self.buckets) and self._ready[self._next]:
            self.launch(self._next)
            self._next += 1

    def launch_remaining(self) -> None:
        """Launch every bucket not launched yet (gradients that never came count as they are)."""
        while self._next < len(self.buckets):
            self._ready[self._next] = True
            self.launch(self._next)
            self._next += 1

    def launch(self, b: int) -> None:
        """Start bucket ``b``'s communication (subclasses)."""
        raise NotImplementedError

    def before_update(self) -> None:
        """Make the gradients the update needs complete (averaged over ranks)."""
        self.launch_remaining()

    def carry(self, words: Sequence[int]) -> None:
        """Small integers (>= 0) the binding needs agreed at this step, as their max over the ranks
        (whether each rank loaded, updated, what its reduction follows).  A strategy whose step makes
        a small all-reduce anyway where the gradients stay local (SelSync's flag) carries them on
        it, and :meth:`carried` returns the max; here nothing carries them.  Call before
        :meth:`before_update`.

        Example:
            >>> strategy.carry([0, 1, 0])
            >>> strategy.before_update()
            >>> strategy.carried()          # None: the binding agrees on them itself
        """

    def carried(self) -> Any:
        """The max over the ranks of this step's :meth:`carry` words (an int array), where a
        collective of the step carried them, else ``None``."""
        return None

    def reopen(self) -> None:
        """Backward runs again after :meth:`before_update`, before the update: launch the buckets
        again as they fill (only where ``reopens``: the gradient buffers then hold this pass added
        to the average, and reducing them again gives the sum of both passes' averages)."""
        if not self.reopens:
            raise RuntimeError(f"{self.name} cannot reduce another backward pass onto a reduced gradient")
        self._reset_step()

    def after_update(self) -> None:
        """The update is applied; start what may overlap the next forward."""
        self.steps += 1
        self._reset_step()

    def before_forward(self, b: int) -> None:
        """The first module of bucket ``b`` is about to run forward."""

    def flush(self) -> None:
        """Make parameters current on every rank (evaluation, checkpoint, end of training)."""

    def close(self) -> None:
        """End of training: free what the strategy holds beyond its buffers (a collective: Sync-Switch
        returns to BSP and frees its windows); nothing for most.  Closing twice is harmless."""

    def complete(self) -> None:
        """Wait for the communication in flight and start none (safe from a module hook).

        Unlike :meth:`flush`, never a new collective: after it, parameters are
        what the last step made them (DeAR's all-gathers, SelSync's average done).
        """

    def writes_in_flight(self) -> bool:
        """Whether communication in flight will still write the parameters (DeAR's all-gathers
        after a step, before the forward that waits for them); False after :meth:`complete`."""
        return False

    # ------------------------------------------------------------------ what the binding asks
    def on_switch(self, fn: Callable[[str, str, dict[str, Any]], None]) -> None:
        """Call ``fn(old_phase, new_phase, changes)`` after every phase switch (on every rank).

        A strategy with one phase never switches, so ``fn`` is never called;
        :class:`collectives.syncswitch.SyncSwitch` switches between BSP and ASP.
        """
        self._switch_callbacks.append(fn)

    def syncs_optimizer_state(self) -> bool:
        """Whether the binding averages the optimizer's state over the ranks after this
        ``after_update()`` (SelSync with ``sync_optimizer_state`` on a step that
        synchronized); never for a strategy whose replicas stay equal."""
        return False

    def replicas_parted(self) -> bool:
        """The step's agreement found that some ranks updated and others skipped ``step()`` since
        the last one (the binding's words): True where this strategy brings the replicas together
        again itself (SelSync: at a later synchronized step, as after local steps); False, the
        default, where the binding raises on every rank (the replicas would stay apart)."""
        return False

    def gradients_are_local(self) -> bool:
        """After :meth:`before_update`: whether the update about to run reads this rank's own
        gradient (SelSync's local steps and parameter mode, Sync-Switch's ASP/SSP) rather than
        one every rank took part in (False: AllReduce, DeAR, sparse exchanges, synchronized
        steps).  The binding then decides on its own what this rank's update leaves out (a
        parameter it gave no gradient), with no collective that asynchronous ranks never meet."""
        return False

    def step_reads_parameters(self) -> bool:
        """After :meth:`before_update`: whether :meth:`after_update` reads or writes ``params`` on
        this step (a strategy that updates parameters: at every step unless it says otherwise)."""
        return self.updates_parameters

    def step_reads_gradients(self) -> bool:
        """Before this step's :meth:`bucket_ready`: whether the step reads the gradients' values from
        the buckets (False: Sync-Switch's asynchronous steps, where only the update uses them; a
        SelSync step that :meth:`observe_norm` decided is local, or synchronizes in params mode).  A
        binding that copies the gradients into the buckets may skip the copy where False."""
        return True

    def observe_norm(self, norm: float) -> None:
        """Where :attr:`measures_gradients`: this step's local gradient 2-norm, measured by the binding
        where the gradient lives, before :meth:`bucket_ready`; the strategy decides on it (SelSync:
        the ranks agree whether the step synchronizes, a collective), so that
        :meth:`step_reads_gradients` can tell whether the buckets are needed."""
        raise NotImplementedError(f"{self.name} does not measure the gradients (measures_gradients is False)")

    def rescale_gradients(self, factor: float) -> None:
        """The gradients handed over from now on are ``factor`` times those before (a loss scale that
        changed between steps: GradScaler's backoff after an overflow, its growth); state kept in the
        gradients' units follows it (a sparse strategy's residuals and thresholds, SelSync's norm
        average), so that a scaled run trains as the unscaled one.  Every rank, the same factor,
        between steps.  Default: no such state.

        Example:
            >>> strategy.rescale_gradients(0.5)      # the loss scale halved after an overflow
        """

    def load_is_collective(self, state: dict[str, Any]) -> bool:
        """Whether :meth:`load_state_dict` of ``state`` communicates now, so that every rank must call
        it at the same point (Sync-Switch re-entering a checkpoint's asynchronous phase).  A binding
        then defers it to a point every rank reaches (the torch binding: ``broadcast_optimizer_state``
        or the next training forward), so that rank 0 may load alone and broadcast (Horovod's resume).

        Example:
            >>> AllReduce().load_is_collective(AllReduce().state_dict())
            False
        """
        return False

    # ------------------------------------------------------------------ helpers
    def _wait(self, works: list[Work | None], b: int | None = None) -> None:
        """Wait for ``works[b]`` (or all), counting the time blocked."""
        idx = range(len(works)) if b is None else (b,)
        t0 = time.perf_counter()
        for i in idx:
            w = works[i]
            if w is not None:
                works[i] = None
                w.wait()
        self.stats["wait_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (the binding adds the optimizer's)."""
        return {"name": self.name, "steps": self.steps, "cap_bytes": self.cap_bytes,
                "first_cap_bytes": self.first_cap_bytes,
                "tuner": self.tuner.state_dict() if self.tuner is not None else None}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` is a :meth:`state_dict` of a strategy of this kind
        (bindings ask before they load anything of a checkpoint, so that a refused one changes nothing).

        Example:
            >>> DeAR().check_state(AllReduce().state_dict())     # ValueError: ... 'allreduce' given to 'dear'
        """
        if not isinstance(state, dict) or state.get("name") != self.name:
            name = state.get("name") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state of strategy {name!r} given to {self.name!r} (a checkpoint of another "
                             "strategy: drop its 'commlib' entry to load the optimizer's state alone)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        caps = (int(state["cap_bytes"]), state["first_cap_bytes"])
        if not self.tuned and caps != (self.cap_bytes, self.first_cap_bytes):
            warnings.warn(f"{self.name}: the checkpoint's bucket caps (cap_mb={caps[0] / MiB!r}, "
                          f"first_cap_mb={(caps[1] or 0) / MiB!r}) replace this strategy's ({self._caps()}), "
                          "as torch's load_state_dict replaces the learning rate", stacklevel=3)
        self.steps = int(state["steps"])
        self.cap_bytes = int(state["cap_bytes"])
        self.first_cap_bytes = state["first_cap_bytes"]
        if state.get("tuner") is not None and self.tuner is not None:
            self.tuner.load_state_dict(state["tuner"])
        elif state.get("tuner") is not None and self.tuned:
            self._tuner_state = state["tuner"]      # the tuner is made at the first setup()
        elif self.tuned:       # saved untuned: the search starts afresh, from the checkpoint's cap
            warnings.warn(f"{self.name}: the checkpoint was saved without tune=, so the cap search starts "
                          f"afresh from its cap_mb={self.cap_bytes / MiB!r}", stacklevel=3)
            self._tuner_state = None
            if self.tuner is not None:
                self.tuner = self._new_tuner(self.tuner.comm)

    def _new_tuner(self, comm: Communicator) -> CapTuner:
        """A cap search starting at the strategy's cap, with the ``tune`` dict's settings."""
        return CapTuner(comm, self.cap_bytes, **(self.tune if isinstance(self.tune, dict) else {}))

    def _caps(self) -> str:
        """The bucket caps (and tuning) as the repr shows them: bindings compare reprs over the ranks
        when they wrap, and buckets planned with other caps meet other collectives."""
        return (f"cap_mb={self.cap_bytes / MiB!r}, first_cap_mb={(self.first_cap_bytes or 0) / MiB!r}, "
                f"last_cap_mb={(self.last_cap_bytes or 0) / MiB!r}"
                + (f", tune={self.tune!r}" if self.tuned else ""))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._caps()})"
