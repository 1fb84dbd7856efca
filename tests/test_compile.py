"""bindings.torch under ``torch.compile``: a compiled model, or a compiled whole training step,
trains as one process.  The hooks that wait for communication, the re-plan after unfreezing and
the optimizer's methods run eagerly, outside the traced code (aot_eager: Dynamo and AOTAutograd,
no C++ build)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import HAVE_TORCH, SMALL, assert_same_on_every_rank, ranks_at_most

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.collectives import AllReduce, DeAR

    torch.set_num_threads(1)

LOCAL = 4          # samples per rank per step
STEPS = 4


class Net(torch.nn.Module if HAVE_TORCH else object):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.mpi
@ranks_at_most(2, "the compiled graphs and commlib's hooks do not depend on the rank count; at 4 "
                  "ranks each rank's compiles took 35 s of CI's suite")
@pytest.mark.parametrize("compiled", ["model", "step"])
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_compiled_training_with_unfreezing_trains_as_one_process(comm, strategy, compiled):
    """The one-process reference, the same class without hooks, is compiled first, as in a fresh
    process where Dynamo does not guard on module hooks: its code must not run the wrapped model
    (it did, without DeAR's waits, until wrapping turned the guards on).  Compiling the whole
    step failed on fake tensors in the step's collectives until the optimizer ran eagerly.
    The reference is one process in eager mode, and also the compiled one where the two differ:
    torch 2.11's Dynamo does not recompile a model compiled while fc1 was frozen when fc1 is
    unfrozen, in one process too (fc1 never trains there), while DeAR's forward hooks make it
    recompile (fc1 trains, as in eager mode).  AllReduce there follows the compiled process; it
    was 0.56 % off it until a backward that gives a parameter no gradient stopped counting as a
    zero gradient (test_bind_torch_no_gradient.py)."""

    def run(dist: bool, compile_it: bool = True) -> np.ndarray:
        torch.manual_seed(comm.rank if dist else 0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        model.fc1.requires_grad_(False)
        if dist:
            make = {"allreduce": AllReduce, "dear": DeAR}[strategy]
            opt = DistributedOptimizer(opt, model, strategy=make(**SMALL), comm=comm)
        forward = (torch.compile(model, backend="aot_eager") if compile_it and compiled == "model"
                   else model)

        def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(forward(x), y).backward()
            opt.step()

        if compile_it and compiled == "step":
            train_step = torch.compile(train_step, backend="aot_eager")
        for step in range(STEPS):
            if step == 1:
                model.fc1.requires_grad_(True)         # unfreezing: a re-plan at the next forward
            g = torch.Generator().manual_seed(500 + step)
            n = LOCAL * comm.size
            x, y = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)
            mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL) if dist else slice(None)
            train_step(x[mine], y[mine])
        # through model.state_dict(), whose hook completes DeAR's all-gathers
        return torch.cat([v.reshape(-1) for v in model.state_dict().values()]).numpy()

    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        compiled_ref = run(False)  # compiled first, without hooks (see above)
        vec = run(True)
    ref = run(False, compile_it=False)
    assert_same_on_every_rank(comm, vec)
    close = {"rtol": 2e-5, "atol": 2e-6}
    if not np.allclose(compiled_ref, ref, **close) and np.allclose(vec, compiled_ref, **close):
        return                     # this torch's compiled one process (see above)
    np.testing.assert_allclose(vec, ref, **close)
