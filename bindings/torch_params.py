"""Parameters that communication in flight still writes read as current, wherever they are read.

After a DeAR step each bucket's parameters are all-gathered while the next
forward runs, and a module waits for its own bucket before it runs (SelSync's
parameter averages likewise).  Code that touches a parameter between the step
and its module's forward (an EMA, ``AveragedModel.update_parameters(model)``,
WGAN's ``p.data.clamp_(-c, c)``, logging a weight, a module that reads a child's
weight without running the child, as ``nn.MultiheadAttention`` reads its
``out_proj``) would read a half-gathered parameter, and one that writes it
would race with the gather.  :class:`InFlight` marks the parameters while their
writes are in flight: a marked parameter's class is a subclass of its own
(``isinstance(p, nn.Parameter)`` holds) whose ``__torch_function__`` waits for
the parameter's bucket before any operation that reads or writes its values,
then lets the operation run on the plain parameter.  Reading its metadata
(shape, dtype, ``requires_grad``, ``.grad``, hashing) waits for nothing.  A
module's forward hook unmarks its bucket's parameters after waiting for them,
so forwards run on plain parameters: marking and unmarking costs about 70 ns
a parameter a step; a metadata read of a marked parameter about 0.9 us.

Example:
    >>> opt.step()                                  # DeAR: all-gathers in flight
    >>> with torch.no_grad():
    ...     for e, p in zip(ema.parameters(), model.parameters()):
    ...         e.lerp_(p, 0.001)                   # waits for p's bucket: the updated value
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["InFlight", "InFlightParameter", "METADATA"]

_T = torch.Tensor
#: the operations on a tensor that read none of its values (shape, dtype, ``.grad``, hashing...): they
#: run at once on a marked parameter, and on a sharded gradient (``torch_grads``)
METADATA = frozenset(
    [getattr(_T, name).__get__ for name in (
        "shape", "dtype", "device", "layout", "requires_grad", "grad", "grad_fn", "is_leaf", "ndim",
        "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "_version",
        "itemsize", "nbytes", "output_nr", "_base", "is_mkldnn")]
    + [_T.requires_grad.__set__, _T.grad.__set__, _T.grad.__delete__]
    + [getattr(_T, name) for name in (
        "size", "dim", "numel", "nelement", "stride", "is_contiguous", "data_ptr", "element_size",
        "storage_offset", "get_device", "is_floating_point", "is_complex", "requires_grad_",
        "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "__hash__", "__len__")])


#: runs ``func`` with subclasses' ``__torch_function__`` off (as ``nn.Parameter`` does)
_AS_PLAIN = torch._C._disabled_torch_function_impl


class InFlightParameter(torch.nn.Parameter):
    """The class of a parameter while communication in flight (its bucket's all-gather) writes it.

    Each :class:`InFlight` makes one subclass per bucket and parameter class, so that the
    class says whose bucket to wait for.  Any operation on the parameter's values waits for that
    bucket and gives the parameter its own class back first.

    Example:
        >>> opt.step()                            # DeAR
        >>> isinstance(model.fc.weight, InFlightParameter)
        True
        >>> model.fc.weight.sum()                 # waits for fc.weight's bucket
    """

    _flight: weakref.ref
    _bucket: int
    _base: type

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in METADATA:     # (a getter's method-wrapper refuses even an empty kwargs dict)
            return _AS_PLAIN(func, types, args, kwargs) if kwargs else _AS_PLAIN(func, types, args)
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, InFlightParameter):
                type(t)._land(t)
        return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> torch.nn.Parameter:
        """The copy of the current value, of the parameter's own class (``Parameter.__deepcopy__``
        would make one of this class)."""
        type(self)._land(self)
        return self.__deepcopy__(memo)

    @classmethod
    def _land(cls, p: torch.Tensor) -> None:
        flight = cls._flight()
        if flight is not None:
            flight.land(cls._bucket)
        if type(p) is cls:          # its optimizer is gone, or planned its buckets anew
            p.__class__ = cls._base


def _markable(cls: type) -> bool:
    """A parameter class whose operations torch runs itself (not a tensor subclass of its own)."""
    plain = torch.nn.Parameter.__torch_function__
    return issubclass(cls, torch.nn.Parameter) and cls.__torch_function__ is plain


class InFlight:
    """The parameters of each bucket, marked while communication in flight writes them.

    ``buckets[b]``: bucket ``b``'s parameters; ``wait(b)``: wait for everything in flight that
    writes bucket ``b`` (the strategy's ``before_forward``).  :meth:`mark` after a step that
    left writes in flight; :meth:`landed` / :meth:`landed_all` once they are waited for.

    Example:
        >>> flight = InFlight([[w1, b1], [w2, b2]], strategy.before_forward)
        >>> strategy.after_update(); flight.mark()
        >>> strategy.before_forward(0); flight.landed(0)    # a module's forward hook
    """

    def __init__(self, buckets: Sequence[Sequence[torch.Tensor]], wait: Callable[[int], None]):
        self._wait = wait
        me = weakref.ref(self)
        classes: dict[tuple[int, type], type] = {}

        def marked(b: int, base: type) -> type:
            key = (b, base)
            if key not in classes:
                classes[key] = type(base.__name__, (InFlightParameter, base),
                                    {"_flight": me, "_bucket": b, "_base": base,
                                     "__module__": base.__module__, "__qualname__": base.__qualname__})
            return classes[key]

        self._marks = [[(p, type(p), marked(b, type(p))) for p in ps if _markable(type(p))]
                       for b, ps in enumerate(buckets)]
        self._marked = [False] * len(self._marks)
        #: the module whose forward runs now (its id), None outside a training forward
        self.running: int | None = None
        #: buckets a module's forward used without their own module running first (nn.MultiheadAttention's
        #: out_proj): that module's hook waits for them from then on, so that forwards (and the code
        #: torch.compile made of them) meet plain parameters only
        self._also: dict[int, list[int]] = {}

    def mark(self) -> None:
        """Every bucket's writes are in flight: operations on its parameters wait for them."""
        self.running = None
        for b, marks in enumerate(self._marks):
            for p, _, cls in marks:
                p.__class__ = cls
            self._marked[b] = True

    def before_module(self, module: int, buckets: Sequence[int]) -> None:
        """A module's forward starts (``id(module)``): wait for its buckets and those its forward used
        before, and make their parameters plain."""
        self.running = module
        for b in (*buckets, *self._also.get(module, ())):
            self._wait(b)
            self.landed(b)

    def land(self, b: int) -> None:
        """Wait for bucket ``b``'s writes (an operation on one of its parameters is about to run)."""
        self._wait(b)
        if self.running is not None and self._marked[b]:
            self._also.setdefault(self.running, []).append(b)
        self.landed(b)

    def landed(self, b: int) -> None:
        """Bucket ``b``'s writes were waited for: its parameters are plain again."""
        if self._marked[b]:
            self._marked[b] = False
            for p, base, cls in self._marks[b]:
                if type(p) is cls:
                    p.__class__ = base

    def landed_all(self) -> None:
        """Everything in flight was waited for (flush, complete)."""
        for b in range(len(self._marks)):
            self.landed(b)
