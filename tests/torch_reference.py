"""The small model, optimizers, data and single-process reference that the DistributedOptimizer tests
(test_bind_torch.py, test_optimizer_state.py) train.

Every rank trains on its slice of a global batch; the reference is one process training the same
model on the whole batch (the mean loss over the concatenated batch has the average of the ranks'
gradients as its gradient).

Example:
    >>> model, opt = distributed(comm, "sgd", STRATEGIES["dear"](), STEPS)
    >>> assert_close(model, reference("sgd", comm.size, STEPS)[0])
"""

from __future__ import annotations

import numpy as np

from conftest import HAVE_TORCH, assert_same_on_every_rank

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.collectives import AllReduce, DeAR, SelSync

    torch.set_num_threads(1)

LOCAL = 3          # samples per rank per step
STEPS = 5


class Net(torch.nn.Module if HAVE_TORCH else object):
    """Two layers, an embedding-like bias, a parameter that never gets a gradient, a frozen one."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, hidden)
        self.fc2 = torch.nn.Linear(hidden, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.unused = torch.nn.Parameter(torch.randn(5))
        self.frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale + self.frozen.sum()


def make_model(seed: int, hidden: int = 16) -> Net:
    torch.manual_seed(seed)
    return Net(hidden)


def make_optimizer(kind: str, model: Net) -> torch.optim.Optimizer:
    groups = [
        {"params": [model.fc1.weight, model.fc1.bias, model.unused]},
        {"params": [model.fc2.weight, model.fc2.bias, model.scale, model.frozen], "lr": 0.05},
    ]
    if kind == "sgd":
        groups[0]["weight_decay"] = 0.01
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
    groups[1]["weight_decay"] = 0.0
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.05)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(LOCAL * size, 8, generator=g), torch.randn(LOCAL * size, 4, generator=g)


def loss_fn(model: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def reference(kind: str, size: int, steps: int) -> tuple[Net, torch.optim.Optimizer]:
    model = make_model(0)
    opt = make_optimizer(kind, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(steps):
        x, y = batch(step, size)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        sched.step()
    return model, opt


def distributed(comm, kind: str, strategy, steps: int, extra_forward: bool = True, passes: int = 1,
                set_passes: bool = False):
    model = make_model(comm.rank)          # rank 0 has the reference's initial parameters
    opt = DistributedOptimizer(make_optimizer(kind, model), model, strategy=strategy, comm=comm,
                               find_unused_parameters=True,
                               backward_passes_per_step=1 if set_passes else passes)
    if set_passes:
        opt.set_backward_passes_per_step(passes)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(steps):
        x, y = batch(step, comm.size)
        mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
        opt.zero_grad()
        if passes == 1:
            loss_fn(model, x[mine], y[mine]).backward()
        else:
            for part in np.array_split(np.arange(mine.start, mine.stop), passes):
                (loss_fn(model, x[part], y[part]) * (len(part) / LOCAL)).backward()   # passes add up
        opt.step()
        sched.step()
        if extra_forward:   # evaluation forwards must not apply the update again
            with torch.no_grad():
                model(x)
            model(x)
    opt.sched = sched
    return model, opt


def same_on_all_ranks(comm, model: Net) -> None:
    assert_same_on_every_rank(comm, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())


def assert_close(model: Net, ref: Net) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=2e-5, atol=2e-6,
                                   err_msg=name)


STRATEGIES = {"allreduce": lambda: AllReduce(cap_mb=0.0003, first_cap_mb=0.0001),
              "dear": lambda: DeAR(cap_mb=0.0003, first_cap_mb=0.0001),
              "dear-1bucket": lambda: DeAR(cap_mb=64),
              # the SelSync gate at delta 0 is BSP: driven by the same binding, same result
              "selsync0-grads": lambda: SelSync(inner=AllReduce(cap_mb=0.0003), delta=0.0, mode="grads"),
              "selsync0-params-dear": lambda: SelSync(inner=DeAR(cap_mb=0.0003), delta=0.0, mode="params"),
              } if HAVE_TORCH else {}
