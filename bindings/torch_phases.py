"""What :class:`bindings.torch.DistributedOptimizer` does where its strategy's update changes with a phase.

:class:`PhaseSwitches` is the part of ``DistributedOptimizer`` that follows a
strategy with phases (Sync-Switch): the learning rate and momentum scaled for
the update about to run (``lr_scale``, ``momentum_scale``); at a switch,
momentum reset where the policy asks and the replicas' optimizers made to agree
on the way back to BSP; and, over a sharded BSP strategy
(``SyncSwitch(bsp=DeAR())``), the optimizer moved between this rank's pieces
(BSP: ZeRO-1, the shard optimizer) and whole tensors (ASP and SSP, where each
rank updates every parameter with its own gradient): gathered leaving BSP (the
ranks are in lockstep there), averaged then split on the way back (after the
switch's barrier).  Nothing is lost either way: the state is the one a
checkpoint would hold.

Example:
    >>> ss = SyncSwitch(bsp=DeAR(), policy=OfflinePolicy(0.25, total_steps=10_000, lr_scale=0.5))
    >>> opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()), model, strategy=ss)
    >>> # 2,500 BSP steps with AdamW's moments in 1/size pieces, then ASP with them whole
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .torch_amp import LossScale

__all__ = ["PhaseSwitches", "momentum_problem"]


#: a momentum coefficient that is not 0 to torch's optimizers but rounds away in every product
_ROUNDS_AWAY = 1e-300


def _scalable(value: Any) -> bool:
    """A hyperparameter a phase may scale: a real number (not a bool) or a tensor."""
    return isinstance(value, torch.Tensor) or (
        isinstance(value, numbers.Real) and not isinstance(value, bool))


def momentum_problem(strategy: Any, optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``strategy``'s momentum changes cannot act on ``optimizer`` (``None``: they can, or it
    makes none): a reset or ramp at a switch acts on an SGD-style ``momentum`` hyperparameter and
    its ``momentum_buffer`` (SGD, RMSprop), and Adam's betas are another thing."""
    if not strategy.changes_momentum:
        return None
    if all(_scalable(g.get("momentum")) for g in optimizer.param_groups):
        return None
    return (f"{strategy.name}'s policy resets or ramps the momentum at a switch, which acts on an SGD-style "
            f"'momentum' hyperparameter and its momentum buffer (SGD, RMSprop); {type(optimizer).__name__} "
            "has no such hyperparameter in some group (its betas would be left as they are): use "
            "momentum='keep'")


class PhaseSwitches:
    """Mixin of :class:`bindings.torch.DistributedOptimizer` (uses its strategy, optimizers and buckets)."""

    strategy: Any
    param_groups: list[dict[str, Any]]
    _inner: torch.optim.Optimizer
    _params: list[torch.nn.Parameter]
    _sharded: bool | None
    _pieces: list[Any]
    _shard_opt: torch.optim.Optimizer
    _retired_by: str
    _loss_scale: LossScale

    @contextmanager
    def _scaled_hyperparameters(self) -> Iterator[None]:
        """Strategies that change the learning rate or momentum for a phase
        (Sync-Switch's ``lr_scale`` / ``momentum_scale``) scale them for this update only."""
        lr_s, mom_s = float(self.strategy.lr_scale), float(self.strategy.momentum_scale)
        if lr_s == 1.0 and mom_s == 1.0:
            yield
            return
        saved = [(g.get("lr"), g.get("momentum")) for g in self.param_groups]
        for g in self.param_groups:     # a float, an int or a tensor (a new one: the group's is restored)
            if _scalable(g.get("lr")):
                g["lr"] = g["lr"] * lr_s
            if _scalable(g.get("momentum")):
                if mom_s == 0.0 and bool(g["momentum"] != 0):
                    self._restart_momentum(g)
                else:
                    g["momentum"] = g["momentum"] * mom_s
        try:
            yield
        finally:
            for g, (lr, mom) in zip(self.param_groups, saved):
                if lr is not None:
                    g["lr"] = lr
                if mom is not None:
                    g["momentum"] = mom

    def _restart_momentum(self, group: dict[str, Any]) -> None:
        """A coefficient of 0 for this update (a ramp's first step): the buffer becomes
        ``0 * buf + grad``.  torch's SGD and RMSprop skip their buffer at 0 (it came back whole at
        the next step), so the buffers are zeroed and the coefficient is one that rounds away
        (``1e-300``: 0 in float32, and ``1 + 1e-300 == 1`` in float64)."""
        for p in group["params"]:
            buf = self._inner.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                buf.zero_()
        group["momentum"] = _ROUNDS_AWAY

    def _on_switch(self, old: str, new: str, changes: dict[str, Any]) -> None:
        """Sync-Switch's callback, on every rank: the state whole while it is reset or averaged, and
        in pieces again where the new phase's update runs on shards.  (While the strategy's
        ``setup`` switches, before the update's side is made, ``_sharded`` is None: that side is
        then made for the phase the setup ends in.  After ``close()``, a switch leaves the state as
        it is: whole, or in pieces that ``state_dict()`` gathers.)"""
        if self._retired_by:
            return
        if self._sharded and not self.strategy.sharded:
            self._state_whole()
        if changes.get("momentum") == "reset":
            for p in self._params:
                buf = self._inner.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    buf.zero_()
        if new == "bsp":
            self._average_optimizer_state()
            self._loss_scale.due = True     # each rank's GradScaler ran alone: one scale again
        if self._sharded is False and self.strategy.sharded:
            self._make_update_side(True)        # the shard optimizer takes its pieces of the whole state
            self._install_hooks()

    def _state_whole(self) -> None:
        """Leaving a sharded phase (a collective: the ranks are in lockstep): every piece's state
        gathered whole into the wrapped optimizer, which updates whole parameters from now on."""
        full = self._full_state()
        self._make_update_side(False)
        self._drop_sharded_marks()
        self._set_full_state(full)
        self._shard_opt.state.clear()       # the pieces' state is whole now: 1/size of it freed
        self._pieces = []
        self._install_hooks()

