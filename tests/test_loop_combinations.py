"""The features of an ordinary training loop together, drawn by hypothesis, through DistributedOptimizer,
against one process on the whole batch.

``test_train_loops.py`` tries each feature alone; here every example draws a loop that combines
them: the strategy, the optimizer and its parameter groups, accumulation (``backward_passes_per_step``
or ``no_sync()``), a GradScaler whose scale changes, gradient clipping by norm, an LR scheduler,
``zero_grad`` (the optimizer's, to None or zeros, the model's, or every other step), SyncBatchNorm, a
layer left out of the optimizer, an evaluation forward and a checkpoint resumed partway, into new objects
and into one process.
Hypothesis runs derandomized, so every rank draws the same loops in the same order (the ranks must
make the same calls).
"""

from __future__ import annotations

import contextlib

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
    "outside": st.booleans(),       # the first layer left out of the optimizer, not frozen
    "batchnorm": st.booleans(),
    "accumulate": st.sampled_from(["none", "passes", "no_sync"]),
    "scaler": st.booleans(),
    "clip": st.booleans(),
    "scheduler": st.booleans(),
    "zero_grad": st.sampled_from(["opt", "opt-zeros", "model", "every-other"]),
    "evaluate_at": st.sampled_from([None, 1, 3]),
    "resume_at": st.sampled_from([None, 2, 3]),
}).filter(lambda loop: not (loop["resume_at"] and (loop["zero_grad"] == "every-other" or
                                                      loop["outside"] and loop["zero_grad"] != "model")))
# (.grad carried into the next step: every other step, and in a layer outside the optimizer unless the model's
# zero_grad clears it; a checkpoint holds no .grad: resumed, one process would lose it too)


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
        if loop["outside"]:
            body = body[1:]
        params = ([{"params": [p for m in body for p in m.parameters()], "lr_mult": 0.5},
                   {"params": list(last.parameters())}]
                  if loop["groups"] else [{"params": [p for m in [*body, last] for p in m.parameters()]}])
        params = [g for g in params if g["params"]]
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
            elif loop["zero_grad"] == "every-other":    # .grad carried into the odd steps
                if step % 2 == 0:
                    self.opt.zero_grad()
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


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_parameters_outside_the_optimizer_are_averaged_as_ddp_averages_them(comm, strategy):
    """A layer left out of the optimizer but not frozen (fine-tuning a head, ``requires_grad`` still on
    in the body) gets the averaged gradient, as DDP gives every parameter of the model: its ``.grad``
    accumulates over steps as one process's does (the optimizer's ``zero_grad`` leaves it), and
    ``clip_grad_norm_(model.parameters())`` is one process's norm on every rank, so the head trains as
    one process's.  Found by the test above (a norm layer left out of the groups); before, each rank
    kept its own ``.grad`` there and the replicas parted silently (then: a warning)."""
    def run(dist: bool) -> tuple[np.ndarray, np.ndarray]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[strategy](), comm=comm)
        for step in range(STEPS):
            x, y = batch(step, comm.size)
            if dist:
                mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
                x, y = x[mine], y[mine]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
        if dist:
            opt.close()
        body = torch.cat([p.grad.reshape(-1) for p in model[0].parameters()]).double().numpy()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy(), body

    (got, got_body), (ref, ref_body) = run(True), run(False)
    assert_same_on_every_rank(comm, np.concatenate([got, got_body]))
    np.testing.assert_allclose(got_body, ref_body, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("strategy", ["allreduce", "dear", "syncswitch-bsp"])
def test_two_optimizers_over_one_model_average_each_part_once(comm, strategy):
    """A GAN as one module (generator and discriminator its children), each part with its own optimizer
    wrapped over the whole module: each part is the other's parameters outside its optimizer, which the
    other averages, so neither averages them again (as many collectives as with each optimizer over its
    own part; a second average would also read gradients the other's reduction is writing).  Trains as
    one process, the generator's backward running through the discriminator, clipped over every
    parameter (under DeAR the discriminator's gradients carried past its step: 7e-5 off before)."""
    def run(dist: bool, one_module: bool = True) -> tuple[np.ndarray, int]:
        torch.manual_seed(0)
        gan = torch.nn.ModuleDict({
            "gen": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)),
            "disc": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))})
        gen, disc = gan["gen"], gan["disc"]
        og, od = torch.optim.Adam(gen.parameters(), lr=1e-2), torch.optim.Adam(disc.parameters(), lr=1e-2)
        if dist:
            og, od = (DistributedOptimizer(o, gan if one_module else part, strategy=STRATEGIES[strategy](),
                                           comm=comm) for o, part in ((og, gen), (od, disc)))
        g = torch.Generator().manual_seed(5)
        softplus = torch.nn.functional.softplus
        first = comm.seq
        for _ in range(STEPS):
            z, real = torch.randn(2, LOCAL * comm.size, 4, generator=g)
            if dist:
                z, real = z.chunk(comm.size)[comm.rank], real.chunk(comm.size)[comm.rank]
            od.zero_grad()
            (softplus(-disc(real + 2)).mean() + softplus(disc(gen(z).detach())).mean()).backward()
            torch.nn.utils.clip_grad_norm_(gan.parameters(), 1.0)
            od.step()
            og.zero_grad()
            softplus(-disc(gen(z))).mean().backward()
            torch.nn.utils.clip_grad_norm_(gan.parameters(), 1.0)
            og.step()
        calls = comm.seq - first
        if dist:
            og.close()
            od.close()
        return torch.cat([v.reshape(-1) for v in gan.state_dict().values()]).numpy(), calls

    (got, calls), (apart, calls_apart) = run(True), run(True, one_module=False)
    assert_same_on_every_rank(comm, got.astype(np.float64))
    np.testing.assert_allclose(got, run(False)[0], rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(got, apart)
    assert calls == calls_apart
