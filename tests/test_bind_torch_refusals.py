"""bindings.torch: what DistributedOptimizer refuses, and how: the same clear error on every rank,
raised before any rank enters a collective (at most the one agreement all-gather ran), the model
left as it was."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.collectives import AllReduce, DeAR
    from commlib.errors import ValidationError

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
def test_sparse_adam_is_refused_on_every_rank(comm):
    """Gradients are averaged in dense buckets: SparseAdam failed at the first step (torch's "does
    not support dense gradients"); now refused when wrapping, before any collective."""
    model = torch.nn.Embedding(20, 8, sparse=True)
    before = comm.seq
    with pytest.raises(ValidationError, match="SparseAdam needs sparse gradients.*use Adam"):
        DistributedOptimizer(torch.optim.SparseAdam(model.parameters(), lr=0.01), model, comm=comm)
    assert comm.seq == before + 1            # the agreement only
