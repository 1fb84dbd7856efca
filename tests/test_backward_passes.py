"""Several backward passes before one ``step()``, as one process (and DDP) allows them.

A second ``backward()`` after the gradients were averaged (DCGAN's
discriminator: real, then fake; two losses of one forward with
``retain_graph``) adds that pass's average to them, for the strategies whose
reduction is linear (AllReduce, DeAR: its shards are all-gathered before the
pass accumulates); the others raise on every rank, naming the fix.  Activation
checkpointing (a nested backward when reentrant) and a tied weight too; and
``step(closure)``, whose optimizer may evaluate the closure (a pass each time)
again and again (LBFGS).  Every result is checked against one process on the
concatenated batch.  A pass after a ``step()`` without ``zero_grad()`` adds to the last average.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from conftest import HAVE_TORCH, STRATEGIES, clip_grad_norm

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer

    torch.set_num_threads(1)

LOCAL = 3          # samples per rank per step
STEPS = 4


def flat(*models: torch.nn.Module) -> np.ndarray:
    return torch.cat([v.detach().reshape(-1) for m in models for v in m.state_dict().values()]).numpy()


def local_slice(comm, dist: bool, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.chunk(comm.size)[comm.rank] if dist else t for t in tensors]


def wrapped(comm, dist: bool, strategy: str, opt: torch.optim.Optimizer,
            model: torch.nn.Module) -> torch.optim.Optimizer:
    """``opt`` through commlib with ``STRATEGIES[strategy]`` (``dist``), or itself (one process)."""
    return DistributedOptimizer(opt, model, strategy=STRATEGIES[strategy](), comm=comm) if dist else opt


def batch(comm, dist: bool, g: torch.Generator) -> list[torch.Tensor]:
    """A step's inputs (5 features) and targets (2) from ``g``: this rank's rows, or all of them."""
    return local_slice(comm, dist, torch.randn(LOCAL * comm.size, 5, generator=g),
                       torch.randn(LOCAL * comm.size, 2, generator=g))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allreduce", "dear", "syncswitch-bsp", "syncswitch-dear"])
def test_dcgan_loop_trains_as_one_process(comm, strategy):
    """PyTorch's DCGAN example as it is written: the discriminator's step takes two backward
    passes (real, then fake), the generator's backward runs through the discriminator, whose
    gradients ``netD.zero_grad()`` drops at the next iteration."""

    def run(dist: bool) -> np.ndarray:
        torch.manual_seed(0)
        netG = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        netD = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1),
                                   torch.nn.Sigmoid())
        optG = torch.optim.SGD(netG.parameters(), lr=0.2, momentum=0.5)
        optD = torch.optim.SGD(netD.parameters(), lr=0.2, momentum=0.5)
        if dist:
            optG = DistributedOptimizer(optG, netG, strategy=STRATEGIES[strategy](), comm=comm)
            optD = DistributedOptimizer(optD, netD, strategy=STRATEGIES[strategy](), comm=comm)
        criterion = torch.nn.BCELoss()
        g = torch.Generator().manual_seed(5)
        for _ in range(STEPS):
            noise, real = local_slice(comm, dist, *torch.randn(2, LOCAL * comm.size, 4, generator=g))
            netD.zero_grad()
            output = netD(real + 2)
            errD_real = criterion(output, torch.ones_like(output))
            errD_real.backward()
            fake = netG(noise)
            output = netD(fake.detach())
            errD_fake = criterion(output, torch.zeros_like(output))
            errD_fake.backward()
            optD.step()
            netG.zero_grad()
            output = netD(fake)
            errG = criterion(output, torch.ones_like(output))
            errG.backward()
            optG.step()
        return flat(netG, netD)

    np.testing.assert_allclose(run(True), run(False), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allreduce", "dear", "syncswitch-bsp", "syncswitch-dear"])
@pytest.mark.parametrize("pattern", ["retain_graph", "after-no_sync", "three-passes-of-two"])
def test_passes_after_the_average_add_up_as_one_process(comm, strategy, pattern):
    """``retain_graph``: two losses of one forward, no forward between the passes (DeAR must
    gather its shards before the second pass accumulates); ``after-no_sync``: a local pass, the
    averaged one, then one more; ``three-passes-of-two``: ``backward_passes_per_step=2`` and a
    third pass.  Clipped by the global norm after the passes."""

    def run(dist: bool) -> np.ndarray:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
        passes = 2 if pattern == "three-passes-of-two" else 1
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[strategy](), comm=comm,
                                       backward_passes_per_step=passes)
        g = torch.Generator().manual_seed(7)
        for _ in range(STEPS):
            x, y = batch(comm, dist, g)
            opt.zero_grad()
            if pattern == "retain_graph":
                out = model(x)
                torch.nn.functional.mse_loss(out, y).backward(retain_graph=True)
                out.abs().mean().backward()
            else:
                losses = [torch.nn.functional.mse_loss(model(x * k), y) / 3 for k in (1.0, 0.5, -1.0)]
                with opt.no_sync() if dist and pattern == "after-no_sync" else contextlib.nullcontext():
                    losses[0].backward()
                for loss in losses[1:]:
                    loss.backward()
            clip_grad_norm(opt, model, dist, 0.5)
            opt.step()
        if dist:
            opt.flush()
        return flat(model)

    np.testing.assert_allclose(run(True), run(False), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("zero_every", [2, None])
@pytest.mark.parametrize("clip,unfreeze", [(False, False), (True, False), (False, True)])
def test_steps_without_zero_grad_add_up_as_one_process(comm, strategy, zero_every, clip, unfreeze):
    """``zero_grad()`` every other step, or never: one process's ``.grad`` carries the last step's
    gradient (clipped, where it was) into the next pass, which adds to it.  DeAR's ``.grad`` after a
    step holds this rank's shard of the average and its own pass elsewhere: the next pass gathers the
    average first (one all-gather).  Before, DeAR reduced that mixture: 0.008 off one process after 4
    steps at 2 ranks (0.037 with no ``zero_grad``; 2e-5 clipped), and so did a GAN's discriminator,
    whose gradients the generator's backward adds to after its step, under a clip of every parameter.
    ``unfreeze``: the first layer starts training at step 3, whose forward re-plans the buckets while
    ``.grad`` is carried (gathered before the new buckets take it: 0.013 off without)."""

    def run(dist: bool) -> np.ndarray:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        model[0].requires_grad_(not unfreeze)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        opt = wrapped(comm, dist, strategy, opt, model)
        g = torch.Generator().manual_seed(3)
        for step in range(STEPS + 2):
            x, y = batch(comm, dist, g)
            if unfreeze and step == 3:
                model[0].requires_grad_(True)
            if zero_every and step % zero_every == 0:
                opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        if dist:
            opt.flush()
        return flat(model)

    np.testing.assert_allclose(run(True), run(False), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("case", ["step_twice", "branch"])
def test_a_gradient_left_in_grad_steps_again_as_one_process(comm, strategy, case):
    """A parameter that gets no gradient before a ``step()`` while ``.grad`` still holds the last
    step's (no ``zero_grad()`` since) is stepped with it again, as one process does: ``step()``
    twice after one ``backward()``, or ``zero_grad()`` every other step with a layer that only the
    even steps use.  Its ``.grad`` was zeroed: the second step moved nothing (0.03 off one
    process's SGD at 2 ranks), the branch's layer lost its odd steps (0.05)."""

    def run(dist: bool) -> np.ndarray:
        torch.manual_seed(0)
        trunk, head = torch.nn.Linear(5, 4), torch.nn.Linear(4, 2)
        extra = torch.nn.Linear(4, 4)
        model = torch.nn.ModuleList([trunk, head, extra])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        opt = wrapped(comm, dist, strategy, opt, model)
        g = torch.Generator().manual_seed(5)
        for step in range(STEPS + 1):
            x, y = batch(comm, dist, g)
            if case == "step_twice" or step % 2 == 0:
                opt.zero_grad()
            h = torch.tanh(trunk(x))
            if case == "branch" and step % 2 == 0:
                h = torch.tanh(extra(h))
            torch.nn.functional.mse_loss(head(h), y).backward()
            opt.step()
            if case == "step_twice":
                opt.step()
        if dist:
            opt.flush()
        return flat(model)

    np.testing.assert_allclose(run(True), run(False), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["selsync0", "sparse-dense"])
def test_a_pass_after_the_average_raises_where_it_cannot_add(comm, strategy):
    """A gate or error feedback cannot take a pass onto a reduced gradient: every rank raises,
    naming the strategy and the fix, and training goes on after ``zero_grad()``."""
    torch.manual_seed(comm.rank)
    model = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               strategy=STRATEGIES[strategy](), comm=comm)
    x = torch.randn(LOCAL, 3)
    model(x).square().mean().backward()
    name = opt.strategy.name
    with pytest.raises(RuntimeError, match=f"{name} cannot add another pass.*no_sync"):
        model(x).square().mean().backward()
    opt.zero_grad()                # closes the step; training goes on
    model(x).square().mean().backward()
    opt.step()


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_and_a_tied_weight_train_as_one_process(comm, strategy, reentrant):
    """``torch.utils.checkpoint`` recomputes a block inside backward (reentrant: in a nested
    backward of its own, whose parameters' gradients arrive there); the output layer shares
    the input layer's weight (tied embeddings)."""
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.mid, self.out = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
            self.out.weight = self.inp.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.inp(x))
            h = checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=reentrant)
            return self.out(h)

    def run(dist: bool) -> np.ndarray:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        opt = wrapped(comm, dist, strategy, opt, model)
        g = torch.Generator().manual_seed(3)
        for _ in range(STEPS):
            x, y = local_slice(comm, dist, *torch.randn(2, LOCAL * comm.size, 6, generator=g))
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        if dist:
            opt.flush()
        return flat(model)

    np.testing.assert_allclose(run(True), run(False), rtol=1e-5, atol=1e-6)


def pinn_batch(comm, dist: bool) -> list[torch.Tensor]:
    """A regression as small physics-informed models are trained with LBFGS: float64, whole batch."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(LOCAL * 4 * comm.size, 4, generator=g, dtype=torch.float64)
    return local_slice(comm, dist, x, torch.sin(x.sum(1, keepdim=True)))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allreduce", "sparse-dense"])
@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_lbfgs_evaluates_its_closure_as_one_process(comm, strategy, line_search):
    """LBFGS calls the closure several times a step: each pass is averaged before it reads the
    gradient, and the loss it compares (convergence, the line search's conditions) is the average
    over ranks, so every rank takes the same evaluations as one process on the whole batch (with
    each rank's own loss, as with DDP, the ranks' line searches part and the job hangs)."""

    def run(dist: bool) -> tuple[np.ndarray, list[float]]:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=5, line_search_fn=line_search)
        opt = wrapped(comm, dist, strategy, opt, model)
        x, y = pinn_batch(comm, dist)
        evaluations = 0

        def closure() -> torch.Tensor:
            nonlocal evaluations
            evaluations += 1
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        losses = [opt.step(closure).item() for _ in range(STEPS)]
        return flat(model), losses + [evaluations]

    (got, got_losses), (want, want_losses) = run(True), run(False)
    assert got_losses[-1] == want_losses[-1] > STEPS         # evaluations: the same number, several a step
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-9)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_closure_with_an_elementwise_optimizer_trains_as_one_process(comm, strategy):
    """``opt.step(closure)`` with Adam: one pass a step, averaged; the loss it returns is the
    loss over the whole batch on every rank (what one process returns)."""

    def run(dist: bool) -> tuple[np.ndarray, list[float]]:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        opt = wrapped(comm, dist, strategy, opt, model)
        x, y = pinn_batch(comm, dist)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        losses = [opt.step(closure).item() for _ in range(STEPS)]
        if dist:
            opt.flush()
        return flat(model), losses

    (got, got_losses), (want, want_losses) = run(True), run(False)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-9)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["selsync0", "syncswitch-bsp"])
def test_lbfgs_is_refused_where_replicas_drift(comm, strategy):
    """SelSync and Sync-Switch apply local updates between synchronizations: LBFGS's evaluations
    would part between ranks.  Refused on every rank at construction, naming the fix."""
    from commlib.errors import ValidationError

    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValidationError, match="LBFGS evaluates the loss again.*use AllReduce"):
        DistributedOptimizer(torch.optim.LBFGS(model.parameters()), model,
                             strategy=STRATEGIES[strategy](), comm=comm)


@pytest.mark.mpi
def test_a_closure_misused_raises_on_every_rank(comm):
    """A loss returned on some ranks only raises on every rank (before the next collective); an
    optimizer that never calls the closure would update with gradients not averaged: raises."""

    class Lazy(torch.optim.SGD):
        def step(self, closure=None):       # noqa: ANN001, ANN202 - ignores its closure
            return super().step()

    model = torch.nn.Linear(3, 1)
    x = torch.randn(LOCAL, 3)

    def closure(loss_here: bool) -> torch.Tensor | None:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss if loss_here else None

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm)
    assert opt.step(lambda: closure(False)) is None          # None everywhere: returned as it is
    if comm.size > 1:
        with pytest.raises(ValueError, match=f"returned a loss .* on {comm.size - 1} of {comm.size} ranks"):
            opt.step(lambda: closure(comm.rank != 0))
        opt.zero_grad()
    opt = DistributedOptimizer(Lazy(model.parameters(), lr=0.1), model, comm=comm)
    with pytest.raises(RuntimeError, match=r"Lazy.step\(\) did not call the closure"):
        opt.step(lambda: closure(True))
