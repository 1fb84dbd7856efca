"""bindings.torch: what DistributedOptimizer refuses, and how: the same clear error on every rank,
raised before any rank enters a collective (at most the one agreement all-gather ran), the model
left as it was."""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import HAVE_TORCH, SMALL, Lookahead

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.collectives import AllReduce, DeAR
    from commlib.errors import ValidationError
    from commlib.sparsify import ExDyna

    torch.set_num_threads(1)


@pytest.mark.mpi
def test_tuning_without_its_package_raises_on_every_rank_at_construction(comm, monkeypatch):
    """Seen on a GPU machine without the tune extra: rank 0 raised ImportError mid-training while
    its peers waited in the tuner's broadcast (a 120 s timeout).  Every rank now raises at
    construction, before the first step."""
    monkeypatch.setitem(__import__("sys").modules, "bayes_opt", None)    # import fails as if missing
    model = torch.nn.Linear(8, 4)
    with pytest.raises(ImportError, match="bayesian-optimization"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                             strategy=DeAR(tune={"trials": 2}), comm=comm)
    assert float(comm.allreduce(np.ones(1))[0]) == comm.size


@pytest.mark.mpi(min_size=2)
def test_different_models_raise_on_every_rank(comm):
    model = torch.nn.Linear(8, 16 + (comm.rank == comm.size - 1))     # the last rank's differs
    before = comm.seq
    with pytest.raises(ValidationError, match="differs across ranks"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=DeAR(), comm=comm)
    assert comm.seq == before + 1       # only the agreement check ran: no collective was left half-called


@pytest.mark.mpi(min_size=2)
def test_different_settings_are_named_as_such(comm):
    """Only the strategy differs (a DeAR cap on the last rank): the message said "the tensor list
    differs (rank 0: 2 tensors, 144 elements, rank 1: 2 tensors, 144 elements)", the settings past
    its 300 characters.  The summaries now say which part differs and the rank's text starts with
    its settings, and the message names the first setting that differs."""
    model = torch.nn.Linear(8, 16)
    cap = 1.0 if comm.rank == comm.size - 1 else 2.0
    with pytest.raises(ValidationError) as err:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=DeAR(cap_mb=cap),
                             comm=comm)
    msg = str(err.value)
    assert "the tensor list or settings differs across ranks" in msg, msg
    tensors = set(re.findall(r"2 tensors, 144 elements \(#(\w+)\)", msg))
    settings = re.findall(r"settings #(\w+)", msg)
    assert len(tensors) == 1 and len(set(settings)) == 2, msg
    assert f"rank {comm.rank} has settings groups [0, 0]|strategy DeAR(cap_mb={cap!r}" in msg, msg
    # every rank names the setting that differs (it used to show digests, and its own settings only)
    assert (f"rank 0 has 'strategy DeAR(cap_mb=2.0' where rank {comm.size - 1} has "
            f"'strategy DeAR(cap_mb=1.0'") in msg, msg


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cap", ["first_cap_mb", "last_cap_mb", "cap_mb"])
def test_caps_that_differ_across_ranks_raise_at_wrapping(comm, cap):
    """The strategy's repr showed ``cap_mb`` alone, rounded: a first or last cap differing on one rank
    passed the wrap and the first step died in MPI (buckets planned apart met other collectives)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    value = {"first_cap_mb": 0.001, "last_cap_mb": 0.001, "cap_mb": 0.0010001}[cap]
    strategy = AllReduce(**{cap: value * (2 if comm.rank == comm.size - 1 else 1)})
    with pytest.raises(ValidationError, match="settings differs across ranks"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=strategy, comm=comm)
    assert float(comm.allreduce(np.ones(1))[0]) == comm.size


@pytest.mark.mpi
def test_uninitialized_lazy_module_raises_on_every_rank(comm):
    """A Lazy module on the last rank: every rank raises, naming it, before any collective."""
    lazy = comm.rank == comm.size - 1
    first = torch.nn.LazyLinear(4) if lazy else torch.nn.Linear(6, 4)
    model = torch.nn.Sequential(first, torch.nn.Linear(4, 3))
    before = comm.seq
    with pytest.raises(ValidationError, match=f"rank {comm.size - 1} rejected.*2 parameters are uninit"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm)
    assert comm.seq == before + 1
    lazy = torch.nn.LazyLinear(4)      # nothing but lazy parameters: the reason is theirs alone
    with pytest.raises(ValidationError, match="2 parameters are uninit") as err:
        DistributedOptimizer(torch.optim.SGD(lazy.parameters(), lr=0.1), lazy, comm=comm)
    assert "requires a gradient" not in str(err.value)


@pytest.mark.mpi
def test_bad_arguments(comm):
    model = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                             backward_passes_per_step=0)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        opt.set_backward_passes_per_step(1.5)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        DistributedOptimizer(object(), model, comm=comm)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DistributedOptimizer: expected a commlib.collectives Strategy .* "
                                        r"got ExDyna \(a gradient selector goes in"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                             strategy=ExDyna(density=0.1))     # was an AttributeError from inside
    with pytest.raises(TypeError, match="grad_scaler: expected a torch.amp.GradScaler, got str"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm, grad_scaler="x")


@pytest.mark.mpi(min_size=2)
def test_layouts_differing_across_ranks_or_with_gaps_raise_on_every_rank(comm):
    """Buckets are averaged element for element in memory order: the last rank's channels_last
    model against the others' contiguous one would mix elements, so every rank refuses; so does
    a parameter with gaps (a strided slice), which cannot live in a bucket as it is."""
    conv = torch.nn.Conv2d(3, 4, 3)
    if comm.rank == comm.size - 1:
        conv.to(memory_format=torch.channels_last)
    with pytest.raises(ValidationError, match=f"rank {comm.size - 1}.*differ|differ.*rank {comm.size - 1}"):
        DistributedOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), conv, comm=comm)
    gappy = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4, 6)[:, ::2])])
    with pytest.raises(ValidationError, match=r"has gaps or overlaps \(strides \(6, 2\)\)"):
        DistributedOptimizer(torch.optim.SGD(gappy.parameters(), lr=0.1), gappy, comm=comm)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["LBFGS", "Adafactor", "Muon"])
def test_sharded_strategies_refuse_whole_tensor_optimizers(comm, kind):
    """DeAR updates flat shards: an optimizer that needs whole parameters ran silently wrong
    (Adafactor, unfactored on shards: 4e-3 off one process after 4 steps) or failed inside the
    shard optimizer (Muon: "only supports 2D parameters"); refused on every rank, AllReduce kept."""
    if not hasattr(torch.optim, kind):
        pytest.skip(f"torch.optim.{kind} is newer than this torch")
    model = torch.nn.Linear(8, 4, bias=False)        # matrices only, as Muon requires
    make = getattr(torch.optim, kind)
    with pytest.raises(ValidationError, match=f"{kind} is not elementwise"):
        DistributedOptimizer(make(model.parameters(), lr=0.01), model, strategy=DeAR(), comm=comm)
    DistributedOptimizer(make(model.parameters(), lr=0.01), model, strategy=AllReduce(), comm=comm)


@pytest.mark.mpi
def test_an_optimizer_that_wraps_another_is_refused_naming_the_way_around(comm):
    """DeAR makes the optimizer's class over the shards: ``Lookahead(base)`` cannot be made so and
    failed with ``AttributeError: 'list' object has no attribute 'param_groups'``; now refused on
    every rank, saying to put it around (``test_param_reads`` trains it so)."""
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValidationError, match=r"Lookahead cannot be made from parameter groups.*goes around "
                                              r"DistributedOptimizer: Lookahead\(DistributedOptimizer\("):
        DistributedOptimizer(Lookahead(torch.optim.SGD(model.parameters(), lr=0.1)), model, strategy=DeAR(),
                             comm=comm)
    DistributedOptimizer(Lookahead(torch.optim.SGD(model.parameters(), lr=0.1)), model, comm=comm)


@pytest.mark.mpi
def test_sparse_adam_is_refused_on_every_rank(comm):
    """Gradients are averaged in dense buckets: SparseAdam failed at the first step (torch's "does
    not support dense gradients"); now refused when wrapping, before any collective."""
    model = torch.nn.Embedding(20, 8, sparse=True)
    before = comm.seq
    with pytest.raises(ValidationError, match="SparseAdam needs sparse gradients.*use Adam"):
        DistributedOptimizer(torch.optim.SparseAdam(model.parameters(), lr=0.01), model, comm=comm)
    assert comm.seq == before + 1            # the agreement only


class Lamb(torch.optim.Optimizer if HAVE_TORCH else object):
    """LAMB as large-batch training writes it (You et al. 2019; timm's, apex's): Adam's step
    scaled per parameter tensor by the trust ratio ||w|| / ||update||."""

    def __init__(self, params, lr: float = 1e-2, betas: tuple = (0.9, 0.999), eps: float = 1e-6):  # noqa: ANN001
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat, v_hat = st["m"] / (1 - b1 ** st["step"]), st["v"] / (1 - b2 ** st["step"])
                update = m_hat / (v_hat.sqrt() + g["eps"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-g["lr"] * float(trust))
        return loss


@pytest.mark.mpi
def test_an_optimizer_that_is_not_elementwise_is_refused_whatever_its_class(comm):
    """DeAR runs the optimizer on each rank's flat pieces of the buckets: LAMB's trust ratio on a
    piece is not the tensor's, and the update was silently wrong (seen with pytorch-optimizer's
    Lamb, LARS, Shampoo, SOAP, CAME, Kron, Prodigy and D-Adaptation as with torch's Adafactor).
    The class is tried on a small problem, not looked up: refused on every rank, naming it."""
    model = torch.nn.Linear(8, 4)
    before = comm.seq
    with pytest.raises(ValidationError, match=r"Lamb is not elementwise \(its update of an element depends "
                                              r"on others.*use AllReduce"):
        DistributedOptimizer(Lamb(model.parameters()), model, strategy=DeAR(), comm=comm)
    assert comm.seq == before + 1            # the agreement only
    DistributedOptimizer(Lamb(model.parameters()), model, strategy=AllReduce(), comm=comm)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam",
                                  "RAdam", "ASGD", "Rprop"])
def test_elementwise_optimizers_train_on_shards_as_one_process(comm, kind):
    """torch's elementwise optimizers pass the trial and, run on DeAR's shards, train as one process."""
    def run(dist: bool) -> np.ndarray:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).double()
        opt = getattr(torch.optim, kind)(model.parameters(), lr=0.05)
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=DeAR(**SMALL), comm=comm)
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            x = torch.randn(3 * comm.size, 5, generator=g, dtype=torch.float64)
            y = torch.randn(3 * comm.size, 2, generator=g, dtype=torch.float64)
            if dist:
                x, y = x.chunk(comm.size)[comm.rank], y.chunk(comm.size)[comm.rank]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return torch.cat([v.reshape(-1) for v in model.state_dict().values()]).numpy()

    np.testing.assert_allclose(run(True), run(False), rtol=1e-9, atol=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["allreduce", "sparse"])
def test_one_strategy_for_two_optimizers_is_refused(comm, kind):
    """A GAN's two models, each its own optimizer, given one strategy object: the strategy held the
    second optimizer's buckets, so the first one's gradients were never averaged (2e-1 from one
    process after 4 steps, replicas apart), silently.  Refused at the second construction; a
    strategy whose optimizer was closed, or that a replacement over the same parameters takes
    over, drives again."""
    from commlib.sparsify import SparseAllReduce

    shared = AllReduce() if kind == "allreduce" else SparseAllReduce(selector=ExDyna(0.5))
    g, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt_g = DistributedOptimizer(torch.optim.SGD(g.parameters(), lr=0.1), g, strategy=shared, comm=comm)
    with pytest.raises(ValueError, match="already drives another DistributedOptimizer"):
        DistributedOptimizer(torch.optim.SGD(d.parameters(), lr=0.1), d, strategy=shared, comm=comm)
    again = DistributedOptimizer(torch.optim.Adam(g.parameters(), lr=0.1), g, strategy=shared, comm=comm)
    again.close()                            # replaced opt_g, over the same parameters
    assert opt_g._retired_by
    opt_d = DistributedOptimizer(torch.optim.SGD(d.parameters(), lr=0.1), d, strategy=shared, comm=comm)
    opt_d.zero_grad()
    d(torch.full((2, 4), float(comm.rank))).sum().backward()
    opt_d.step()
    if kind == "allreduce":                  # the average over ranks of 2 * rank
        np.testing.assert_allclose(d.weight.grad.numpy(), np.full((1, 4), comm.size - 1.0))
    w = comm.allgather(d.weight.detach().numpy().copy())
    assert (w == w[0]).all()
    opt_d.close()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_syncswitch_refuses_16_bit_parameters_on_every_rank(comm, dtype):
    """Sync-Switch's asynchronous phases keep the parameters in a one-sided store of 32/64-bit
    floats (MPI accumulates no 16-bit float): a bfloat16 layer raised numpy's ``TypeError`` at
    wrapping, a float16 one trained in BSP and raised at the first switch to ASP."""
    from commlib.collectives import SyncSwitch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).to(getattr(torch, dtype)))
    with pytest.raises(ValidationError, match=f"parameters of dtype {dtype}: its ASP and SSP phases"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=SyncSwitch(),
                             comm=comm)
    assert float(comm.allreduce(np.ones(1))[0]) == comm.size


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["dear", "syncswitch"])
def test_a_refused_load_changes_nothing(comm, strategy):
    """A checkpoint of another strategy, or of another model, is refused before anything of it is
    loaded, as torch refuses a load: DeAR took the optimizer's moments, then refused the strategy's
    part (another model's: a bare size error after its state was cleared); SyncSwitch raised
    ``KeyError: 'phase'`` on a DeAR checkpoint."""
    from commlib.collectives import SyncSwitch

    def trained(hidden: int, make):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))
        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), model, strategy=make(),
                                   comm=comm)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).square().mean().backward()
            opt.step()
        return opt

    ours = trained(5, DeAR if strategy == "dear" else SyncSwitch)
    before = ours.state_dict()
    wrong = [(trained(5, AllReduce if strategy == "dear" else DeAR), "state of strategy")]
    if strategy == "dear":      # pieces of another size (whole, torch takes them: its step fails)
        wrong.append((trained(7, DeAR), "shape (7, 4) but the parameter (5, 4)"))
    for other, why in wrong:
        with pytest.raises(ValueError, match=re.escape(why)):
            ours.load_state_dict(other.state_dict())
        other.close()
    after = ours.state_dict()
    for i, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    assert after["commlib"]["strategy"]["steps"] == before["commlib"]["strategy"]["steps"]
    ours.close()


@pytest.mark.mpi
def test_pickling_or_copying_the_optimizer_is_refused(comm):
    """``torch.save(opt)`` and ``copy.deepcopy(opt)`` succeeded and gave back an object whose
    every method failed (no ``_inner``), with DeAR's moments missing from the file."""
    import copy
    import io

    model = torch.nn.Linear(4, 2)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), model, strategy=DeAR(),
                               comm=comm)
    opt.zero_grad()
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    for make in (lambda: torch.save(opt, io.BytesIO()), lambda: copy.deepcopy(opt)):
        with pytest.raises(TypeError, match=r"save opt.state_dict\(\)"):
            make()
    assert set(opt.state_dict()["state"]) == {0, 1}
    opt.close()
