"""commlib.horovod.torch's ``DistributedOptimizer`` against one process training on the concatenated
batch (Horovod's own call, the strategies behind it, resumes, layers that start training late,
``synchronize()``/``skip_synchronize()``, closures, GradScaler).  The collectives and the rest of the
API: ``tests/test_horovod_torch.py``.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

from conftest import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    import commlib.horovod.torch as hvd
    from commlib.collectives import DeAR

    torch.set_num_threads(1)

LOCAL, STEPS = 2, 4


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(LOCAL * n, 6, generator=g).double(), torch.randn(LOCAL * n, 3, generator=g).double()


def _reference(n: int) -> torch.nn.Module:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step, n)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def _train(n: int, r: int, make_opt, passes: int = 1) -> torch.nn.Module:
    model = _net(seed=0 if r == 0 else 1 + r)            # different starts: the broadcast fixes them
    opt = make_opt(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)      # no state yet: rank 0's (none) sent
    for step in range(STEPS):
        x, y = _batch(step, n)
        xs, ys = x[r * LOCAL:(r + 1) * LOCAL], y[r * LOCAL:(r + 1) * LOCAL]
        opt.zero_grad()
        for xp, yp in zip(xs.chunk(passes), ys.chunk(passes)):
            (torch.nn.functional.mse_loss(model(xp), yp) / passes).backward()
        opt.step()
    return model


def _steps(model, opt, r: int, n: int, steps: range, dist: bool, sched=None) -> None:
    """``steps`` of training on the whole batch, or with ``dist`` on rank ``r`` of ``n``'s part of it;
    ``sched`` stepped after each step where given."""
    for step in steps:
        x, y = _batch(step, n)
        if dist:
            x, y = x[r * LOCAL:(r + 1) * LOCAL], y[r * LOCAL:(r + 1) * LOCAL]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("variant", ["horovod", "predivide", "passes", "fp16", "strategy", "strategy-passes"])
def test_distributed_optimizer_matches_one_process(variant):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    ref = _reference(n)

    def make(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if variant.startswith("strategy"):      # passes add up as in Horovod's own path
            return hvd.DistributedOptimizer(sgd, model=model, strategy=DeAR(cap_mb=0.001),
                                            backward_passes_per_step=2 if variant == "strategy-passes" else 1)
        return hvd.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if variant == "fp16" else hvd.Compression.none,
            gradient_predivide_factor=2.0 if variant == "predivide" else 1.0,
            backward_passes_per_step=2 if variant == "passes" else 1)

    model = _train(n, r, make, passes=2 if variant.endswith("passes") else 1)
    tol = 2e-3 if variant == "fp16" else 1e-10
    mine = model.state_dict()          # DeAR: completes the all-gathers that overlap the next forward
    for k, q in ref.state_dict().items():
        torch.testing.assert_close(mine[k], q, rtol=tol, atol=tol)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["adamw", "sgd-wd"])
def test_horovods_resume_with_weight_decay_trains_as_one_process(kind):
    """Horovod's recipe from the first step and on resume: rank 0 alone loads the checkpoint, then
    ``broadcast_parameters`` and ``broadcast_optimizer_state``.  Horovod makes the state of ranks
    that have none with a local step on zero gradients, which decayed the parameters just
    broadcast (AdamW: rank 1 at 0.881 where rank 0 held 0.890) and counted a step one process
    never took; here both runs are one process's."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()

    def make(model):
        if kind == "adamw":
            return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)

    ref = _net()
    _steps(ref, make(ref), r, n, range(STEPS), False)
    model = _net(seed=0 if r == 0 else 1 + r)
    opt = hvd.DistributedOptimizer(make(model), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    _steps(model, opt, r, n, range(STEPS // 2), True)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    model = _net(seed=7 + r)                            # a fresh job: rank 0 alone reads the checkpoint
    opt = hvd.DistributedOptimizer(make(model), named_parameters=model.named_parameters())
    if r == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    _steps(model, opt, r, n, range(STEPS // 2, STEPS), True)
    for k, q in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], q, rtol=1e-12, atol=1e-14)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("change", ["add-group", "unfreeze"])
@pytest.mark.parametrize("variant", ["horovod", "strategy"])
def test_a_layer_that_starts_training_after_wrapping_is_averaged(variant, change):
    """Fine-tuning: the first layer joins at step 1, as a group added at its own rate or unfrozen
    (frozen when wrapped); both must train as one process does, where Horovod keeps them local."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()

    def run(dist: bool) -> torch.nn.Module:
        model = _net(seed=0 if r == 0 or not dist else 1 + r)
        if change == "unfreeze":
            model[0].requires_grad_(False)
        params = model[2].parameters() if change == "add-group" else model.parameters()
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        if dist:
            kw = ({"model": model, "strategy": DeAR(cap_mb=0.001)} if variant == "strategy"
                  else {"named_parameters": model.named_parameters()})
            opt = hvd.DistributedOptimizer(opt, **kw)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for step in range(STEPS):
            x, y = _batch(step, n)
            if dist:
                x, y = x[r * LOCAL:(r + 1) * LOCAL], y[r * LOCAL:(r + 1) * LOCAL]
            if step == 1 and change == "add-group":
                opt.add_param_group({"params": model[0].parameters(), "lr": 0.05})
            if step == 1 and change == "unfreeze":
                model[0].requires_grad_(True)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return model

    mine, ref = run(True).state_dict(), run(False).state_dict()
    for k, q in ref.items():
        torch.testing.assert_close(mine[k], q, rtol=1e-10, atol=1e-10)


@pytest.mark.mpi(min_size=2)
def test_synchronize_skip_and_unused_gradients():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = _batch(0, n)
    out = model(x[r * LOCAL:(r + 1) * LOCAL])
    # rank 0 leaves the last layer out of its loss: its gradient there counts as zero
    (out.sum() * 0 + model[0](x[:LOCAL]).sum() if r == 0 else out.sum()).backward()
    opt.synchronize()
    want = [p.detach() - 0.1 * p.grad for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.detach(), w)
    opt.zero_grad()
    model(x[:1]).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in ws)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["LBFGS", "SGD"])
def test_a_closure_evaluates_as_one_process(kind):
    """``opt.step(closure)``: each evaluation is synchronized before the optimizer reads it and its
    loss averaged (LBFGS compares losses in its line search); Horovod synchronizes before the
    closure runs and updates with local gradients."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        if kind == "LBFGS":
            return torch.optim.LBFGS(model.parameters(), lr=1, max_iter=4, line_search_fn="strong_wolfe")
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def run(model: torch.nn.Module, opt: torch.optim.Optimizer, rows: slice) -> list[float]:
        losses = []
        for step in range(STEPS):
            x, y = (t[rows] for t in _batch(step, n))

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            losses.append(opt.step(closure).item())
        return losses

    ref = _net()
    want = run(ref, make(ref), slice(None))
    model = _net()
    opt = hvd.DistributedOptimizer(make(model), named_parameters=model.named_parameters())
    got = run(model, opt, slice(r * LOCAL, (r + 1) * LOCAL))
    np.testing.assert_allclose(got, want, rtol=1e-10)
    for k, q in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], q, rtol=1e-10, atol=1e-10)


@pytest.mark.mpi(min_size=1)
def test_a_grad_scaler_reaches_the_strategy_optimizer():
    """``grad_scaler=`` beside ``strategy=`` reaches commlib's optimizer: a sparse strategy under a loss
    scale doubling every step trains as without one; without ``strategy=``/``model=`` it is refused."""
    from commlib.sparsify import SparseAllReduce, TopK

    hvd.init()

    def run(scaler):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                       strategy=SparseAllReduce(selector=TopK(0.2)), grad_scaler=scaler)
        g = torch.Generator().manual_seed(hvd.rank())
        for _ in range(5):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    scaled = run(torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=1))
    torch.testing.assert_close(scaled, run(torch.amp.GradScaler("cpu", enabled=False)), rtol=0, atol=0)
    model, scaler = torch.nn.Linear(3, 1), torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="grad_scaler= goes with strategy="):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), grad_scaler=scaler)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("variant", ["horovod", "strategy"])
def test_a_scheduler_made_before_wrapping_trains_as_one_process(variant):
    """Horovod's order of a script that builds optimizer and scheduler first, then wraps and
    broadcasts: the scheduler holds the unwrapped optimizer.  Its patch of ``optimizer.step``
    (torch's check that ``step()`` comes first) was copied onto the wrapper, so ``step()`` updated
    with each rank's own gradient (replicas 1.0 and 2.0 apart after one step of lr 1), and
    ``broadcast_optimizer_state`` gave the wrapper new parameter groups that the scheduler no
    longer reached.  Each step is averaged, the scheduler's rates reach it, and torch does not
    warn that the scheduler stepped first."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()

    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    ref = _net()
    opt, sched = make(ref)
    _steps(ref, opt, r, n, range(STEPS), False, sched)
    model = _net(seed=0 if r == 0 else 1 + r)
    sgd, sched = make(model)
    if variant == "horovod":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    else:
        opt = hvd.DistributedOptimizer(sgd, model=model, strategy=DeAR(cap_mb=0.001))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        _steps(model, opt, r, n, range(STEPS), True, sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * 0.5 ** STEPS)
    for k, q in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], q, rtol=1e-10, atol=1e-12)
