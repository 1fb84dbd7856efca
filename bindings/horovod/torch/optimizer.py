"""Horovod's ``DistributedOptimizer`` over commlib, and the commlib strategies behind ``strategy=``.

Without ``strategy``/``model`` it behaves as Horovod's: a hook per parameter
all-reduces its gradient (named after ``named_parameters``) once it has been
accumulated ``backward_passes_per_step`` times; ``step()`` waits for them
(``synchronize()``) and calls the wrapped optimizer's step.  The returned object is
an instance of a subclass of the wrapped optimizer's class that shares its
``param_groups`` and ``state``.  Gradients go in a fixed order (reverse parameter
order, as they usually become ready), so every rank submits the same sequence; a
gradient that is not ready yet holds the later ones back until it is or until
``synchronize()``, which sends every missing gradient as zeros (Horovod's rule).

``zero_grad()`` zeroes gradients in place by default (``set_to_none=False``): a
parameter gets a gradient at every step anyway (zeros when it had none), so the
update is the same, and ``.grad`` stays a tensor between steps.

With ``strategy=`` (``AllReduce``, ``DeAR``, ``SparseAllReduce(selector=ExDyna(...))``,
``SelSync``, ``SyncSwitch``) or ``model=``, the optimizer is
:class:`commlib.bindings.torch.DistributedOptimizer` (bucketed, overlapped with
backward; ``model=`` is required where the strategy hooks module forwards, DeAR).

Example:
    >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                                named_parameters=model.named_parameters(),
    ...                                compression=hvd.Compression.fp16, backward_passes_per_step=2)
    >>> opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters()), model=model,
    ...                                strategy=DeAR(cap_mb=8))
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from commlib.bindings.torch_comm import average_loss

from . import basics
from .basics import Adasum, Average, global_process_set
from .compression import Compression
from .handles import allreduce_async_, synchronize

__all__ = ["DistributedOptimizer"]


class _Holder(torch.nn.Module):
    """Stands in for a model when a strategy needs none of its module hooks (parameters only)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self.params = torch.nn.ParameterList(params)


class HorovodOptimizerMixin:
    """The Horovod behaviour, mixed into a subclass of the wrapped optimizer's class."""

    param_groups: list[dict[str, Any]]
    _hvd_scheduled: torch.optim.Optimizer | None   # the unwrapped optimizer, where a scheduler patched it

    def _hvd_setup(self, named_parameters: Any, compression: Any, backward_passes_per_step: int, op: int,
                   gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool) -> None:
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v) for i, g in enumerate(self.param_groups)
                                for j, v in enumerate(g["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        seen: set[str] = set()
        dups = sorted({k for k, _ in named_parameters if k in seen or seen.add(k)})
        if dups:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                             f"{', '.join(dups)}")
        all_ids = {id(v) for g in self.param_groups for v in g["params"]}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters were not "
                             f"named. Python object ids: {', '.join(str(i) for i in sorted(unnamed))}")
        if groups is not None and not (isinstance(groups, list) or groups > 0):
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        self._compression = compression
        self._parameter_names = {id(v): k for k, v in named_parameters}
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self._handles: dict[torch.Tensor, tuple[int, Any]] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._order: list[torch.Tensor] = []
        self._delay: dict[torch.Tensor, int] = {}
        self._ready: set[torch.Tensor] = set()
        self._next = 0
        self._hooks = []
        #: parameters frozen so far, watched: one that starts training is all-reduced from then on
        self._frozen: list[torch.Tensor] = []
        self._track([p for g in self.param_groups for p in g["params"]])

    def _track(self, params: list[torch.Tensor]) -> None:
        """All-reduce these parameters' gradients from now on (those that train; the rest are watched)."""
        training = [p for p in params if p.requires_grad]
        self._frozen += [p for p in params if not p.requires_grad]
        self._order += training[::-1]                     # gradients are ready roughly in reverse
        for p in training:
            self._delay[p] = self.backward_passes_per_step
            if basics.size() > 1:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group whose gradients are all-reduced from the next step on (Horovod
        leaves a group added after wrapping local, as it leaves a parameter frozen when wrapped
        and unfrozen later; both are all-reduced here); call it on every rank, outside a step.

        Example:
            >>> opt.add_param_group({"params": model.backbone.parameters(), "lr": 1e-4})
        """
        if self._handles:
            raise AssertionError("optimizer.add_param_group() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize()")
        super().add_param_group(param_group)  # type: ignore[misc]
        gi = len(self.param_groups) - 1
        for j, p in enumerate(self.param_groups[gi]["params"]):
            self._parameter_names.setdefault(id(p), f"allreduce.noname.{gi}.{j}")
        self._track(self.param_groups[gi]["params"])   # after the rest: a backbone's gradients come last

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(_: torch.Tensor) -> None:
            if self._delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                     "before call to step(). Increase backward_passes_per_step to accumulate "
                                     "gradients locally.")
            self._delay[p] -= 1
            if self._delay[p] == 0:
                self._ready.add(p)
                while self._next < len(self._order) and self._order[self._next] in self._ready:
                    self._send(self._order[self._next])
                    self._next += 1
        return hook

    def _send(self, p: torch.Tensor) -> None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            p.grad = p.grad.to_dense()
        tensor, ctx = self._compression.compress(p.grad)
        pre, post = 1.0, 1.0
        if self.op == Average:
            pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        handle = allreduce_async_(tensor, name=self._parameter_names.get(id(p)), op=self.op,
                                  prescale_factor=pre, postscale_factor=post)
        self._handles[p] = (handle, ctx)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before gradients are all-reduced.

        Example:
            >>> opt.set_backward_passes_per_step(4)
        """
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def synchronize(self) -> None:
        """Finish the gradient all-reduces now (every parameter; zeros where no gradient came).

        Example:
            >>> loss.backward(); opt.synchronize()
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            >>> with opt.skip_synchronize(): opt.step()
        """
        if any(p.requires_grad for p in self._frozen):     # unfrozen (on every rank alike): sent now
            frozen, self._frozen = self._frozen, []
            self._track(frozen)
        if basics.size() > 1:
            while self._next < len(self._order):
                self._send(self._order[self._next])
                self._next += 1
            for p, (handle, ctx) in self._handles.items():
                out = self._compression.decompress(synchronize(handle), ctx)
                if out.data_ptr() != p.grad.data_ptr():
                    p.grad.copy_(out)
            self._handles.clear()
            self._ready.clear()
            self._next = 0
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize (call :meth:`synchronize` before).

        Example:
            >>> opt.synchronize()
            >>> with opt.skip_synchronize():
            ...     opt.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize the gradients (unless :meth:`skip_synchronize`), then the wrapped optimizer's step.

        With a ``closure`` the wrapped step evaluates it (LBFGS: several times): each evaluation is
        synchronized before the optimizer reads its gradient, and its loss averaged over ranks,
        so that every rank evaluates alike, as one process (Horovod synchronizes once, before the
        closure ran, and the update reads local gradients).

        Example:
            >>> loss = opt.step(closure)        # closure: zero_grad, forward, backward, return loss
        """
        if self._hvd_scheduled is not None:     # an LR scheduler made on the unwrapped optimizer
            self._hvd_scheduled._opt_called = True   # reads it (else torch warns that it stepped first)
        if closure is not None and self._should_synchronize and basics.size() > 1:
            def evaluate() -> Any:
                with torch.enable_grad():
                    loss = closure()
                self.synchronize()
                return average_loss(basics.world(), loss)
            try:
                return super().step(evaluate)  # type: ignore[misc]
            finally:
                self._synchronized = False
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients (in place by default); not between ``backward()`` and ``step()``.

        Example:
            >>> opt.zero_grad()
        """
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it "
                                 "can cause a race condition.")
        return super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (also resets pending gradient exchanges)."""
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        self._ready.clear()
        self._next = 0
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        groups, state = self.param_groups, self.state
        super().load_state_dict(state_dict)  # type: ignore[misc]
        # still shared with the unwrapped optimizer (torch's load makes new ones): an LR scheduler
        # made on it before wrapping sets the rates this optimizer steps with
        for group, loaded in zip(groups, self.param_groups):
            group.clear()
            group.update(loaded)
        state.clear()
        state.update(self.state)
        self.param_groups, self.state = groups, state


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,  # noqa: N802
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set, *, strategy: Any = None,
                         model: torch.nn.Module | None = None,
                         grad_scaler: Any = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks (Horovod's API).

    ``named_parameters``: ``model.named_parameters()`` (names the all-reduces);
    ``compression``: ``Compression.none`` / ``Compression.fp16``; ``op``: ``Average``
    or ``Sum`` (``Adasum`` is not supported); ``gradient_predivide_factor``: with
    ``Average``, scale by ``1/f`` before the sum and ``f/size`` after;
    ``backward_passes_per_step``: passes accumulated locally per all-reduce;
    ``groups``/``num_groups``: accepted (the engine fuses all-reduces anyway).
    Beyond Horovod: ``strategy=`` a commlib strategy and ``model=`` the module
    (see the module docstring), ``grad_scaler=`` the loop's ``torch.amp.GradScaler`` with them
    (a sparse strategy's state follows its scale: ``commlib.bindings.torch.DistributedOptimizer``).

    Example:
        >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
        ...                                named_parameters=model.named_parameters())
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    """
    if process_set is not global_process_set:
        raise NotImplementedError("commlib.horovod supports only the global process set")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        groups = groups if groups is not None else num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum and basics.size() > 1:
        raise NotImplementedError("commlib.horovod: op=hvd.Adasum is not supported (use hvd.Average)")
    if strategy is not None or model is not None:
        return _strategy_optimizer(optimizer, named_parameters, compression, op, gradient_predivide_factor,
                                   backward_passes_per_step, strategy, model, grad_scaler)
    if grad_scaler is not None:
        raise ValueError("grad_scaler= goes with strategy= or model= (Horovod's own path keeps no state "
                         "in the gradients' units)")
    cls = type(type(optimizer).__name__, (HorovodOptimizerMixin, type(optimizer)), {"__module__": __name__})
    wrapped = object.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)      # shares param_groups and state with `optimizer`
    # an instance attribute over a method is bound to `optimizer` (an LR scheduler made before
    # wrapping patches `optimizer.step`): the wrapper's methods are its class's
    patched = [k for k, v in vars(wrapped).items() if callable(v) and callable(getattr(cls, k, None))]
    for name in patched:
        del wrapped.__dict__[name]
    wrapped._hvd_scheduled = optimizer if "step" in patched else None
    if hasattr(wrapped, "_patch_step_function"):
        wrapped._patch_step_function()
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                       groups, sparse_as_dense)
    return wrapped


def _strategy_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Any, compression: Any, op: int,
                        gradient_predivide_factor: float, backward_passes_per_step: int, strategy: Any,
                        model: torch.nn.Module | None, grad_scaler: Any) -> torch.optim.Optimizer:
    from commlib.bindings.torch import DistributedOptimizer as StrategyOptimizer
    from commlib.collectives import Strategy

    if compression is not Compression.none or op != Average or gradient_predivide_factor != 1.0:
        raise ValueError("with strategy= or model=, gradients are averaged by the strategy: "
                         "compression, op and gradient_predivide_factor must keep their defaults")
    if model is None:
        if strategy is not None and type(strategy).before_forward is not Strategy.before_forward:
            raise ValueError(f"strategy {type(strategy).__name__} waits for buckets before module forwards: "
                             "pass model=")
        model = _Holder([p for g in optimizer.param_groups for p in g["params"]])
    return StrategyOptimizer(optimizer, model, strategy, basics.world(),
                             backward_passes_per_step=backward_passes_per_step, broadcast=False,
                             grad_scaler=grad_scaler)
