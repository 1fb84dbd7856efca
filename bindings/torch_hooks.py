"""The hooks :class:`bindings.torch.DistributedOptimizer` leaves on the user's model.

A :class:`ModelHook` does nothing in a copy of the model (``copy.deepcopy``,
``torch.save(model)``): the copy is a model of its own, which the optimizer
does not train.  :func:`guard_module_hooks_under_compile` makes
``torch.compile`` recompile when hooks come or go.

Example:
    >>> handle = model.register_forward_pre_hook(ModelHook(fn, before_copy))
    >>> twin = copy.deepcopy(model)      # before_copy(memo) runs; twin's hook is an InertHook
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch._dynamo

__all__ = ["ModelHook", "InertHook", "guard_module_hooks_under_compile", "remove_inert_twins"]


def guard_module_hooks_under_compile() -> None:
    """Make ``torch.compile`` notice module hooks, once per process.

    By default Dynamo does not guard on module hooks
    (``torch._dynamo.config.skip_nnmodule_hook_guards``): code compiled for a
    model without them (the same class, compiled before wrapping, or a frozen
    teacher) runs a wrapped model without DeAR's waits or the re-plan check,
    and trains it wrong.  With the guards, a change of hooks recompiles; what
    was compiled before, without them, is discarded (``torch.compiler.reset()``).
    Measured cost: ~0.3 us per module per compiled call."""
    config = torch._dynamo.config
    if config.skip_nnmodule_hook_guards:
        config.skip_nnmodule_hook_guards = False
        torch.compiler.reset()


class ModelHook:
    """A hook that :class:`TrainingLoop` installs on the user's model; a copy of the model does not
    keep it.

    ``copy.deepcopy(model)`` (``torch.optim.swa_utils.AveragedModel``, an EMA model) and
    ``torch.save(model)`` give a model of its own, which this optimizer does not train: in the
    copy the hook does nothing.  Making the copy first completes the communication in flight
    (DeAR's all-gathers), so the copy's parameters are current.

    Example:
        >>> swa = torch.optim.swa_utils.AveragedModel(model)     # after wrapping, any step
    """

    __slots__ = ("fn", "before_copy", "copies", "home")

    def __init__(self, fn: Any, before_copy: Any, copies: list | None = None):
        self.fn, self.before_copy, self.copies = fn, before_copy, copies
        self.home: tuple[Any, int] | None = None

    def register_on(self, module: torch.nn.Module, after: bool = False) -> Any:
        """Register as ``module``'s forward pre-hook (``after``: its forward hook; its handle): a deep
        copy of the module then notes in ``copies`` where its inert twin sits, for
        :func:`remove_inert_twins`."""
        handle = module.register_forward_hook(self) if after else module.register_forward_pre_hook(self)
        self.home = (handle.hooks_dict_ref, handle.id)
        return handle

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    @property
    def __name__(self) -> str:
        """What ``torch.jit.script`` asks of each hook before it compiles it (Python code such as this
        cannot be compiled): an error saying what to do instead."""
        raise AttributeError("torch.jit.script cannot compile the hooks a DistributedOptimizer keeps on "
                             "the model it trains: call opt.close() when training ends (the model is plain "
                             "again), or export with torch.export or torch.jit.trace")

    def __deepcopy__(self, memo: dict) -> "InertHook":
        self.before_copy(memo)
        if self.home is not None and self.copies is not None:
            twin = memo.get(id(self.home[0]()))     # the copy's hook dict, made before its entries
            if twin is not None:
                self.copies.append((weakref.ref(twin), self.home[1]))
        return InertHook()

    def __reduce__(self) -> tuple:
        self.before_copy(None)
        return (InertHook, ())


class InertHook:
    """What a :class:`ModelHook` becomes in a copy of the model: nothing."""

    __slots__ = ()

    def __call__(self, *args: Any) -> None:
        return None

    @property
    def __name__(self) -> str:
        """As :attr:`ModelHook.__name__`."""
        raise AttributeError("torch.jit.script cannot compile the inert hook that a copy of a model trained "
                             "by a DistributedOptimizer keeps: call opt.close() when training ends (it takes "
                             "them off the copies too), or export with torch.export or torch.jit.trace")


def remove_inert_twins(copies: list[tuple[Any, int]]) -> None:
    """Take the inert forward pre-hooks that deep copies of a model keep (noted by
    :meth:`ModelHook.register_on`) off those copies, so that they are plain modules too.

    Example (what ``DistributedOptimizer.close()`` does for an EMA made during training):
        >>> remove_inert_twins(opt._copies)        # then torch.jit.script(ema.module) compiles
    """
    for ref, key in copies:
        hooks = ref()
        if hooks is not None and isinstance(hooks.get(key), InertHook):
            del hooks[key]
    copies.clear()
