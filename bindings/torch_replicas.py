"""Checkpoints loaded on some ranks only, found before the replicas train apart on them.

Horovod's resume loads a checkpoint on rank 0 and broadcasts it (``broadcast_parameters``,
``broadcast_optimizer_state``).  A loop that loads on some ranks and broadcasts nothing, or the
parameters only, leaves the replicas with different parameters or optimizer states, which
averaging gradients never brings together: they train apart, silently, under Horovod and DDP.
:class:`ReplicaLoads` (part of :class:`bindings.torch.DistributedOptimizer`) notes on each rank
that ``model.load_state_dict()`` or ``opt.load_state_dict()`` ran (or that the wrapped optimizer
held state when wrapped); the next step's agreement on unused parameters (one small all-reduce
that is there anyway) carries these notes, and where some ranks loaded and others did not,
``step()`` compares the replicas (one small all-gather of checksums, on that step only) and
raises the same ``ValidationError`` on every rank where they differ, before the update.  A load
followed by its broadcast, or one on every rank, passes.  Not under SelSync or Sync-Switch, whose
replicas drift apart between synchronizations by design.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from commlib.errors import ValidationError

__all__ = ["ReplicaLoads"]

_MODEL, _OPTIMIZER = 0, 1


class ReplicaLoads:
    """Mixin of :class:`bindings.torch.DistributedOptimizer` (uses its communicator, strategy,
    buckets and wrapped optimizer)."""

    comm: Any
    strategy: Any
    _inner: torch.optim.Optimizer
    _params: list[torch.nn.Parameter]
    _flat_params: list[torch.Tensor]

    def _init_loads(self) -> None:
        #: this rank loaded (model, optimizer state) since the last agreement
        self._loads = [0, int(bool(self._inner.state))]
        #: agreed: some ranks loaded and others did not, not yet checked (model, optimizer state)
        self._loads_apart = [False, False]
        #: whether this rank was one that loaded, at those agreements
        self._loaded_here = [False, False]

    def _model_loading(self, *_: Any) -> None:
        """``model.load_state_dict()`` is about to run (a pre-hook of the model's modules): what is
        in flight lands first, and the load is noted."""
        self._complete()
        self._loads[_MODEL] = 1

    def _load_flags(self) -> list[int]:
        """What rides on the step's agreement (a max over ranks): per kind, loaded and not loaded."""
        m, o = self._loads
        return [m, 1 - m, o, 1 - o]

    def _agree_loads(self, agreed: np.ndarray | None) -> None:
        """The max over ranks of :meth:`_load_flags` (``None``: a local step agreed nothing).  Not
        under a strategy whose replicas drift between synchronizations (SelSync, Sync-Switch):
        there they differ without any load."""
        if agreed is None:
            return
        if self.strategy.updates_parameters:
            self._loads = [0, 0]
            return
        for k in (_MODEL, _OPTIMIZER):
            if agreed[2 * k] and agreed[2 * k + 1]:
                self._loads_apart[k] = True
                self._loaded_here[k] = self._loaded_here[k] or bool(self._loads[k])
            elif agreed[2 * k]:       # loaded on every rank since: whatever was apart is settled
                self._loads_apart[k] = False
                self._loaded_here[k] = False
        self._loads = [0, 0]

    def _check_replicas(self) -> None:
        """Before an update that follows a load on some ranks only: the same error on every rank
        where the replicas' parameters or optimizer states differ (one small all-gather)."""
        if not any(self._loads_apart):
            return
        self._complete()
        sharded = self.strategy.sharded and self.comm.size > 1
        rows = self.comm.allgather_object(
            (self._loaded_here, self._loads,
             _digest(self._flat_params) if self._loads_apart[_MODEL] else None,
             _digest(self._state_tensors()) if self._loads_apart[_OPTIMIZER] and not sharded else None),
            label="DistributedOptimizer: the replicas after a load on some ranks")
        problems = []
        for k, what, fix in ((_MODEL, "model.load_state_dict()", "broadcast_parameters(model.state_dict(), "
                              "root_rank={root})"),
                             (_OPTIMIZER, "opt.load_state_dict()", "broadcast_optimizer_state(opt, "
                              "root_rank={root})")):
            if not self._loads_apart[k]:
                continue
            loaded = [r for r, row in enumerate(rows) if row[0][k]]
            if all(row[1][k] for row in rows):      # loaded again on every rank since
                continue
            if k == _OPTIMIZER and sharded:
                differ = True       # each rank's pieces came from what that rank held
            else:
                digests = [row[2 + k] for row in rows]
                differ = any(d != digests[0] for d in digests)
            if differ:
                others = [r for r in range(len(rows)) if r not in loaded]
                held = " (or the optimizer held state when wrapped there)" if k == _OPTIMIZER else ""
                shards = (f"; with {self.strategy.name} each rank keeps its own pieces of the state, so "
                          "load before wrapping on every rank, or broadcast right after the load"
                          if k == _OPTIMIZER and sharded else "")
                problems.append(f"{what} ran on rank(s) {loaded}{held} and not on {others}, and the "
                                f"replicas now differ: load it on every rank, or call "
                                f"{fix.format(root=loaded[0] if loaded else 0)} after loading{shards}")
        if problems:
            raise ValidationError("DistributedOptimizer: " + "; ".join(problems) + " (Horovod's resume: "
                                  "rank 0 loads, then broadcasts)")
        self._loads_apart, self._loaded_here = [False, False], [False, False]

    def _state_tensors(self) -> list[Any]:
        """The wrapped optimizer's state of the trained parameters, in their order and key order."""
        out: list[Any] = []
        for p in self._params:
            st = self._inner.state.get(p, {})
            for key in sorted(st):
                out.append(st[key])
        return out


def _digest(values: list[Any]) -> tuple[float, ...]:
    """Per value: its count, sum and sum of squares (float64), which replicas equal bit for bit
    share; a number stands for itself."""
    out: list[float] = []
    with torch.no_grad():
        for v in values:
            if torch.is_tensor(v):
                d = v.detach().to(torch.complex128 if v.is_complex() else torch.float64)
                total = complex(d.sum().item())
                out += [float(d.numel()), total.real, total.imag, float(d.abs().square().sum())]
            elif isinstance(v, (int, float)):
                out.append(float(v))
    return tuple(out)
