"""PyTorch adapter: ``DistributedOptimizer`` drives a commlib strategy from autograd and module hooks.

The wrapper Horovod users know (``DistributedOptimizer``,
``broadcast_parameters``, ``broadcast_optimizer_state``,
``backward_passes_per_step``) over commlib's strategies::

    import torch, commlib
    from commlib.bindings.torch import DistributedOptimizer
    from commlib.collectives import DeAR

    comm = commlib.init()                                   # under mpiexec -n N
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, strategy=DeAR())
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    for x, y in loader:                                     # each rank: its own shard of the data
        opt.zero_grad()
        loss_fn(model(x), y).backward()                     # averaged when backward returns
        opt.clip_grad_norm_(1.0)                            # by the global norm, any strategy
        opt.step()                                          # updates, starts DeAR's all-gathers
        sched.step()
    model.eval()                                            # evaluation and model.state_dict()
    evaluate(model)                                         # see the last update (no flush needed)

The training-loop surface (``synchronize``, ``skip_synchronize``, ``no_sync``, ``clip_grad_norm_``,
GradScaler, checkpoints, unused parameters) is documented in :mod:`bindings.torch_loop`; ``SyncBatchNorm``
(batch statistics over every rank's batch) in :mod:`bindings.torch_norm`; uneven inputs (``join``) in
:mod:`bindings.torch_join`.

Sharp bits: parameters and gradients become views of the strategy's fused
buckets (as DDP's ``gradient_as_bucket_view``, each in its own layout:
channels_last stays so), so ``zero_grad`` zeroes the buckets instead of
setting ``.grad`` to ``None``; a model moved or converted after wrapping
(``model.to()``, ``.double()``) re-plans at the next training forward.
With ``DeAR`` a parameter whose all-gather is in flight waits for it when
first used, wherever (an EMA, weight clipping: ``torch_params``).  Gradients
are averaged over ranks; the ``backward_passes_per_step`` passes add up
(scale the loss).  Optimizers must be
elementwise for sharded strategies (``DeAR``): SGD (momentum, Nesterov),
Adam, AdamW, RMSprop, Adagrad... (tried when wrapping: LAMB, Adafactor, Muon
are refused).  With ``DeAR``, ``.grad`` after backward holds the averaged
gradient on this rank's shard only; its full norms read as the global gradient's
(torch's ``clip_grad_norm_`` and ``get_total_norm`` clip and log as one process:
``torch_grads``), and other reads of its values gather the whole average first
(one extra all-gather, on every rank).
"""

from __future__ import annotations

import time
from typing import Any

import torch

import commlib
from commlib.collectives import AllReduce, Move, Strategy, TensorSpec, checked_strategy, plan_buckets

from .torch_amp import LossScale
from .torch_comm import (
    agree_tensors,
    broadcast_optimizer_state,
    broadcast_parameters,
    dtype_name,
    in_layout,
    is_dense,
    layout,
    register_comm_hook,
)
from .torch_grads import GradientClipping, ShardedGrad, ShardNorms
from .torch_join import Joining
from .torch_loop import TrainingLoop
from .torch_norm import RunningStats, SyncBatchNorm
from .torch_params import InFlight
from .torch_phases import PhaseSwitches, momentum_problem
from .torch_replicas import ReplicaLoads
from .torch_state import ConsolidatedState, shard_problem
from .torch_state_average import AveragedState
from .torch_unused import OutsideParameters

__all__ = ["DistributedOptimizer", "SyncBatchNorm", "broadcast_parameters", "broadcast_optimizer_state",
           "register_comm_hook"]


class _Flush:
    """Returned by :meth:`DistributedOptimizer.flush`: already flushed; usable in ``with``."""

    def __init__(self, opt: "DistributedOptimizer"):
        self.opt = opt

    def __enter__(self) -> "DistributedOptimizer":
        return self.opt

    def __exit__(self, *exc: Any) -> None:
        return None


class DistributedOptimizer(TrainingLoop, Joining, GradientClipping, ConsolidatedState, AveragedState,
                           PhaseSwitches, ReplicaLoads, torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` trains ``model`` data-parallel over ``comm``.

    ``strategy``: a :class:`collectives.Strategy` (default :class:`collectives.AllReduce`).
    ``backward_passes_per_step``: backward passes accumulated locally (no
    communication) per ``step()``; their gradients add up, as in Horovod and
    in one process (scale the loss by ``1/k``; ``no_sync()`` is the other way
    to accumulate).
    Parameters that no rank gave a gradient in a step (an unused head, an expert no token was
    routed to) are left out of that step's update, as a single process leaves them (one small
    all-reduce per step agrees on them; on the local steps of SelSync and Sync-Switch's ASP, each
    rank's own); those of ``model`` outside ``optimizer`` get the averaged gradient (DDP's rule).
    ``find_unused_parameters``: say that you expect some; otherwise, where the
    first step finds some, it warns, naming them.
    ``broadcast``: start from rank 0's parameters (default ``True``).
    ``broadcast_buffers``: after each step every rank gets rank 0's running
    statistics of plain norm layers (``True``, the default), every buffer
    (``"all"``, DDP's rule) or none (``False``, Horovod's); see
    :class:`bindings.torch_norm.RunningStats` (not with SelSync or SyncSwitch,
    whose replicas drift between synchronizations).
    ``grad_scaler``: the loop's ``torch.amp.GradScaler``, where the strategy keeps state in the
    gradients' units across steps (sparse residuals and thresholds, SelSync's norm average): read at
    each step's first backward, a changed scale rescales that state (:mod:`bindings.torch_amp`);
    under SyncSwitch, whose ASP and SSP phases let each rank's scaler run alone, the ranks' scalers
    take one scale and growth count again at the first backward back in BSP.

    The wrapper is a ``torch.optim.Optimizer`` sharing ``optimizer.param_groups``,
    so LR schedulers work on either.  ``state_dict()`` is the consolidated
    state in ``optimizer``'s own format (identical on all ranks, loadable by a
    plain optimizer); ``load_state_dict`` accepts it on any number of ranks.  ``close()`` ends
    training: the model and its parameters are left without hooks (``torch.jit.script`` compiles it).

    Example:
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        ...                            model, strategy=DeAR(cap_mb=8), backward_passes_per_step=2)
        >>> for x, y in loader:
        ...     for xs, ys in zip(x.chunk(2), y.chunk(2)):
        ...         (loss_fn(model(xs), ys) / 2).backward()
        ...     opt.step(); opt.zero_grad()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 strategy: Strategy | None = None, comm: commlib.Communicator | None = None, *,
                 backward_passes_per_step: int = 1, find_unused_parameters: bool = False,
                 broadcast: bool = True, broadcast_buffers: bool | str = True,
                 grad_scaler: torch.amp.GradScaler | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer")
        self._checked_passes(backward_passes_per_step)
        self._loss_scale = LossScale(grad_scaler)
        self.comm = commlib.as_communicator(comm, "DistributedOptimizer")
        self.strategy = (AllReduce() if strategy is None
                         else checked_strategy(strategy, "DistributedOptimizer"))
        # replicas that drift between synchronizations (SelSync, Sync-Switch) keep their buffers too:
        # a broadcast at every step would hold ASP's ranks in step
        self._running_stats = RunningStats(model, self.comm, broadcast_buffers,
                                           lockstep=not self.strategy.updates_parameters)
        self.model = model
        self.backward_passes_per_step = backward_passes_per_step
        self.find_unused_parameters = find_unused_parameters
        self._inner = optimizer
        self._init_loads(broadcast)     # before the state is sharded: whether the optimizer holds state
        self._wrapped = False       # Optimizer.__init__ below adds its groups through add_param_group
        super().__init__([p for g in optimizer.param_groups for p in g["params"]], optimizer.defaults)
        self.param_groups = optimizer.param_groups     # one truth: schedulers may hold either object

        self._collect_params()
        self._retired_by = ""
        self._retire_older_owners()
        self._hooks: list[Any] = []
        self._copies: list[tuple[Any, int]] = []      # where copies of the model keep inert hooks
        self.strategy.on_switch(self._on_switch)
        self._build(self.strategy.cap_bytes, broadcast=broadcast)
        if broadcast:      # the rest of the module state (buffers, frozen parameters), as DDP does
            trained = {id(p) for p in self._params}
            rest = [p for p in model.parameters() if id(p) not in trained] + list(model.buffers())
            broadcast_parameters(rest, 0, self.comm)
        self._install_hooks()
        self._init_join()
        self._init_loop()
        self._last_step: float | None = None
        self._wrapped = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer and re-plan the buckets over it
        (a collective: the same call on every rank, before a forward, not between
        ``backward()`` and ``step()``).

        Its parameters are averaged from the next step on, as a backbone unfrozen
        for fine-tuning at its own rate must be; a group that does not match on
        every rank raises on every rank and is not added.

        Example:
            >>> model.backbone.requires_grad_(True)
            >>> opt.add_param_group({"params": model.backbone.parameters(), "lr": 1e-4})
        """
        if not self._wrapped:
            super().add_param_group(param_group)
            return
        self._end_skipped_step()       # with grad_scaler=: a step GradScaler skipped ends here
        if any(self._got) and not self._synced:
            raise RuntimeError("DistributedOptimizer.add_param_group: gradients of this step are already "
                               "being averaged; add the group before the forward, after step()")
        if self._synced:
            raise RuntimeError("DistributedOptimizer.add_param_group: this step's gradients are averaged "
                               "and its step() has not run (a step GradScaler skipped: pass grad_scaler= "
                               "when wrapping, and it ends here); add the group after step() or "
                               "opt.zero_grad(), before the forward")
        self._inner.add_param_group(param_group)
        try:
            self.replan()
        except BaseException:
            self._inner.param_groups.pop()
            raise

    # ------------------------------------------------------------------ buckets and views
    def _collect_params(self) -> None:
        """The parameters that train (``requires_grad``), in optimizer order, the group of each and
        their gradient-ready order; every rank learns of every rank's problem, or a difference,
        before anything else runs (one small all-gather), and nothing changes where one is found."""
        params: list[torch.nn.Parameter] = []
        group_of: list[int] = []
        frozen: list[torch.nn.Parameter] = []
        problems = []
        lazy = 0
        for gi, g in enumerate(self._inner.param_groups):
            for p in g["params"]:
                if torch.nn.parameter.is_lazy(p):
                    lazy += 1
                    continue
                if not p.requires_grad:
                    frozen.append(p)
                    continue
                if any(p is q for q in params):
                    problems.append("a parameter appears twice in the optimizer")
                if p.is_sparse or not is_dense(p):
                    problems.append(f"parameter {tuple(p.shape)} is sparse or has gaps or overlaps "
                                    f"(strides {p.stride()}): use .contiguous()")
                params.append(p)
                group_of.append(gi)
        if lazy:
            problems.append(f"{lazy} parameters are uninitialized (a Lazy module): run one forward with a "
                            "dummy batch before wrapping")
        if not params and not lazy:
            problems.append("the optimizer has no parameter that requires a gradient")
        if isinstance(self._inner, torch.optim.SparseAdam):
            problems.append("SparseAdam needs sparse gradients, but they are averaged in dense buckets "
                            "(as Horovod's sparse_as_dense): use Adam or AdamW")
        if self.strategy.updates_parameters and isinstance(self._inner, torch.optim.LBFGS):
            problems.append(f"LBFGS evaluates the loss again and again within a step, each evaluation "
                            f"averaged on every rank, but {self.strategy.name} lets the replicas drift "
                            "between synchronizations (their line searches would part): use AllReduce")
        momentum = momentum_problem(self.strategy, self._inner)
        if momentum:
            problems.append(momentum)
        if self.strategy.needs_shard_grads and not self._wrapped:
            problem = shard_problem(self._inner)
            if problem:
                problems.append(f"{self.strategy.name} updates flat shards of the buckets: {problem}; use "
                                "AllReduce, or an elementwise optimizer")
        agree_tensors(self.comm, "DistributedOptimizer", params,
                      f"groups {group_of}|strategy {self.strategy!r}|backward_passes_per_step="
                      f"{self.backward_passes_per_step}|find_unused_parameters={self.find_unused_parameters}|"
                      f"broadcast_buffers={self._running_stats.which}",
                      "; ".join(problems) or None, strides=True)
        self._params, self._group_of = params, group_of
        self._outside = OutsideParameters(self.comm, self.model,      # their gradients averaged too, as DDP's
                                          {id(p) for g in self._inner.param_groups for p in g["params"]})
        #: the optimizer's parameters that do not train now (watched for requires_grad changes)
        self._frozen = frozen
        # gradients become ready in reverse order of the model's parameters (as DDP assumes)
        model_ids = {id(p): i for i, p in enumerate(self.model.parameters())}
        self._ready_order = sorted(range(len(params)), key=lambda i: -model_ids.get(id(params[i]), -1 - i))

    def _build(self, cap_bytes: int, broadcast: bool) -> None:
        s = self.strategy
        self._planned_cap = cap_bytes
        specs = [TensorSpec(i, self._params[i].numel(), dtype_name(self._params[i]),
                            self._params[i].element_size(), str(self._params[i].device), self._group_of[i])
                 for i in self._ready_order]
        self.buckets = plan_buckets(specs, self.comm.size, cap_bytes, s.first_cap_bytes, s.last_cap_bytes)
        self._bucket_of = [-1] * len(self._params)     # -1: a parameter of no element (in no bucket)
        self._flat_params, self._flat_grads, self._shard_grads = [], [], []
        self._grad_views: list[torch.Tensor] = [None] * len(self._params)   # type: ignore[list-item]
        for b in self.buckets:
            p0 = self._params[b.slots[0].index]
            fp = torch.zeros(b.padded, dtype=p0.dtype, device=p0.device)
            fg = torch.zeros(b.padded, dtype=p0.dtype, device=p0.device)
            for sl in b.slots:
                p = self._params[sl.index]
                self._bucket_of[sl.index] = b.index
                data = in_layout(fp, sl.offset, layout(p))      # p's own (channels_last stays so)
                data.copy_(p.detach())
                p.data = data
                if p.grad is not None:      # .grad becomes a view of fg below (_make_update_side)
                    in_layout(fg, sl.offset, layout(p)).copy_(p.grad)
            self._flat_params.append(fp)
            self._flat_grads.append(fg)
            if s.needs_shard_grads:
                self._shard_grads.append(torch.zeros(b.shard_numel, dtype=p0.dtype, device=p0.device))
        self._in_flight = InFlight([[self._params[sl.index] for sl in b.slots] for b in self.buckets],
                                   s.before_forward)
        #: where each parameter's data lives: a view of its bucket (moved or converted: re-planned),
        #: laid out as the parameter was (a conversion may change the parameter's layout)
        self._data_ptrs = [p.data_ptr() for p in self._params]
        self._layouts = [layout(p) for p in self._params]
        self._bucket_need = [len(b.slots) for b in self.buckets]
        self._signaled = [False] * len(self.buckets)
        self._sharded = None        # a switch in the strategy's setup leaves the update's side to below
        s.setup(self.comm, self.buckets, self._flat_params, self._flat_grads,
                self._shard_grads if s.needs_shard_grads else None, broadcast=broadcast)
        self._make_update_side(s.sharded)
        self._note_grad_versions()

    def _make_update_side(self, sharded: bool) -> None:
        """``.grad``'s views of the buckets and what the update runs on: sharded, the shard optimizer
        over this rank's pieces (the state the wrapped optimizer holds whole goes to them) and views
        whose norms read the global gradient's, since ``.grad`` is then averaged on this rank's shard
        only; else the wrapped optimizer over the whole parameters and plain views."""
        self._sharded = sharded
        norms = (ShardNorms(self.comm, len(self._params), [], self._flat_grads, self._whole_grads)
                 if sharded and self.comm.size > 1 else None)
        for b in self.buckets:
            for sl in b.slots:
                view = in_layout(self._flat_grads[b.index], sl.offset, self._layouts[sl.index])
                if norms is not None:
                    view = ShardedGrad.of(view, norms, sl.index)
                self._params[sl.index].grad = self._grad_views[sl.index] = view
            if norms is not None:
                fg = self._flat_grads[b.index]
                norms.parts += [(idx, fg[bslice]) for idx, _, bslice in b.pieces(self.comm.rank)]
        for i, b in enumerate(self._bucket_of):
            if b < 0:       # no element: nothing to average, a .grad of its own
                self._params[i].grad = self._grad_views[i] = torch.zeros_like(self._params[i])
        self._shard_norms = norms
        if sharded:
            self._build_shard_optimizer()

    def _install_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for i, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(i)))
            if self._sharded and self.strategy.reopens:
                self._hooks.append(p.register_hook(self._make_pre_accumulate_hook(i)))
        if type(self.strategy).before_forward is not Strategy.before_forward:
            index = {id(p): i for i, p in enumerate(self._params)}
            for m in self.model.modules():
                bs = sorted({self._bucket_of[index[id(p)]] for p in m.parameters(recurse=False)
                             if id(p) in index} - {-1})
                if bs:
                    self._hooks.append(self._hook(self._make_forward_hook(bs)).register_on(m))

    def _make_grad_hook(self, i: int) -> Any:
        @torch.compiler.disable     # called by autograd inside a compiled train step too: never traced
        def hook(p: torch.Tensor) -> None:
            # autograd runs this hook also where the pass gave the parameter no gradient (a
            # backward that returned None for it): then nothing was accumulated, and one
            # process's .grad is as it was (None after model.zero_grad()), not a zero gradient
            view, grad, b = self._grad_views[i], p.grad, self._bucket_of[i]
            if grad is None:
                return
            fresh = grad is not view
            if fresh:
                # .grad was set to None (model.zero_grad) and autograd made a new tensor
                view.copy_(grad)
                p.grad = view
            if b >= 0:
                version = self._flat_grads[b]._version      # an accumulation into a view moves it
                if version == self._seen_versions[b] and not fresh:
                    return
                self._seen_versions[b] = version
            if not self._gradient_arrived(i, fresh):
                return
            self._counts[i] += 1
            if self._counts[i] == self.backward_passes_per_step and b >= 0:
                self._bucket_need[b] -= 1
                if self._bucket_need[b] == 0:
                    self._signal(b)
        return hook

    def _make_forward_hook(self, bs: list[int]) -> Any:
        installed = self._hooks

        @torch.compiler.disable     # waits on communication: never traced (see _before_forward)
        def hook(module: torch.nn.Module, args: Any) -> None:
            if installed is not self._hooks:    # removed by a replan during this forward's hooks
                return
            self._in_flight.before_module(id(module), bs)
        return hook

    def _signal(self, b: int) -> None:
        if self._signaled[b]:
            return
        self._signaled[b] = True
        self._to_common_scale(b)
        self.strategy.bucket_ready(b)

    # ------------------------------------------------------------------ the step
    @property
    def plan(self) -> list[dict]:
        """The fusion plan: one dict per bucket (tensors, elements, bytes, dtype, group)."""
        return [b.describe() for b in self.buckets]

    @torch.compiler.disable     # the entry points communicate or touch the buckets: run eagerly
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buckets (``.grad`` stays a view of its bucket).  With ``set_to_none``,
        a parameter that then gets no gradient on any rank is left out of the update (one process's
        ``.grad`` is ``None``); without, it is updated with a zero gradient, as in one process (one
        frozen since too: see :meth:`replan`)."""
        self._end_interrupted_pass()
        if self._synced:         # GradScaler skipped the last step(): close it
            self._close_skipped_step()
        if set_to_none:          # one process's .grad would be None until a gradient arrives
            self._unused.zeroed()
        self._zero_to_none = set_to_none
        for g in self._flat_grads:
            g.zero_()
        for p in self._frozen:   # those frozen since (see replan): as one process zeroes them
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self._note_grad_versions()
        self._shards_settled(False)
        self._partial = False
        with torch._C.DisableTorchFunctionSubclass():     # parameters DeAR still gathers: .grad only
            for i, p in enumerate(self._params):
                if p.grad is not self._grad_views[i]:
                    p.grad = self._grad_views[i]

    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Wait for the gradients, update, and start what overlaps the next forward.

        ``closure`` (zero the gradients, forward, backward, return the loss): each call is a pass
        averaged before the optimizer reads it, its loss averaged over ranks (returned), so that
        LBFGS evaluates alike on every rank (see :meth:`_evaluation`).

        Example:
            >>> loss = opt.step(closure)        # torch.optim.LBFGS: several evaluations, one step
        """
        if self._retired_by:
            raise RuntimeError(f"DistributedOptimizer: {self._retired_by}")
        if closure is not None and self._join is not None:
            raise ValueError("DistributedOptimizer.step(closure) inside join(): the closure's losses would "
                             "average the repeated batches in; step without a closure")
        self._end_interrupted_pass()
        self._check_replicas()      # after a load: the same error on every rank if the replicas differ
        loss = None
        evaluate = None if closure is None else self._evaluation(closure)
        if evaluate is not None and self._sharded:     # elementwise optimizers: evaluated once, first
            loss = evaluate()
        args, kwargs = self._pre_step_hooks(None if self._sharded else evaluate)
        if self._sharded:
            self._reduce()          # done when backward returned, unless passes are missing
            self._adopt_assigned()
            with self._scaled_hyperparameters():
                self._update_shards()
            self._partial = not self._gathered and self.comm.size > 1     # see _before_accumulate
        else:
            if evaluate is None:
                self._reduce()
                self._leave_out_unused()
            with self._scaled_hyperparameters():
                loss = self._inner_step(args, kwargs)   # a closure: evaluated (LBFGS: again and again)
                if evaluate is not None:
                    self._check_evaluated()
            for i in self._unused.indices:
                self._params[i].grad = self._grad_views[i]
        self._running_stats.sync(self._stats_root())     # before DeAR's all-gathers: none in flight
        self._updates[0] = 1
        self._after_update()
        self._post_step_hooks(args, kwargs)
        self._end_step()
        now = time.perf_counter()
        tuner = self.strategy.tuner
        if tuner is not None and not tuner.done:      # whole iterations, step to step
            new_cap = tuner.observe(None if self._last_step is None else now - self._last_step)
            if new_cap is not None:
                self.replan(new_cap)
                now = time.perf_counter()
        self._last_step = now
        return loss

    def replan(self, cap_bytes: int | None = None) -> None:
        """Rebuild the buckets, with a new cap if given, over the parameters that train now
        (a collective: the same call on every rank).

        Parameters keep their values and the optimizer its state (re-sharded for sharded
        strategies).  The first training forward after a change of ``requires_grad`` calls it
        (gradual unfreezing): a parameter that starts training is averaged from then on, and one
        that stops is left out of the update (its ``.grad`` is ``None``, as after ``zero_grad()``
        in one process; its optimizer state stays, as in one process).  After
        ``zero_grad(set_to_none=False)`` it keeps a ``.grad`` of its own, zeroed by each such call,
        and the update goes on moving it by momentum and weight decay, as one process's does.

        Example:
            >>> model.backbone.requires_grad_(True)     # the next forward re-plans on every rank
            >>> opt.replan(64 << 20)                    # or by hand, with a 64 MiB cap
        """
        self._flush()
        if self._partial:       # .grad whole before it is copied into the new buckets' shards
            self._gather_shards()
        before = self._params
        for b in self.buckets:      # moved or converted: .grad left its bucket, which zero_grad() zeroes
            for sl in b.slots:
                p = before[sl.index]
                if p.grad is not None and p.data_ptr() != self._data_ptrs[sl.index]:
                    flat = in_layout(self._flat_grads[b.index], sl.offset, self._layouts[sl.index])
                    p.grad = flat.to(p.device, p.dtype)
        kept = self._states_by_param()
        self._collect_params()      # raises on every rank, changing nothing, if none trains now
        for p in before:            # stopped training: .grad as one process's, out of the buckets: a
            if not p.requires_grad:     # tensor kept by zero_grad(set_to_none=False) where a gradient came
                keep = not self._zero_to_none and p.grad is not None and self._unused.had_gradient(p)
                p.grad = p.grad.detach().clone() if keep else None     # since the last None, else None
        if cap_bytes is not None:
            self.strategy.cap_bytes = int(cap_bytes)
        placed = {id(before[sl.index]): (b.index, sl.offset) for b in self.buckets for sl in b.slots}
        self._build(self.strategy.cap_bytes, broadcast=False)
        self.strategy.replanned([Move(*placed[id(self._params[sl.index])], b.index, sl.offset, sl.numel)
                                 for b in self.buckets for sl in b.slots
                                 if id(self._params[sl.index]) in placed])
        self._restore_states(kept, before)
        self._install_hooks()
        if [id(p) for p in self._params] != [id(p) for p in before]:
            self._unused.replanned()
            self._end_step()

    @torch.compiler.disable
    def flush(self) -> _Flush:
        """Make parameters current on every rank now (evaluation, checkpoint, end of training).

        Also a context manager: ``with opt.flush(): evaluate(model)``.
        """
        self._flush()
        return _Flush(self)

    def __repr__(self) -> str:
        inner = type(self._inner).__name__
        return f"DistributedOptimizer({inner}, {self.strategy!r}, buckets={len(self.buckets)})"

    def __getstate__(self) -> dict[str, Any]:
        """Refused: ``torch.save(opt)`` and ``copy.deepcopy(opt)`` gave back an object without its
        communicator, buckets or hooks (torch's optimizer pickles only its state, which DeAR keeps
        in pieces: the moments were lost). Save ``opt.state_dict()`` and load it into a new one."""
        raise TypeError("DistributedOptimizer is not pickled or copied (it holds a communicator, the "
                        "model's hooks and buckets): save opt.state_dict() (on every rank: a collective "
                        "under DeAR) and load it into a new DistributedOptimizer")
