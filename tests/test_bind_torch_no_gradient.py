"""bindings.torch: parameters a pass gives no gradient, where one process's ``.grad`` stays ``None``.

Two ways a loop reaches them, each against one process training on the whole batch:

* ``model.zero_grad()`` (torch's default sets ``.grad`` to ``None``) and a branch that only some
  ranks' samples take (a mixture's expert, a task head): the ranks whose samples skip it give it
  no gradient, the others do;
* a backward that returns ``None`` for a parameter that requires a gradient (a custom autograd
  Function; a graph compiled while the parameter was frozen, which torch 2.11's Dynamo keeps after
  unfreezing): autograd still runs the parameter's accumulation hooks, with nothing accumulated.

And a parameter frozen during training, where one process zeroing with ``set_to_none=False`` keeps
a zero ``.grad`` and goes on updating it (momentum, weight decay, Adam's moments).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import HAVE_TORCH, STRATEGIES, trains_as_one_process

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer

    torch.set_num_threads(1)

    class NoGradientFor(torch.autograd.Function):
        """``linear(x, w, b)`` whose backward gives ``x`` its gradient and ``w``, ``b`` none."""

        @staticmethod
        def forward(ctx, x, w, b):
            ctx.save_for_backward(w)
            return torch.nn.functional.linear(x, w, b)

        @staticmethod
        def backward(ctx, g):
            (w,) = ctx.saved_tensors
            return g @ w, None, None

LOCAL = 4
STEPS = 4


class Branches(torch.nn.Module if HAVE_TORCH else object):
    """A trunk, and an expert that only the samples flagged take; ``opaque``: the trunk through a
    backward that gives its parameters no gradient."""

    def __init__(self, opaque: bool = False):
        super().__init__()
        self.opaque = opaque
        self.trunk = torch.nn.Linear(6, 5)
        self.expert = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, flagged: torch.Tensor) -> torch.Tensor:
        h = (NoGradientFor.apply(x, self.trunk.weight, self.trunk.bias) if self.opaque
             else self.trunk(x))
        if bool(flagged.any()):                  # the expert joins the graph only when some sample takes it
            h = h + torch.where(flagged[:, None], self.expert(x), torch.zeros_like(h))
        return self.head(torch.tanh(h))


def data(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    x, y = torch.randn(LOCAL * size, 6, generator=g), torch.randn(LOCAL * size, 2, generator=g)
    flagged = torch.zeros(LOCAL * size, dtype=torch.bool)
    flagged[:LOCAL] = step % 2 == 0          # rank 0's samples take the expert at even steps
    return x, y, flagged


def train(comm, strategy: str | None, zero: str, opaque: bool) -> np.ndarray:
    torch.manual_seed(0)
    model = Branches(opaque)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    if strategy is not None:
        opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[strategy](), comm=comm,
                                   find_unused_parameters=True)
    part = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL) if strategy is not None else slice(None)
    for step in range(STEPS):
        x, y, flagged = data(step, comm.size)
        (model if zero == "model" else opt).zero_grad()
        torch.nn.functional.mse_loss(model(x[part], flagged[part]), y[part]).backward()
        opt.step()
    if strategy is not None:
        opt.flush()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


@pytest.mark.mpi
@pytest.mark.parametrize("opaque", [False, True], ids=["plain", "opaque-trunk"])
@pytest.mark.parametrize("zero", ["model", "optimizer"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_parameters_without_a_gradient_train_as_one_process(comm, strategy, zero, opaque):
    """``model.zero_grad()`` and an expert that rank 0's samples alone take: the other ranks kept its
    ``.grad`` ``None`` and their optimizer skipped it, so the replicas went apart silently (AllReduce:
    0.04 off after one step).  A trunk whose backward returns ``None`` for its parameters: commlib
    counted the hook autograd still runs as a zero gradient, which the update then applied (weight
    decay and momentum: 0.2 % off), or raised on ``model.zero_grad()``'s ``None``."""
    trains_as_one_process(comm, lambda dist: train(comm, strategy if dist else None, zero, opaque))


@pytest.mark.mpi
@pytest.mark.parametrize("frozen_at", [0, 2])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_layer_frozen_after_zeroing_to_zeros_moves_as_in_one_process(comm, strategy, kind, frozen_at):
    """``opt.zero_grad(set_to_none=False)`` and the trunk frozen at step 2: one process keeps its
    ``.grad`` at zero and its optimizer goes on moving it (momentum and weight decay); the re-plan
    set ``.grad`` to ``None`` and froze it in place (0.02-0.12 off a few steps later).  Frozen at
    step 0, before any gradient (or after a resume), one process's ``.grad`` is ``None`` and it
    stays in place: the re-plan kept the bucket's zeros and weight decay moved it."""
    def run(dist: bool) -> np.ndarray:
        torch.manual_seed(0)
        model = Branches()
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01) if kind == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1))
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[strategy](), comm=comm,
                                       find_unused_parameters=True)
        part = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL) if dist else slice(None)
        for step in range(STEPS + 1):
            if step == frozen_at:
                model.trunk.requires_grad_(False)
            x, y, flagged = data(step, comm.size)
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(model(x[part], flagged[part]), y[part]).backward()
            opt.step()
        if dist:
            opt.flush()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    trains_as_one_process(comm, run)
