"""SelSync's significance of an update: the EWMA-smoothed gradient norm and its relative change."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from commlib.arrays import COMPLEX_DTYPES, as_view


class SignificanceMeter:
    """Bias-corrected EWMA of the gradient norm and the relative change of that EWMA.

    ``beta = 1 - 2 / (window + 1)`` (the "span" convention: the last
    ``window`` steps carry about 86 % of the weight).  The bias correction
    ``m_i / (1 - beta**i)`` makes the EWMA the plain norm at step 1 and a
    weighted mean of the norms seen while the window fills, so the
    significance is defined (and finite) from the first step; it is 0 at
    step 1, where there is no previous value.

    Example:
        >>> m = SignificanceMeter(window=3)
        >>> m.update(2.0), m.update(2.0), round(m.update(4.0), 4)
        (0.0, 0.0, 0.5714)
    """

    def __init__(self, window: int = 25):
        if int(window) != window or window < 1:
            raise ValueError(f"window {window!r}: expected an integer >= 1")
        self.window = int(window)
        self.beta = 1.0 - 2.0 / (self.window + 1)
        self.m = 0.0
        self.count = 0
        self.value: float | None = None

    def update(self, norm: float) -> float:
        """Add this step's norm; return the significance (relative change of the EWMA)."""
        prev = self.value
        self.count += 1
        self.m = self.beta * self.m + (1.0 - self.beta) * float(norm)
        corr = 1.0 - self.beta ** self.count
        self.value = self.m / corr if corr > 0 else float(norm)
        if prev is None:
            return 0.0
        if prev == 0.0:
            return 0.0 if self.value == 0.0 else math.inf
        return abs(self.value - prev) / prev

    def rescale(self, factor: float) -> None:
        """Norms come ``factor`` times larger from now on (a changed loss scale): the average follows,
        so that the change is not read as a significant one."""
        self.m *= factor
        if self.value is not None:
            self.value *= factor

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "m": self.m, "count": self.count, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["window"]) != self.window:
            raise ValueError(f"meter state has window {state['window']}, this meter {self.window}")
        self.m = float(state["m"])
        self.count = int(state["count"])
        self.value = None if state["value"] is None else float(state["value"])


def l2_norm(buffers: Sequence[Any]) -> float:
    """L2 norm over all ``buffers`` (numpy, cupy, torch, jax, DLPack), accumulated in float64.

    Example:
        >>> l2_norm([np.array([3.0], np.float32), np.array([4.0], np.float32)])
        5.0
    """
    total = 0.0
    for buf in buffers:
        v = as_view(buf, "selsync: gradient")
        d = v.data
        if v.dtype == "bfloat16":            # uint16 storage: the high half of a float32
            d = (d.astype(v.xp.uint32) << 16).view(v.xp.float32)
        elif v.dtype in ("float16", "int32", "int64"):
            d = d.astype(v.xp.float32)
        elif v.dtype in COMPLEX_DTYPES:      # |z|^2: the sum of the squared real pairs
            d = d.view(v.xp.float32 if v.dtype == "complex64" else v.xp.float64)
        total += float(v.xp.dot(d, d))
    return math.sqrt(total)
