"""Argument checks of the strategies' and policies' constructors (Sync-Switch, its policies, SelSync).

A setting out of range fails at construction, not at the first switch hours into a run, and a float
is never truncated to an integer silently; each error names ``where(name=value)`` and what is accepted.

Example:
    >>> check_int("StragglerPolicy", "window_k", 2.5, 1)
    Traceback (most recent call last):
    TypeError: StragglerPolicy(window_k=2.5): expected an integer >= 1, got float
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["check_int", "check_real", "check_bool", "check_choice"]


def check_int(where: str, name: str, value: Any, minimum: int | None) -> int:
    """``value`` as an int: an integer (``numbers.Integral``, not a bool) ``>= minimum`` (``None``:
    any), else a ``TypeError`` / ``ValueError`` naming ``where(name=value)`` and the accepted range.

    Example:
        >>> check_int("StragglerPolicy", "window_k", 10, 1)
        10
    """
    expected = "an integer" if minimum is None else f"an integer >= {minimum}"
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}({name}={value!r}): expected {expected}, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}({name}={value!r}): expected {expected}")
    return int(value)


def check_real(where: str, name: str, value: Any, expected: str, ok: Callable[[float], bool]) -> float:
    """``value`` as a float: a real number (not a bool) for which ``ok`` holds (NaN fails every
    comparison), else a ``TypeError`` / ``ValueError`` naming ``where(name=value)`` and ``expected``.

    Example:
        >>> check_real("OfflinePolicy", "lr_scale", 0.5, "a number > 0", lambda v: v > 0)
        0.5
    """
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}({name}={value!r}): expected {expected}, got {type(value).__name__}")
    v = float(value)
    if not ok(v):
        raise ValueError(f"{where}({name}={value!r}): expected {expected}")
    return v


def check_bool(where: str, name: str, value: Any) -> bool:
    """``value`` as a bool: ``True`` or ``False`` (numpy's too), else a ``TypeError``.

    Example:
        >>> check_bool("SelSync", "overlap", True)
        True
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}({name}={value!r}): expected True or False, got {type(value).__name__}")
    return bool(value)


def check_choice(where: str, name: str, value: Any, choices: Sequence[str]) -> str:
    """``value``, one of the strings ``choices``, else a ``ValueError`` (``TypeError``: not a string).

    Example:
        >>> check_choice("OfflinePolicy", "momentum", "reset", ("keep", "reset", "ramp"))
        'reset'
    """
    if not isinstance(value, str):
        raise TypeError(f"{where}({name}={value!r}): expected one of {tuple(choices)}, "
                        f"got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{where}({name}={value!r}): expected one of {tuple(choices)}")
    return value
