"""Checkpoints that leave the replicas apart, found before the replicas train on them.

Horovod's resume loads a checkpoint on rank 0 and broadcasts it (``broadcast_parameters``,
``broadcast_optimizer_state``).  A loop that loads on some ranks and broadcasts nothing, or the
parameters only, leaves the replicas with different parameters or optimizer states, which
averaging gradients never brings together: they train apart, silently, under Horovod and DDP.
:class:`ReplicaLoads` (part of :class:`bindings.torch.DistributedOptimizer`) notes on each rank
that ``model.load_state_dict()`` or ``opt.load_state_dict()`` ran (or that the wrapped optimizer
held state when wrapped); the next step's agreement on unused parameters (one small all-reduce
that is there anyway) carries these notes, and after a load ``step()`` compares the replicas
(one small all-gather of checksums, on that step only) and raises the same ``ValidationError``
on every rank where they differ, before the update: a load on some ranks never broadcast,
different checkpoints loaded on different ranks, or (wrapped with ``broadcast=False``, as the
Horovod API wraps) replicas that did not start from the same parameters.  A load followed by
its broadcast, or the same one on every rank, passes.  Not under SelSync or Sync-Switch, whose
replicas drift apart between synchronizations by design.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from commlib.errors import ValidationError

__all__ = ["ReplicaLoads"]

_MODEL, _OPTIMIZER = 0, 1
#: what a reduction follows, on some ranks (see ``_pass_kind``)
_KINDS = ("some ranks reduced this step's backward()", "some called step() again without a backward()",
          "some ran backward() again before step()")


class ReplicaLoads:
    """Mixin of :class:`bindings.torch.DistributedOptimizer` (uses its communicator, strategy,
    buckets and wrapped optimizer)."""

    comm: Any
    strategy: Any
    _inner: torch.optim.Optimizer
    _params: list[torch.nn.Parameter]
    _flat_params: list[torch.Tensor]

    def _init_loads(self, broadcast: bool) -> None:
        """Wrapped without ``broadcast``, the parameters count as loaded: the first step compares them."""
        #: this rank loaded (model, optimizer state) since the last agreement
        self._loads = [int(not broadcast), int(bool(self._inner.state))]
        #: the parameters were not broadcast when wrapped and have not been compared yet
        self._unbroadcast = not broadcast
        #: agreed: some rank loaded since the last check (model, optimizer state)
        self._loads_to_check = [False, False]
        #: whether this rank was one that loaded, at those agreements
        self._loaded_here = [False, False]
        #: since the last agreement: whether this rank updated in step(), and whether it ended a
        #: step without one (zero_grad() after backward(), no step())
        self._updates = [0, 0]
        #: this rank's rank + 1 where a backward raised here mid-pass since the last agreement
        self._interrupted = 0

    def _model_loading(self, *_: Any) -> None:
        """``model.load_state_dict()`` is about to run (a pre-hook of the model's modules): what is
        in flight lands first, and the load is noted."""
        self._complete()
        self._loads[_MODEL] = 1

    def _optimizer_loaded(self) -> None:
        """``opt.load_state_dict()`` ran: the load is noted."""
        self._loads[_OPTIMIZER] = 1

    def _load_flags(self) -> list[int]:
        """What rides on the step's agreement (a max over ranks): per kind, whether this rank loaded;
        whether it updated, and whether it skipped an update, since the last agreement; whether a
        backward raised on it mid-pass (its rank + 1); what its reduction follows (``_pass_kind``)."""
        return [*self._loads, *self._updates, self._interrupted, *self._pass_kind()]

    def _agree_loads(self, agreed: np.ndarray | None) -> None:
        """The max over ranks of :meth:`_load_flags` (``None``: a local step agreed nothing).  Not
        under a strategy whose replicas drift between synchronizations (SelSync, Sync-Switch):
        there they differ without any load."""
        if agreed is None:
            return
        updated, skipped = (bool(v) for v in agreed[2:4])
        self._updates = [0, 0]
        if agreed[4]:
            self._loads, self._interrupted = [0, 0], 0
            raise RuntimeError(f"DistributedOptimizer: a backward() raised on rank {int(agreed[4]) - 1} and "
                               "the loop went on there (the exception caught): that pass's gradients were "
                               "partly sent, so no rank updates with this step's average. Skip a batch on "
                               "every rank alike (decided on a value every rank agrees on), or let the "
                               "exception end the job")
        kinds = [what for what, v in zip(_KINDS, agreed[5:8]) if v]
        if len(kinds) > 1:
            self._loads = [0, 0]
            raise RuntimeError("DistributedOptimizer: the ranks are at different points of their steps: "
                               + " and ".join(kinds) + ", so this reduction paired gradients of different "
                               "steps; make the same backward() and step() calls on every rank (uneven "
                               "data: opt.join())")
        if updated and skipped and not self.strategy.replicas_parted():      # (SelSync: averaged later)
            self._loads = [0, 0]
            raise RuntimeError("DistributedOptimizer: at the last step some ranks updated and others "
                               "skipped step() (zero_grad() after backward() without step()): the replicas "
                               "differ now (DDP's would, silently). Decide a skip on a value every rank "
                               "agrees on (an averaged loss, or a GradScaler: every rank skips alike)")
        if not self.strategy.updates_parameters:
            for k in (_MODEL, _OPTIMIZER):
                if agreed[k]:
                    self._loads_to_check[k] = True
                    self._loaded_here[k] = self._loaded_here[k] or bool(self._loads[k])
        self._loads = [0, 0]

    def _check_replicas(self) -> None:
        """Before the first update after a load: the same error on every rank where the replicas'
        parameters or optimizer states differ (one small all-gather)."""
        if not any(self._loads_to_check):
            return
        self._complete()
        sharded = self._sharded and self.comm.size > 1
        check = self._loads_to_check
        rows = self.comm.allgather_object(
            (self._loaded_here, self._loads, _digest(self._flat_params) if check[_MODEL] else None,
             _digest(self._state_tensors()) if check[_OPTIMIZER] and not sharded else None),
            label="DistributedOptimizer: the replicas after a load")
        problems = []
        for k, what, fix in ((_MODEL, "model.load_state_dict()", "broadcast_parameters(model.state_dict(), "
                              "root_rank={root})"),
                             (_OPTIMIZER, "opt.load_state_dict()", "broadcast_optimizer_state(opt, "
                              "root_rank={root})")):
            loaded = [r for r, row in enumerate(rows) if row[0][k]]
            if not check[k] or all(row[1][k] for row in rows):      # (loaded again on every rank since)
                continue
            if k == _OPTIMIZER and sharded:     # each rank's pieces came from what that rank loaded
                differ = len(loaded) < len(rows)
            else:
                differ = any(row[2 + k] != rows[0][2 + k] for row in rows)
            if not differ:
                continue
            fix = fix.format(root=loaded[0])
            others = [r for r in range(len(rows)) if r not in loaded]
            if k == _MODEL and self._unbroadcast:
                problems.append("the replicas' parameters differ at the first step (wrapped with "
                                f"broadcast=False): start every rank from the same ones, or call {fix} first")
            elif not others:
                problems.append(f"{what} ran on every rank, and the replicas now differ (different "
                                f"checkpoints?): load the same one everywhere, or on one rank, then {fix}")
            else:
                held = " (or the optimizer held state when wrapped there)" if k == _OPTIMIZER else ""
                shards = (f"; with {self.strategy.name} each rank keeps its own pieces of the state, so "
                          "load before wrapping on every rank, or broadcast right after the load"
                          if k == _OPTIMIZER and sharded else "")
                problems.append(f"{what} ran on rank(s) {loaded}{held} and not on {others}, and the replicas "
                                f"now differ: load it on every rank, or call {fix} after loading{shards}")
        if problems:
            raise ValidationError("DistributedOptimizer: " + "; ".join(problems) + " (Horovod's resume: "
                                  "rank 0 loads, then broadcasts)")
        self._loads_to_check, self._loaded_here = [False, False], [False, False]
        self._unbroadcast = False

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
