"""The loop's ``torch.amp.GradScaler`` as the strategy sees it: gradients in the loss scale's units.

A strategy reads the gradients during backward, before ``scaler.unscale_``: scaled.  Where it keeps
state in their units across steps (a sparse strategy's error-feedback residuals and thresholds,
SelSync's average of the gradient norm), a scale that changes between steps (GradScaler's backoff
after an overflow, its growth every ``growth_interval`` steps) would weigh that state by the ratio
of the scales: a residual carried over an overflow counts twice.  :class:`LossScale` reads the
scale at each step's first backward pass and hands a change to ``strategy.rescale_gradients``.
The scale it last saw is part of the optimizer's checkpoint: a run resumed after a step that changed
the scale (the checkpoint's residuals in the old units, the restored scaler at the new) rescales at
its first step, as the run that went on did.

Where each rank's scaler ran on its own gradients (Sync-Switch's ASP and SSP phases: each skips and
scales alone), :meth:`LossScale.agree` gives them one scale and one growth count again when the
gradients are averaged once more: the smallest of each, in one all-reduce at the first backward after
the return to BSP, and the factor that brings that backward's gradients (scaled by this rank's own
scale) to the common one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class LossScale:
    """``scaler``'s scale (``None``: no scaler, nothing to follow), followed by the strategy.

    Example:
        >>> scale = LossScale(scaler)
        >>> scale.follow(strategy)     # at each step's first backward: a change is rescaled
    """

    def __init__(self, scaler: torch.amp.GradScaler | None):
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        self._seen: float | None = None
        self.due = False        # the ranks' scalers parted: agree at the next backward (saved)

    def follow(self, strategy: Any) -> None:
        """The scale of the gradients about to arrive; where it changed since the last step's, the
        strategy's state follows (the same on every rank: GradScaler's decisions are, once an overflow
        reaches every rank's gradients)."""
        if self.scaler is None:
            return
        scale = self.scaler.get_scale()         # 1.0 when the scaler is disabled
        if self._seen is not None and scale != self._seen:
            strategy.rescale_gradients(scale / self._seen)
        self._seen = scale

    def agree(self, comm: Any) -> float:
        """Where :attr:`due` (set by the binding when the ranks' gradients are averaged again after a
        phase in which each rank's scaler ran alone): every rank's scaler takes the smallest scale and
        the smallest growth count of the ranks (one all-reduce of 16 bytes, a collective: every rank
        calls it at the same backward), and this returns the factor (common / own scale, a power of
        two) that brings the gradients of the backward under way, scaled by this rank's own scale, to
        the common one; 1.0 where nothing was due (or no scaler is enabled: nothing to agree)."""
        if not self.due:
            return 1.0
        self.due = False
        if self.scaler is None or not self.scaler.is_enabled():
            return 1.0
        own = self.scaler.get_scale()
        state = self.scaler.state_dict()
        low = comm.allreduce(np.array([own, state["_growth_tracker"]], np.float64), "min",
                             tag="loss_scale.agree")
        state["scale"], state["_growth_tracker"] = float(low[0]), int(low[1])
        self.scaler.load_state_dict(state)
        return float(low[0]) / own

    def backed_off(self) -> bool:
        """Whether the scaler's scale fell below that of the last gradients seen: its ``update()``
        found them non-finite, so the step was skipped (a rank-local fact)."""
        return (self.scaler is not None and self._seen is not None and self.scaler.is_enabled()
                and self.scaler.get_scale() < self._seen)

    @property
    def seen(self) -> float | None:
        """The scale of the last step's gradients (``None``: none seen, or no scaler), which the
        strategy's state is in; saved in the optimizer's checkpoint."""
        return self._seen

    def resume(self, seen: float | None, due: bool = False) -> None:
        """Continue from a checkpoint's :attr:`seen` and :attr:`due`: the strategy's state just loaded
        is in that scale's units (ignored without a scaler: nothing follows), and the ranks' scalers
        are still to agree where they were."""
        if self.scaler is not None:
            self._seen = None if seen is None else float(seen)
        self.due = bool(due)
