"""The training loop around :class:`bindings.torch.DistributedOptimizer`, written as for one process.

:class:`TrainingLoop`: the part of ``DistributedOptimizer`` met between ``backward()`` and ``step()``:

* gradients are final when ``backward()`` returns: an autograd final callback (as DDP's) launches what is
  left and waits for the strategy's reduction; ``opt.synchronize()`` and ``with opt.skip_synchronize():
  opt.step()`` as Horovod users write them;
* ``torch.amp.GradScaler``: a non-finite gradient on any rank is non-finite on every rank, so every rank
  skips the same steps and scales alike (given as ``grad_scaler``, its scale changes rescale the strategy);
* ``with opt.no_sync():`` accumulates locally (DDP's name); a ``backward()`` after the average,
  before ``step()``, adds its own average (AllReduce, DeAR, Sync-Switch), as DDP's does; one after a
  ``step()`` without ``zero_grad()`` adds to the last average, as in one process (DeAR gathers it first);
* ``model.state_dict()``, ``model.load_state_dict()``, ``opt.state_dict()`` and evaluation forwards
  (``model.eval()`` or ``torch.no_grad()``) wait for the communication in flight (DeAR's all-gathers)
  first, and any other use of a parameter waits for its own bucket (``torch_params``);
* ``opt.step(closure)``: each evaluation of the closure averaged, its loss too (LBFGS evaluates alike);
* parameters no rank gave a gradient are left out of the update, as one process leaves them (one small
  all-reduce per step, which also carries the notes of checkpoints loaded: ``torch_replicas``); those of
  the model outside the optimizer are averaged too (DDP's rule), so norms over the model are one process's;
* a parameter that starts or stops training (``requires_grad``, gradual unfreezing), a model moved or
  converted after wrapping (``model.to()``, ``.double()``, ``.data`` assigned) or a checkpoint of another
  (tuned) cap loaded re-plans the buckets at the next forward with gradients enabled (train or eval
  mode), on every rank; a Sync-Switch checkpoint re-enters its phase there.

Example (the full loop; ``scaler`` may be ``GradScaler("cpu", enabled=False)``):
    >>> for x, y in loader:
    ...     opt.zero_grad()
    ...     with torch.autocast("cpu", dtype=torch.bfloat16):
    ...         loss = loss_fn(model(x), y)
    ...     scaler.scale(loss).backward()          # gradients averaged when this returns
    ...     scaler.unscale_(opt)
    ...     opt.clip_grad_norm_(1.0)               # the global norm, any strategy
    ...     scaler.step(opt); scaler.update(); sched.step()
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from commlib.errors import ValidationError

from .torch_amp import LossScale
from .torch_comm import average_loss
from .torch_grads import ShardedGrad, ShardNorms
from .torch_hooks import InertHook, ModelHook, guard_module_hooks_under_compile, remove_inert_twins
from .torch_owners import claim, drive, driver_of, owner_of
from .torch_params import InFlight
from .torch_unused import OutsideParameters, UnusedParameters

__all__ = ["TrainingLoop", "ModelHook", "InertHook"]     # the hooks: here too, for models pickled before

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DATA_PTR = torch.Tensor.data_ptr


def _accumulates(p: torch.Tensor) -> bool:
    """Whether the backward running now accumulates into ``p.grad`` (its AccumulateGrad node runs;
    ``torch.func.grad``'s parameters have none here)."""
    node = p.view_as(p).grad_fn
    return node is not None and torch._C._will_engine_execute_node(node.next_functions[0][0])


class TrainingLoop:
    """Mixin of :class:`bindings.torch.DistributedOptimizer` (uses its buckets, views and strategy)."""

    comm: Any
    strategy: Any
    model: torch.nn.Module
    buckets: list[Any]
    backward_passes_per_step: int
    find_unused_parameters: bool
    _inner: torch.optim.Optimizer
    _params: list[torch.nn.Parameter]
    _frozen: list[torch.nn.Parameter]
    _hooks: list[Any]
    _copies: list[tuple[Any, int]]
    _retired_by: str
    _data_ptrs: list[int]
    _flat_grads: list[torch.Tensor]
    _seen_versions: list[int]
    _zero_to_none: bool
    _shard_grads: list[torch.Tensor]
    _grad_views: list[torch.Tensor]
    _shard_norms: ShardNorms | None
    _in_flight: InFlight
    _signaled: list[bool]
    _interrupted: int
    _planned_cap: int
    _loss_scale: LossScale
    _outside: OutsideParameters
    _average_optimizer_state: Callable[[], None]       # AveragedState's (torch_state_average)

    def _init_loop(self) -> None:
        self._zero_to_none = True       # the last zero_grad's set_to_none (see replan)
        self._no_sync_depth = 0
        self._unscaled: set[int] = set()       # buckets still to bring to an agreed loss scale
        self._scale_factor = 1.0
        self._partial = False
        self._last_averaged = True      # the last step's gradients were averaged (see _reduce)
        self._unused = UnusedParameters(self.comm, self.find_unused_parameters)
        self._end_step()
        model = self.model
        guard_module_hooks_under_compile()
        complete, loading = self._hook(lambda *_: self._complete()), self._hook(self._model_loading)
        self._loop_hooks = [h for m in model.modules() for h in (m.register_state_dict_pre_hook(complete),
                                                                  m.register_load_state_dict_pre_hook(loading))]
        self._loop_hooks.append(self._hook(self._before_forward).register_on(model))
        self._loop_hooks.append(self._hook(self._after_forward).register_on(model, after=True))

    def _retire_older_owners(self) -> None:
        """A new optimizer for parameters that another one trains (a new phase of training: another
        optimizer class, or all parameters after unfreezing) replaces it, as a new optimizer does
        beside DDP: the old one finishes its communication and leaves the model (its hooks kept
        averaging, re-planning and waiting against this one's).  Same order on every rank."""
        older = []
        for p in self._params + self._frozen:
            owner = owner_of(p)
            if owner is not None and owner is not self and owner not in older:
                older.append(owner)
        driver = driver_of(self.strategy)
        if driver is not None and driver not in older:      # before any change (same on every rank)
            raise ValueError(
                f"DistributedOptimizer: this {type(self.strategy).__name__} already drives another "
                f"DistributedOptimizer, over other parameters (it holds that optimizer's buckets and "
                f"state: shared, one optimizer's gradients were never averaged); give each optimizer a "
                f"strategy of its own (a new {type(self.strategy).__name__}(...) for each)")
        for p in self._params + self._frozen:
            claim(p, self)
        drive(self.strategy, self)
        for owner in older:
            owner._retire(f"replaced by a newer one ({type(self._inner).__name__} with "
                          f"{self.strategy.name}) wrapping the same parameters; step the new one")
            left = [p for p in owner._params if owner_of(p) is not self]
            if left:
                warnings.warn(f"DistributedOptimizer: the new optimizer replaces an older one, whose other "
                              f"{len(left)} parameters are no longer averaged", stacklevel=3)

    def close(self) -> None:
        """End training with this optimizer: the parameters become current on every rank (a
        collective: call it on every rank) and every hook leaves the model, its parameters and its
        deep copies (an EMA), which are plain again (``torch.jit.script`` compiles them; a forward
        costs nothing extra).  ``step()`` raises afterwards; ``state_dict()`` still gives the whole state.

        Example:
            >>> opt.close()                              # after the last step
            >>> torch.jit.script(model).save("model.pt")
        """
        if not self._retired_by:
            # a labeled call first: a close on some ranks only fails on every rank naming it (DeAR's
            # all-gathers below read as a gather of .grad's values there)
            self.comm.allgather_object(None, label="DistributedOptimizer.close()")
            self._retire("closed by close(); wrap the model in a new one to train on")
            remove_inert_twins(self._copies)      # copies made meanwhile (an EMA) are plain too
            for p in self._params:     # read as a plain model's: the whole average, in a plain tensor
                if isinstance(p.grad, ShardedGrad):
                    p.grad = p.grad.clone()

    def _end_skipped_step(self, zero: bool = True) -> None:
        """GradScaler skipped the last step and the loop zeroes with ``model.zero_grad()`` (or not
        yet): the step ends here, at the next training forward or ``add_param_group``, its
        gradients zeroed as ``opt.zero_grad()`` would have.  ``zero=False`` (a checkpoint taken
        before that: it was a step behind, so SelSync resumed off the run that went on and
        Sync-Switch parted the ranks' phases) leaves the gradients as they are."""
        if self._synced and self._loss_scale.backed_off():
            if zero:
                self.zero_grad()
            else:
                self._close_skipped_step()

    def _retire(self, by: str) -> None:
        """A newer optimizer wraps these parameters, or :meth:`close`: end the strategy (Sync-Switch
        returns to BSP, the replicas and optimizers alike, and frees its windows; a newer optimizer
        given the same strategy sets it up again), finish what is in flight, leave the model; ``by``
        says why, as :meth:`step` will."""
        self.strategy.close()
        self._flush()
        # left in ASP or SSP, Sync-Switch returned to BSP there: its GradScalers one again now (every
        # rank retires at the same point, past its last step; no gradient is in flight)
        self._loss_scale.agree(self.comm)
        for h in self._hooks + self._loop_hooks:
            h.remove()
        self._hooks, self._loop_hooks = [], []
        self._retired_by = by

    def _after_update(self) -> None:
        """The update is applied: the strategy starts what overlaps the next forward, and parameters
        it still writes wait for it when used (:class:`InFlight`)."""
        self.strategy.after_update()
        if self.strategy.writes_in_flight():
            self._in_flight.mark()
        if self.strategy.syncs_optimizer_state():   # SelSync: momentum agrees with the averaged
            self._average_optimizer_state()         # parameters (a skipped step's too: every rank calls)

    def _complete(self) -> None:
        """Wait for the communication in flight and start none (safe from a module hook)."""
        self.strategy.complete()
        self._in_flight.landed_all()

    def _flush(self) -> None:
        """Make parameters current on every rank (a collective for some strategies)."""
        self.strategy.flush()
        self._in_flight.landed_all()

    def _hook(self, fn: Any) -> "ModelHook":
        """``fn`` as a hook on the user's model, left behind by copies of the model."""
        return ModelHook(fn, self._before_copy, self._copies)

    def _before_copy(self, memo: dict | None) -> None:
        """A copy of the model (or a pickle) is being made: it gets every parameter current, also
        those copied before this hook (``memo``: ``copy.deepcopy``'s, original id to copy)."""
        self._complete()
        for p in self._params if memo else ():
            twin = memo.get(id(p))
            if twin is not None:
                twin.data.copy_(p.data)

    @torch.compiler.disable
    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Evaluation sees the last update; a forward with gradients (train or eval mode) takes a load
        deferred to it (a Sync-Switch checkpoint's phase) and re-plans when ``requires_grad`` changed, a
        parameter no longer lives in its bucket (the model moved or converted after wrapping) or a loaded
        checkpoint's cap is not the plan's (it was tuned).  Never traced by ``torch.compile``, like every
        hook that waits: Dynamo would replay the state it saw while tracing instead of waiting."""
        if torch.is_grad_enabled():
            self._end_interrupted_pass()
        if self._synced and torch.is_grad_enabled():
            self._end_skipped_step()    # before this forward reads the parameters (Sync-Switch may
                                        # switch and pull them)
        if self._pending_load is not None and torch.is_grad_enabled():
            self._take_pending_load()       # a collective: every rank has loaded by its next forward
        with torch._C.DisableTorchFunctionSubclass():     # parameters DeAR still gathers: metadata only
            moved = list(map(_DATA_PTR, self._params)) != self._data_ptrs
            changed = self._trainable_changed()
        grad = torch.is_grad_enabled()
        if not module.training or not grad:
            self._complete()
        else:
            self._in_flight.before_module(id(module), ())
        if grad and (moved or changed or self.strategy.cap_bytes != self._planned_cap):
            # a collective: every rank changes requires_grad (or moves the model, or loads) at the same point;
            # in eval mode too (training with dropout off or batch statistics frozen, as RLHF loops do)
            self.replan()

    def _trainable_changed(self) -> bool:
        """A parameter started or stopped training; a forward with nothing trainable (features from a
        frozen model) keeps the plan for later."""
        params, frozen = self._params, self._frozen
        return ((not all(map(_REQUIRES_GRAD, params)) or any(map(_REQUIRES_GRAD, frozen)))
                and (any(map(_REQUIRES_GRAD, params)) or any(map(_REQUIRES_GRAD, frozen))))

    def _note_grad_versions(self) -> None:
        """The buckets' gradient versions now: a gradient hook that finds its bucket's unchanged
        had nothing accumulated (see ``_make_grad_hook``)."""
        self._seen_versions = [g._version for g in self._flat_grads]

    def _end_step(self) -> None:
        self._note_grad_versions()
        n = len(self._params)
        self._counts = [0] * n
        self._got = [False] * n
        self._reached = [False] * n     # by a batch that counts (not a repeat: join)
        self._bucket_need = [len(b.slots) for b in self.buckets]
        self._signaled = [False] * len(self.buckets)
        self._passes = 0
        self._reopened = False
        self._callback_queued = False
        self._backward_entered = False      # a backward reached the model's output, no gradient yet
        self._synced = self._gathered = False
        self._join_weights()

    # ------------------------------------------------------------------ backward
    def _gradient_arrived(self, i: int, fresh: bool) -> bool:
        """From parameter ``i``'s gradient hook: True when it counts towards this step's reduction.

        ``fresh``: ``.grad`` had been set to ``None`` since (``model.zero_grad()``)."""
        if self._synced:
            if fresh:
                self._close_skipped_step()      # GradScaler skipped the last step(), then model.zero_grad()
            elif self.strategy.reopens and not self._sharded:  # sharded: reopened before accumulating
                self._reopen()
            else:   # refused as this rank's next operation: a peer's next one raises it too, at once
                self.comm.refuse("DistributedOptimizer.backward", ValidationError(
                    f"DistributedOptimizer: backward() ran again after this step's gradients were "
                    f"averaged, before step() or zero_grad(), and {self.strategy.name} cannot add "
                    "another pass to them (AllReduce, DeAR and SyncSwitch can); accumulate with "
                    "opt.no_sync() or backward_passes_per_step"))
        self._got[i] = True
        if not self.repeating:      # a repeated batch (join) tells nothing of which parameters are used
            self._reached[i] = True
        if not self._callback_queued:
            self._begin_pass()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        return self._no_sync_depth == 0

    def _begin_pass(self) -> None:
        """A pass begins (its first gradient arrived): ``.grad`` is this rank's own until reduced."""
        self._partial = False           # gathered before it, or model.zero_grad()'s None
        self._backward_entered = False
        self._shards_settled(False)
        factor = self._loss_scale.agree(self.comm)  # back at BSP: one loss scale on every rank
        if factor != 1.0:       # this pass's gradients, in this rank's own scale, to the common one
            self._unscaled = set(range(len(self.buckets)))
            self._scale_factor = factor
        self._loss_scale.follow(self.strategy)     # before the step's first launch
        self._callback_queued = True

    @torch.compiler.disable     # registers autograd hooks: never traced (see _before_forward)
    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A training forward's outputs: a backward that reaches them is this rank's pass, even where it
        raises before any parameter's gradient (see :meth:`_backward_reached`)."""
        if not torch.is_grad_enabled() or self._callback_queued:
            return
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(self._backward_reached)

    def _backward_reached(self, grad_outputs: Any) -> None:
        """A backward reached the model's output and will compute gradients of its parameters (not
        ``torch.autograd.grad`` of an input, a gradient penalty's): should it raise before the first
        of them arrives, the pass ends as an interrupted one (:meth:`_end_interrupted_pass`)."""
        if self._callback_queued or self._backward_entered or self._synced:
            return
        with torch.enable_grad():
            try:
                self._backward_entered = any(_accumulates(p) for p in self._params if p.requires_grad)
            except RuntimeError:        # a backward the engine does not run (torch.func's): no pass
                self._backward_entered = False

    def _make_pre_accumulate_hook(self, i: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self._synced or self._partial:       # (rare) see _before_accumulate
                self._before_accumulate(i)
        return hook

    @torch.compiler.disable     # autograd's pre-accumulation hook: never traced
    def _before_accumulate(self, i: int) -> None:
        """Sharded strategies that reopen, before parameter ``i``'s gradient is added to ``.grad`` (not
        ``model.zero_grad()``'s None): a pass after this step's reduction reopens it while ``.grad``
        holds no part of that pass yet; the first pass of a step after one without ``zero_grad()``
        (:attr:`_partial`: ``.grad`` holds this rank's shard of the last average, its own pass
        elsewhere) gathers that average first, to which one process adds (one all-gather)."""
        if self._params[i].grad is not self._grad_views[i]:
            return
        if self._synced:
            self._reopen()
        elif self._partial:
            self._gather_shards()

    def _to_common_scale(self, b: int) -> None:
        """Bucket ``b``'s gradients of the pass during which the ranks' loss scales were agreed (they
        came in this rank's own scale) to the common scale, once, before they are reduced."""
        if b in self._unscaled:
            self._unscaled.discard(b)
            self._flat_grads[b].mul_(self._scale_factor)

    def _reopen(self) -> None:
        """Backward runs again after this step's gradients were averaged, before ``step()`` (a second
        loss's backward; DCGAN's discriminator, real then fake): as with DDP, this pass is averaged
        and added to them.  ``.grad`` must hold the whole average first, on every rank (a sharded
        strategy's shards are all-gathered, as by :meth:`synchronize`): the pass then adds to it,
        and reducing the sum adds the pass's average."""
        if self._join_factor() != 1.0:
            raise RuntimeError("DistributedOptimizer.join: backward() ran again after this step's gradients "
                               "were averaged while some ranks repeat a batch; run every backward of a step "
                               "before the average (opt.no_sync(), backward_passes_per_step)")
        if self._sharded:
            self.synchronize()
        self.strategy.reopen()
        k = self.backward_passes_per_step
        self._counts = [k - 1] * len(self._params)
        self._bucket_need = [len(b.slots) for b in self.buckets]
        self._signaled = [False] * len(self.buckets)
        self._passes = k - 1
        self._reopened = True
        self._synced = self._gathered = False

    @torch.compiler.disable     # autograd's final callback, inside a compiled train step too
    def _backward_done(self) -> None:
        node = torch._C._current_autograd_node()
        if node is not None:
            # a backward run inside a node of an enclosing one (reentrant checkpointing: the segment's
            # recomputed backward, where this pass's first gradient came): the pass goes on in the
            # enclosing backward, whose end is its end; after this node, queue there instead
            handle = node.register_hook(lambda *_: self._queue_in_enclosing(handle))
            return
        self._callback_queued = False
        for b in list(self._unscaled):      # the pass whose scale was agreed: every bucket in it now
            self._to_common_scale(b)
        self._join_backward()
        if self._no_sync_depth:
            return
        self._passes += 1
        if self._passes >= self.backward_passes_per_step:
            self._reduce()

    def _pass_kind(self) -> list[int]:
        """What this rank's reduction follows, one-hot (rides on the step's agreement): a step's
        backward passes, none (``step()`` again without a backward: its ``.grad`` as it stands), or
        a pass added after the average (a second ``backward()`` before ``step()``)."""
        kind = 2 if self._reopened else 1 if self._passes == 0 else 0
        return [int(kind == k) for k in range(3)]

    def _end_interrupted_pass(self) -> None:
        """A backward that raised on this rank (the exception caught, the loop going on) left its
        pass open: autograd dropped the callback that ends it, and the peers wait for the buckets it
        had not sent (its next pass's would pair with them, a step apart, silently).  At the next
        ``zero_grad()``, training forward or ``step()`` outside a backward, the pass ends here as it
        stands, and the step's agreement raises on every rank, before any update."""
        if torch._C._current_autograd_node() is not None:
            return
        if not self._callback_queued and self._backward_entered and not self._synced:
            self._begin_pass()      # it reached the model and raised before any parameter's gradient
        self._backward_entered = False
        if self._callback_queued:
            self._interrupted = self.comm.rank + 1
            self._backward_done()

    def _queue_in_enclosing(self, handle: Any) -> None:
        """After the node of an enclosing backward that ran a nested one where this pass's callback
        was queued: queue it again, now in the enclosing backward (its post-hook runs there)."""
        handle.remove()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _reduce(self) -> None:
        """Launch what is left, wait for the strategy's reduction, agree on unused parameters."""
        if self._synced:
            return
        gave_none = []             # model.zero_grad()'s None, and no gradient from this rank
        # .grad still holding the last step's average (no zero_grad() since) and no gradient added
        # this step: one process steps with it again (step() twice, a branch some steps take), so
        # it is averaged again as it is, the same on every rank (DeAR's shards gathered first);
        # it was zeroed, the update dropped it.  Not where the last step's were the ranks' own
        # (SelSync's local steps, Sync-Switch's ASP) or a batch repeats (join): zeros there.
        keeps = self._join is None and self._last_averaged
        # step() again without a backward under a sharded strategy: .grad's shard positions still
        # hold this rank's shard of the last average, which the update reads.  The buckets are
        # reduced as they stand all the same (the shards kept aside and put back after), so that
        # the step's collectives are any step's: where a rank alone steps again, its reductions
        # pair with its peers' next step's, and the step's agreement raises on every rank (an
        # all-gather of the shards first met the peers' reduce-scatter)
        again = (keeps and self._sharded and self._partial and self._passes == 0 and not self._reopened
                 and not any(self._got)
                 and all(p.grad is v for p, v in zip(self._params, self._grad_views)))
        rank = self.comm.rank
        kept = [g[b.shard(rank)].clone() for b, g in zip(self.buckets, self._flat_grads)] if again else None
        if not again and keeps and self._partial and any(
                not got and self._params[i].grad is self._grad_views[i] for i, got in enumerate(self._got)):
            self._gather_shards()
        for i, got in enumerate(self._got):
            grad = self._params[i].grad
            if grad is not None and grad is not self._grad_views[i]:
                if self.repeating:         # a repeated batch's gradient counts for nothing (join)
                    self._params[i].grad = self._grad_views[i]
                    self._grad_views[i].zero_()
                else:
                    self._take_assigned(i)
            elif not got and (grad is None or not keeps):      # no gradient this step: zeros
                self._grad_views[i].zero_()
                if grad is None:
                    gave_none.append(i)
        for b in range(len(self.buckets)):
            if not self._signaled[b]:
                self._signal(b)
        self.strategy.carry(self._load_flags())     # on a local step's own collective, if it makes one
        self.strategy.before_update()
        for sg, shard in zip(self._shard_grads, kept or ()):
            sg.copy_(shard)
        factor = self._join_factor()
        if factor != 1.0:           # the average over the ranks that had a batch (join)
            torch._foreach_mul_(self._shard_grads if self._sharded else self._flat_grads, factor)
        local = self.strategy.gradients_are_local()
        self._last_averaged = not local
        self._outside.average(local)
        agreed = self._unused.find(self._params, self._reached, local, self.model,
                                   None if self._sharded else self._grad_views, also=self._load_flags())
        self._agree_loads(agreed if agreed is not None else self.strategy.carried())
        for i in gave_none:        # another rank gave one: this rank updates with the average too
            if i not in self._unused.indices:
                self._params[i].grad = self._grad_views[i]
        if self._sharded:
            self._settle_shards()
        self._synced = True

    def _take_assigned(self, i: int) -> None:
        """Parameter ``i``'s ``.grad`` was assigned, not accumulated by backward (``torch.func.grad``,
        ``torch.autograd.grad``, Opacus-style per-sample clipping): it is this step's gradient, averaged
        as Horovod averages it, through the bucket it belongs to."""
        p, view = self._params[i], self._grad_views[i]
        if self._bucket_of[i] >= 0 and self._signaled[self._bucket_of[i]]:
            raise RuntimeError(f"DistributedOptimizer: .grad of parameter #{i} {tuple(p.shape)} was "
                               "assigned after backward() had sent its bucket; modify .grad in place, or "
                               "assign gradients before the step without calling backward()")
        view.copy_(p.grad)
        p.grad = view
        self._got[i] = self._reached[i] = True

    def _adopt_assigned(self) -> None:
        """Once the gradients are averaged: a ``.grad`` assigned since (``p.grad = p.grad * s``, a
        tensor of the user's) into its bucket's view, which a sharded strategy's update and
        ``clip_grad_norm_`` read (they read the average and ignored the assignment); not averaged
        again, as one process, DDP or a whole-gradient strategy steps with the ``.grad`` it finds."""
        views = self._grad_views
        for i, p in enumerate(self._params):
            grad = p.grad
            if grad is not None and grad is not views[i]:
                views[i].copy_(grad)
                p.grad = views[i]

    def _settle_shards(self) -> None:
        """Sharded strategies: the reduced shard into ``.grad``'s positions (the update reads
        them there), and a non-finite gradient on any rank made non-finite everywhere.  The
        parameters' gradient norms over the ranks' shards come with that agreement (one small
        all-reduce), so that reading them (torch's ``clip_grad_norm_``) needs no other."""
        rank = self.comm.rank
        for b, g, sg in zip(self.buckets, self._flat_grads, self._shard_grads):
            g[b.shard(rank)].copy_(sg)
        if self._shard_norms is not None:       # more than one rank
            largest = self._shard_norms.settle()
            finite = math.isfinite(largest)
            if not finite:      # NaN where the average has a NaN, else inf: its norm reads as one process's
                for b, g in zip(self.buckets, self._flat_grads):
                    g[:b.numel].fill_(largest)      # the padding stays zero (it is never zeroed again)
            self._shards_settled(finite)

    def _shards_settled(self, settled: bool) -> None:
        """Whether ``.grad`` now holds the average on this rank's shards only, so that its norms
        are read over the ranks' shards (see ``torch_grads``)."""
        if self._shard_norms is not None:
            self._shard_norms.active = settled

    def _leave_out_unused(self) -> None:
        """Parameters no rank gave a gradient: out of the update about to run (``.grad`` is ``None``
        there, as in one process; the views come back after it)."""
        for i in self._unused.indices:
            self._params[i].grad = None
        for i in self._unused.sent:      # .grad set to None (model.zero_grad), yet the exchange sent some
            self._params[i].grad = self._grad_views[i]

    def _evaluation(self, closure: Any) -> Any:
        """``step(closure)``: the closure as the optimizer calls it.  Each call is a training pass
        (the user's closure zeroes the gradients, runs forward and backward): its gradients are
        averaged before the optimizer reads them and the loss it returns is averaged over ranks, so
        that an optimizer that evaluates the loss again and again (LBFGS, its line search) decides
        alike on every rank, as one process on the whole batch (DDP's ranks take different numbers
        of evaluations and hang)."""
        def evaluate() -> Any:
            with torch.enable_grad():
                loss = closure()
            self._reduce()
            if not self._sharded:
                self._leave_out_unused()
            return average_loss(self.comm, loss)
        return evaluate

    def _check_evaluated(self) -> None:
        if not self._synced:
            raise RuntimeError(f"DistributedOptimizer.step(closure): {type(self._inner).__name__}.step() "
                               "did not call the closure, so it updated with gradients that were not "
                               "averaged: run backward() before step(), or pass no closure")

    def _close_skipped_step(self) -> None:
        """A step whose update was skipped (GradScaler found inf): the strategy's step ends all the same."""
        self._updates[1] = 1
        self._after_update()
        self._end_step()

    # ------------------------------------------------------------------ the Horovod and DDP names
    @torch.compiler.disable
    def synchronize(self) -> None:
        """Make ``.grad`` hold the gradient averaged over ranks now (Horovod's name).

        Gradients are already averaged when ``backward()`` returns; a sharded
        strategy (``DeAR``) then has only its shard (whose norms read as the
        global gradient's, so torch's ``clip_grad_norm_`` needs no more), and
        ``synchronize()`` all-gathers the rest (one extra all-gather, the cost of
        an all-reduce's second half), so that code reading every value of ``.grad``
        sees the global gradient (a read of its values calls it by itself,
        ``torch_grads``).  Collective: call it on every rank.  ``step()``
        then updates from ``.grad`` as modified.

        Example:
            >>> opt.synchronize()
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            >>> with opt.skip_synchronize():
            ...     opt.step()
        """
        self._reduce()
        if self._sharded and not self._gathered and self.comm.size > 1:
            self._gather_shards()
        self._gathered = True

    def _gather_shards(self) -> None:
        """Every rank's averaged shard of the flat gradients to every rank: ``.grad`` is the whole
        average, its reads local."""
        rank = self.comm.rank
        works = [self.comm.iallgather(g[b.shard(rank)], out=g, tag=f"grad.ag{b.index}")
                 for b, g in zip(self.buckets, self._flat_grads)]
        for w in works:
            w.wait()
        self._shards_settled(False)
        self._partial = False

    def _whole_grads(self) -> None:
        """Code reads the values of a sharded ``.grad`` (``torch_grads``): before the step,
        :meth:`synchronize`; after it (a gradient logged after ``step()``), the all-gather alone."""
        if self._synced:
            self.synchronize()
        else:
            self._gather_shards()

    @contextmanager
    def skip_synchronize(self) -> Iterator[Any]:
        """``with opt.skip_synchronize(): opt.step()`` after :meth:`synchronize` (Horovod's spelling):
        ``step()`` never reduces twice, so this only states the intent, for Horovod code unchanged."""
        yield self

    @contextmanager
    def no_sync(self) -> Iterator[Any]:
        """Backward passes inside accumulate into ``.grad`` locally, without communicating (DDP's name).

        The first backward outside (or ``step()``) reduces the sum; scale the
        loss by the number of passes as with DDP.  ``backward_passes_per_step``
        is the other spelling (Horovod's), with the same sum.

        Example:
            >>> with opt.no_sync():
            ...     (loss_fn(model(x1), y1) / 2).backward()
            >>> (loss_fn(model(x2), y2) / 2).backward(); opt.step()
        """
        self._no_sync_depth += 1
        try:
            yield self
        finally:
            self._no_sync_depth -= 1

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes per ``step()`` from the next step on (Horovod's name).

        Their gradients add up: scale the loss by ``1/passes``.  Call it on every rank.

        Example:
            >>> opt.set_backward_passes_per_step(4)
        """
        self.backward_passes_per_step = self._checked_passes(passes)

    @staticmethod
    def _checked_passes(passes: Any) -> int:
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step {passes!r}: expected an int >= 1")
        return passes
