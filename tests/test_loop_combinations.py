"""The features of an ordinary training loop together, drawn by hypothesis, through DistributedOptimizer,
against one process on the whole batch.

``test_train_loops.py`` tries each feature alone; here every example draws a loop that combines
them: the strategy, the optimizer and its parameter groups, accumulation (``backward_passes_per_step``
or ``no_sync()``), a GradScaler whose scale changes, gradient clipping by norm, an LR scheduler,
``zero_grad`` (the optimizer's, to None or zeros, or the model's), SyncBatchNorm, an evaluation forward and a
checkpoint resumed partway, into new objects and into one process.
Hypothesis runs derandomized, so every rank draws the same loops in the same order (the ranks must
make the same calls).  What such a loop cannot match (parameters outside the optimizer) is named.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest

from conftest import HAVE_TORCH, STRATEGIES, assert_same_on_every_rank, checkpoint_bytes, resume_from

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")]

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer, SyncBatchNorm

    torch.set_num_threads(1)

LOCAL = 4          # samples per rank per step (even: accumulation splits it in two)
STEPS = 5
MAX_NORM = 0.2

LOOPS = st.fixed_dictionaries({
    "strategy": st.sampled_from(sorted(STRATEGIES)),
    "optimizer": st.sampled_from(["sgd", "adamw"]),
    "groups": st.booleans(),
    "batchnorm": st.booleans(),
    "accumulate": st.sampled_from(["none", "passes", "no_sync"]),
    "scaler": st.booleans(),
    "clip": st.booleans(),
    "scheduler": st.booleans(),
    "zero_grad": st.sampled_from(["opt", "opt-zeros", "model"]),
    "evaluate_at": st.sampled_from([None, 1, 3]),
    "resume_at": st.sampled_from([None, 2, 3]),
})


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    n = LOCAL * size
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


class Loop:
    """One loop's model, optimizer, scaler and scheduler; ``comm`` None: one process on the whole batch."""

    def __init__(self, loop: dict, comm, world: int, seed: int = 0):
        torch.manual_seed(seed)
        self.loop, self.comm, self.world = loop, comm, world
        self.evaluated = None
        # no bias before a norm layer (its gradient is rounding noise, which Adam scales to steps)
        norm = [torch.nn.BatchNorm1d(16)] if loop["batchnorm"] else []
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 16, bias=not norm), *norm, torch.nn.Tanh(),
                                         torch.nn.Linear(16, 3))
        if comm is not None:      # every rank's batch together, as one process normalizes the whole batch
            self.model = SyncBatchNorm.convert_sync_batchnorm(self.model, comm)
        *body, last = self.model
        params = ([{"params": [p for m in body for p in m.parameters()], "lr_mult": 0.5},
                   {"params": last.parameters()}]
                  if loop["groups"] else [{"params": self.model.parameters()}])
        for g in params:
            g["lr"] = (0.1 if loop["optimizer"] == "sgd" else 0.01) * g.pop("lr_mult", 1.0)
        opt = (torch.optim.SGD(params, momentum=0.9, weight_decay=1e-3) if loop["optimizer"] == "sgd"
               else torch.optim.AdamW(params, weight_decay=0.1))
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2,
                                           enabled=loop["scaler"])
        if comm is not None:
            opt = DistributedOptimizer(opt, self.model, strategy=STRATEGIES[loop["strategy"]](), comm=comm,
                                       backward_passes_per_step=2 if loop["accumulate"] == "passes" else 1,
                                       grad_scaler=self.scaler)
        self.opt = opt
        self.sched = (torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if loop["scheduler"]
                      else None)

    def steps(self, first: int, last: int) -> Loop:
        loop, comm = self.loop, self.comm
        for step in range(first, last):
            x, y = batch(step, self.world)
            if comm is not None:
                mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
                x, y = x[mine], y[mine]
            if loop["zero_grad"] == "model":
                self.model.zero_grad()
            else:
                self.opt.zero_grad(set_to_none=loop["zero_grad"] == "opt")
            parts = 1 if loop["accumulate"] == "none" else 2
            for i, (xs, ys) in enumerate(zip(self.split(x, parts), self.split(y, parts))):
                quiet = (loop["accumulate"] == "no_sync" and comm is not None and i < parts - 1)
                with self.opt.no_sync() if quiet else contextlib.nullcontext():
                    loss = torch.nn.functional.mse_loss(self.model(xs), ys) / parts
                    self.scaler.scale(loss).backward()
            if loop["clip"]:
                self.scaler.unscale_(self.opt)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
            self.scaler.step(self.opt)
            self.scaler.update()
            if self.sched is not None:
                self.sched.step()
            if loop["evaluate_at"] == step:
                self.model.eval()
                with torch.no_grad():
                    self.evaluated = self.model(batch(99, 1)[0]).numpy().copy()
                self.model.train()
        return self

    def split(self, t: torch.Tensor, parts: int) -> list[torch.Tensor]:
        """Micro-batches: each rank's rows split in ``parts``; in one process, every rank's part i
        together (the samples the ranks' i-th backward passes see)."""
        if self.comm is not None:
            return list(t.chunk(parts))
        ranks = t.reshape(self.world, LOCAL, -1).chunk(parts, dim=1)
        return [r.reshape(-1, t.shape[-1]) for r in ranks]

    def checkpoint(self) -> bytes:
        return checkpoint_bytes(model=self.model, opt=self.opt, scaler=self.scaler, sched=self.sched)

    def resume(self, ckpt: bytes) -> Loop:
        """Load a checkpoint: the model's, the optimizer's (consolidated: a plain optimizer in one
        process loads it too), the scaler's, the scheduler's."""
        resume_from(ckpt, model=self.model, opt=self.opt, scaler=self.scaler, sched=self.sched)
        return self

    def params(self) -> np.ndarray:
        return torch.cat([v.reshape(-1).double() for v in self.model.state_dict().values()]).numpy()


def run(loop: dict, comm, world: int) -> tuple[Loop, bytes | None]:
    """The loop through DistributedOptimizer (``comm``) or in one process (``comm`` None, ``world``
    ranks' batches together); through DistributedOptimizer resumed from a checkpoint into new objects
    at ``resume_at``, which is returned too."""
    at = loop["resume_at"]
    if at is None or comm is None:
        return Loop(loop, comm, world).steps(0, STEPS), None
    first = Loop(loop, comm, world).steps(0, at)
    ckpt = first.checkpoint()
    resumed = Loop(loop, comm, world, seed=1).resume(ckpt)
    resumed.evaluated = first.evaluated
    return resumed.steps(at, STEPS), ckpt


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(loop=LOOPS)
def test_a_loop_of_ordinary_features_trains_as_one_process(comm, loop):
    """Parameters and buffers (running statistics), an evaluation's output and the loss scale match one
    process on the whole batch, and are the same on every rank; the distributed run's checkpoint,
    resumed in one process by plain torch objects, trains on as that process."""
    got, ckpt = run(loop, comm, comm.size)
    ref, _ = run(loop, None, comm.size)
    vec = got.params()
    assert_same_on_every_rank(comm, vec)
    np.testing.assert_allclose(vec, ref.params(), rtol=2e-5, atol=2e-6, err_msg=repr(loop))
    if loop["evaluate_at"] is not None:
        np.testing.assert_allclose(got.evaluated, ref.evaluated, rtol=2e-5, atol=2e-6, err_msg=repr(loop))
    assert got.scaler.get_scale() == ref.scaler.get_scale()
    if ckpt is not None:
        alone = Loop(loop, None, comm.size, seed=1).resume(ckpt).steps(loop["resume_at"], STEPS)
        np.testing.assert_allclose(alone.params(), ref.params(), rtol=2e-5, atol=2e-6, err_msg=repr(loop))


@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_parameters_outside_the_optimizer_with_gradients_are_named(comm, strategy):
    """A layer left out of the optimizer but not frozen (fine-tuning a head, ``requires_grad`` still on
    in the body) gets each rank's own gradient, not the average: ``clip_grad_norm_(model.parameters())``
    then differs across ranks and the replicas part silently (found by the test above, with a norm
    layer left out of the groups).  The first step warns on every rank, naming the layer's parameters;
    frozen, or in the optimizer, it does not."""
    def step(freeze: bool, in_opt: bool) -> list[str]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        model[0].requires_grad_(not freeze)
        inner = torch.optim.SGD(model.parameters() if in_opt else model[2].parameters(), lr=0.1)
        opt = DistributedOptimizer(inner, model, strategy=STRATEGIES[strategy](), comm=comm)
        x, y = batch(0, comm.size)
        mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
        opt.close()
        return [str(w.message) for w in caught if "not in the optimizer" in str(w.message)]

    named = step(freeze=False, in_opt=False)
    assert len(named) == 1 and named[0].startswith("DistributedOptimizer: 0.weight, 0.bias got gradients")
    assert step(freeze=True, in_opt=False) == [] and step(freeze=False, in_opt=True) == []
