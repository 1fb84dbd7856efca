"""Which :class:`bindings.torch.DistributedOptimizer` trains a parameter: the newest that wrapped it
and is not retired (a new phase's optimizer replaces the old one, as beside DDP).  Weakly held: a
dropped optimizer or parameter leaves no trace that matters."""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["owner_of", "claim", "driver_of", "drive"]

#: id(parameter) -> (the parameter, the optimizer that trains it), both weakly held
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
#: id(strategy) -> (the strategy, the optimizer it drives), both weakly held
_DRIVERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owner_of(p: torch.Tensor) -> Any:
    """The optimizer that trains ``p`` now, or ``None`` (none wrapped it, or it was retired or closed).

    Example:
        >>> owner_of(model[0].weight) is opt
        True
    """
    entry = _OWNERS.get(id(p))
    owner = entry[1]() if entry is not None and entry[0]() is p else None
    return None if owner is None or owner._retired_by else owner


def claim(p: torch.Tensor, opt: Any) -> None:
    """``opt`` trains ``p`` from now on.

    Example:
        >>> claim(p, opt)
    """
    _OWNERS[id(p)] = (_dropped_with(p, _OWNERS), weakref.ref(opt))


def driver_of(strategy: Any) -> Any:
    """The optimizer ``strategy`` drives now, or ``None`` (none, or it was retired or closed).

    Example:
        >>> driver_of(opt.strategy) is opt
        True
    """
    entry = _DRIVERS.get(id(strategy))
    driver = entry[1]() if entry is not None and entry[0]() is strategy else None
    return None if driver is None or driver._retired_by else driver


def drive(strategy: Any, opt: Any) -> None:
    """``strategy`` drives ``opt`` from now on (it holds that optimizer's buckets and state).

    Example:
        >>> drive(opt.strategy, opt)
    """
    _DRIVERS[id(strategy)] = (_dropped_with(strategy, _DRIVERS), weakref.ref(opt))


def _dropped_with(key: Any, table: dict[int, tuple[weakref.ref, weakref.ref]]) -> weakref.ref:
    """A weak reference to ``key`` whose entry in ``table`` goes when ``key`` does (an entry for a
    newer object at the same id stays)."""
    at = id(key)

    def forget(ref: weakref.ref) -> None:
        entry = table.get(at)
        if entry is not None and entry[0] is ref:
            del table[at]
    return weakref.ref(key, forget)
