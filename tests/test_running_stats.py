"""Buffers across ranks: plain norm layers' running statistics are rank 0's on every rank after each
step (DistributedOptimizer's ``broadcast_buffers``, DDP's rule), so every rank evaluates the model rank
0 saves, and a checkpoint saved on rank 0 and resumed continues exactly as the uninterrupted run.

References: rank 0's buffers (gathered), and the uninterrupted run, bitwise.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from conftest import HAVE_TORCH, STRATEGIES

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer

    torch.set_num_threads(1)

LOCAL = 4
STEPS = 4


class InputMean(torch.nn.Module if HAVE_TORCH else object):
    """A module with a running average of its own (a VQ codebook's EMA, a feature mean), in Python."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n, dtype=torch.float64))
        self.register_buffer("mask", torch.ones(n, dtype=torch.bool))       # constant: sent under "all"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
        return x * self.mask


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(),
                               InputMean(6), torch.nn.Linear(6, 2)).double()


def batch(comm, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + step)
    x = torch.randn(LOCAL * comm.size, 5, generator=g, dtype=torch.float64) * (1 + step)
    y = torch.randn(LOCAL * comm.size, 2, generator=g, dtype=torch.float64)
    return x.chunk(comm.size)[comm.rank], y.chunk(comm.size)[comm.rank]


def train(comm, model: torch.nn.Module, opt: DistributedOptimizer, steps: range) -> None:
    for step in steps:
        x, y = batch(comm, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def state(model: torch.nn.Module, leave_out: tuple[str, ...] = ()) -> np.ndarray:
    return torch.cat([v.double().reshape(-1) for k, v in model.state_dict().items()
                      if k not in leave_out]).numpy()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
@pytest.mark.parametrize("which", [True, "all", False])
def test_buffers_are_rank_0s_on_every_rank(comm, strategy, which):
    """``True``: the BatchNorm's running statistics (not the module's own average); ``"all"``: every
    buffer; ``False``: none (each rank keeps its slice's statistics, Horovod's rule).  Evaluation then
    gives every rank rank 0's outputs exactly where the statistics are sent."""
    model = make()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                               strategy=STRATEGIES[strategy](), comm=comm, broadcast_buffers=which)
    train(comm, model, opt, range(STEPS))
    model.eval()
    with torch.no_grad():
        out = model(torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(3, 5)).numpy()
    bn, own = model[1], model[3]
    table = comm.allgather_object((bn.running_mean.numpy(), bn.running_var.numpy(),
                                   int(bn.num_batches_tracked), own.mean.numpy(), out))
    for r in range(1, comm.size):
        bn_same = all(np.array_equal(a, b) for a, b in zip(table[r][:3], table[0][:3]))
        assert bn_same == (which is not False), r
        assert np.array_equal(table[r][3], table[0][3]) == (which == "all"), r
        assert np.array_equal(table[r][4], table[0][4]) == (which is not False), r     # eval outputs
        assert table[r][2] == STEPS


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["selsync0", "syncswitch-bsp"])
def test_strategies_whose_replicas_drift_keep_their_buffers(comm, strategy):
    """SelSync and Sync-Switch let replicas drift between synchronizations (ASP's ranks do not even
    step together): a broadcast at every step would hold them in step, so nothing is sent."""
    model = make()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               strategy=STRATEGIES[strategy](), comm=comm, broadcast_buffers="all")
    train(comm, model, opt, range(STEPS))
    table = comm.allgather_object(model[1].running_mean.numpy())
    assert not any(np.array_equal(table[r], table[0]) for r in range(1, comm.size))
    if hasattr(opt.strategy, "close"):
        opt.strategy.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
@pytest.mark.parametrize("which", [True, "all"])
def test_a_checkpoint_saved_on_rank_0_resumes_as_the_uninterrupted_run(comm, strategy, which):
    """Horovod's checkpoint: rank 0 saves, every rank loads its file.  Without the running statistics
    sent, the other ranks' statistics became rank 0's at the resume only, so the resumed run left
    them elsewhere than the uninterrupted one (0.014 off at 2 ranks).  A module's own running
    average is sent under ``"all"`` only: under ``True`` it is left out of the comparison."""
    leave_out = ("3.mean",) if which is True else ()

    def wrap(model: torch.nn.Module) -> DistributedOptimizer:
        return DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), model,
                                    strategy=STRATEGIES[strategy](), comm=comm, broadcast_buffers=which)

    model = make()
    opt = wrap(model)
    train(comm, model, opt, range(STEPS))
    want = state(model, leave_out)

    model = make()
    opt = wrap(model)
    train(comm, model, opt, range(STEPS // 2))
    ckpt = {"model": model.state_dict(), "opt": opt.state_dict()}      # every rank (DeAR: a collective)
    blob = io.BytesIO()
    if comm.rank == 0:
        torch.save(ckpt, blob)
    blob = io.BytesIO(comm.mpi_comm.bcast(blob.getvalue(), root=0))   # every rank reads rank 0's file
    model = make()
    opt = wrap(model)
    ckpt = torch.load(blob)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    train(comm, model, opt, range(STEPS // 2, STEPS))
    np.testing.assert_array_equal(state(model, leave_out), want)


@pytest.mark.mpi
def test_a_bad_choice_raises_before_any_collective(comm):
    model = make()
    before = comm.seq
    with pytest.raises(ValueError, match="broadcast_buffers 'some'"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                             broadcast_buffers="some")
    assert comm.seq == before


@pytest.mark.mpi(min_size=2)
def test_buffers_of_any_dtype_reach_every_rank(comm):
    """A bool mask or a uint8 buffer made wrapping fail ("dtype bool is not supported") after the
    first broadcasts had run, aborting the communicator; they travel widened now, complex ones as
    real pairs, at wrapping and under ``broadcast_buffers="all"``."""
    model = torch.nn.Linear(3, 2)
    kinds = {"mask": torch.bool, "codes": torch.uint8, "small": torch.int16, "phase": torch.complex64,
             "scale": torch.float16}

    def fill(salt: int) -> None:
        for name, dtype in kinds.items():
            values = (torch.arange(6) + salt) % 5
            setattr(model, name, (values > 1 if dtype == torch.bool else values.to(dtype)).reshape(2, 3))

    for name in kinds:
        model.register_buffer(name, torch.zeros(2, 3))
    fill(comm.rank)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                               broadcast_buffers="all")
    theirs = {k: v.clone() for k, v in model.named_buffers()}
    fill(10 + comm.rank)                        # changed after wrapping: sent at the next step
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    now = {k: v.clone() for k, v in model.named_buffers()}
    fill(0)
    for k, v in model.named_buffers():
        assert now[k].dtype == v.dtype == kinds[k]
        assert torch.equal(theirs[k], v), k      # rank 0's at wrapping
    fill(10)
    for k, v in model.named_buffers():
        assert torch.equal(now[k], v), k         # rank 0's after the step
