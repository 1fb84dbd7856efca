"""A sparse strategy's state where the buckets change under it, through the torch binding: a
checkpoint of another world size (buckets padded to another multiple) and a re-plan (a layer frozen,
a group added, another cap), whose residuals and selectors carry over."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.sparsify import ExDyna, SparseAllReduce

from conftest import HAVE_TORCH


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_a_checkpoint_of_another_world_size_loads_through_the_binding(comm):
    """A model of 15 elements: its bucket pads to 15 on one rank, 16 on 2 or 4.  A state saved on
    one rank refused to load on more ("state of buckets [(15, ...)] given to buckets [(16, ...)]",
    after the optimizer's momentum had loaded): the elements are compared, not the padding, and
    the step and threshold carry over, as the docstring says."""
    torch = pytest.importorskip("torch")
    binding = pytest.importorskip("commlib.bindings.torch")

    def make(c):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).double()
        opt = binding.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                           strategy=SparseAllReduce(selector=ExDyna(0.2)), comm=c)
        return model, opt

    def train(model, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(5, 4, generator=g, dtype=torch.float64)).pow(2).mean().backward()
            opt.step()

    alone = comm.split(color=comm.rank)
    model, opt = make(alone)
    train(model, opt, 3, 0)         # alike on every rank: the checkpoint every rank loads
    saved = opt.state_dict()
    saved_sel = opt.strategy.selectors[0]
    assert opt.strategy.buckets[0].padded == 15
    alone.close()
    model2, opt2 = make(comm)
    assert opt2.strategy.buckets[0].padded == 16
    model2.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match="partition boundaries from the start"):
        opt2.load_state_dict(saved)
    sel = opt2.strategy.selectors[0]
    assert sel.step == saved_sel.step == 3 and sel.threshold == saved_sel.threshold is not None
    assert opt2.strategy.steps == 3 and not opt2.strategy.feedback[0].residual.any()
    train(model2, opt2, 2, comm.rank)
    assert sel.step == 5
    w = comm.allgather(model2.weight.detach().numpy().copy())
    assert (w == w[0]).all()


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("how", ["freeze", "add_param_group", "cap"])
def test_a_replan_carries_residuals_and_selectors_over(comm, how):
    """A re-plan (a layer frozen, a group added, another cap) kept no residual and restarted every
    selector (ExDyna's threshold estimated again): the unsent gradient of the parameters that go
    on training was lost, silently.  Each residual now moves with its parameter, a new parameter
    starts from zero, and the selectors continue their step and threshold."""
    torch = pytest.importorskip("torch")
    binding = pytest.importorskip("commlib.bindings.torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    model[4].requires_grad_(how != "add_param_group")
    opt = binding.DistributedOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), model,
        strategy=SparseAllReduce(selector=ExDyna(0.1)), comm=comm)
    gen = torch.Generator().manual_seed(comm.rank)

    def step():
        opt.zero_grad()
        model(torch.randn(4, 6, generator=gen, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()

    def residuals() -> dict[int, np.ndarray]:
        fb = opt.strategy.feedback
        return {id(opt._params[sl.index]): fb[b.index].residual[sl.offset:sl.offset + sl.numel].copy()
                for b in opt.buckets for sl in b.slots}

    for _ in range(3):
        step()
    before, (sel,) = residuals(), opt.strategy.selectors
    if how == "freeze":
        model[0].requires_grad_(False)
        opt.replan()
    elif how == "add_param_group":
        model[4].requires_grad_(True)
        opt.add_param_group({"params": list(model[4].parameters()), "lr": 0.05})
    else:
        opt.replan(cap_bytes=256)           # a bucket per tensor or two
    after = residuals()
    assert len(opt.strategy.selectors) == len(opt.buckets) > (1 if how == "cap" else 0)
    kept = [k for k in after if k in before]
    assert kept and any(before[k].any() for k in kept)
    for k, r in after.items():
        np.testing.assert_array_equal(r, before[k] if k in before else np.zeros_like(r))
    for b, s in zip(opt.buckets, opt.strategy.selectors):     # a bucket of the new group only: afresh
        carried = any(id(opt._params[sl.index]) in before for sl in b.slots)
        assert (s.step, s.threshold) == ((sel.step, sel.threshold) if carried else (0, None))
    assert sel.step == 3 and sel.threshold is not None
    step()                                  # trains on, alike on every rank
    w = comm.allgather(model[2].weight.detach().numpy().copy())
    assert (w == w[0]).all()
