"""Uneven inputs through ``DistributedOptimizer.join``, against one process on the batches the ranks had.

Rank ``r`` holds its own number of batches; each step's reference is plain torch on the concatenation
of the batches the ranks still had at that step (the repeats count for nothing), with the same loop:
a GradScaler, clipping and a logged all-reduce of the loss inside it, accumulation over passes where
a rank runs out mid-step, ``SyncBatchNorm`` (statistics of the ranks that had a batch), DDP's
``divide_by_initial_world_size``, and a loop left with ``break`` on every rank then trained on
without ``join``.  Parameters and optimizer state must match the reference and be the same on every
rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import commlib

from conftest import HAVE_TORCH, assert_same_on_every_rank

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer, SyncBatchNorm
    from commlib.collectives import AllReduce, DeAR, SelSync

    torch.set_num_threads(1)

LOCAL = 4           # samples per batch
MOST = 6            # batches of the rank that has the most (even: the accumulation steps end whole)
PATTERNS = ["plain", "scaler-clip-metric", "accumulate", "syncbn", "divide-initial", "break", "routed-head"]
STRATEGIES = {"allreduce": AllReduce, "dear": lambda: DeAR(cap_mb=0.0002)} if HAVE_TORCH else {}


def batches_of(rank: int, size: int, pattern: str) -> int:
    """Rank 0 runs out first with SyncBatchNorm (its running statistics are then another's), last else."""
    return MOST - (size - 1 - rank if pattern == "syncbn" else rank)


def data(rank: int, t: int, routed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch, and which of its samples take the head (``routed``: all of them)."""
    g = torch.Generator().manual_seed(1000 + 17 * t + rank)
    return (torch.randn(LOCAL, 6, generator=g), torch.randn(LOCAL, 3, generator=g),
            torch.full((LOCAL,), routed))


def batches(rank: int, size: int, pattern: str) -> list:
    """Rank ``rank``'s loader; ``routed-head``: the last rank's last batch (repeated after) takes the head."""
    n = batches_of(rank, size, pattern)
    return [data(rank, t, pattern == "routed-head" and rank == size - 1 and t == n - 1) for t in range(n)]


class Net(torch.nn.Module if HAVE_TORCH else object):
    def __init__(self, pattern: str):
        super().__init__()
        torch.manual_seed(3)
        self.fc1 = torch.nn.Linear(6, 8)
        self.norm = torch.nn.BatchNorm1d(8) if pattern == "syncbn" else torch.nn.Identity()
        self.fc2 = torch.nn.Linear(8, 3)
        self.head = torch.nn.Linear(8, 3)       # reached by routed samples only

    def forward(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.fc1(x)))
        out = self.fc2(h)
        if routed.any():       # not reached at all otherwise: .grad stays None, as one process's
            out = out + routed[:, None] * self.head(h)
        return out


def make(pattern: str) -> torch.nn.Module:
    return Net(pattern)


def train_ranks(comm: commlib.Communicator, strategy: str, pattern: str) -> tuple[Any, Any, list[float]]:
    model = make(pattern)
    if pattern == "syncbn":
        model = SyncBatchNorm.convert_sync_batchnorm(model, comm)
    passes = 2 if pattern == "accumulate" else 1
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    opt = DistributedOptimizer(base, model, strategy=STRATEGIES[strategy](), comm=comm,
                               backward_passes_per_step=passes, find_unused_parameters=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=pattern == "scaler-clip-metric")
    logged = []
    loader = batches(comm.rank, comm.size, pattern)
    for i, (x, y, m) in enumerate(opt.join(loader, divide_by_initial_world_size=pattern == "divide-initial")):
        if pattern == "break" and i == MOST - 1:
            break
        loss = torch.nn.functional.mse_loss(model(x, m), y) / passes
        scaler.scale(loss).backward()
        if pattern == "scaler-clip-metric":     # a collective of the user's own, met by the repeating ranks
            mine = [0.0, 0.0] if opt.repeating else [loss.item(), 1.0]
            total = comm.allreduce(np.array(mine))
            logged.append(total[0] / total[1])
            scaler.unscale_(opt)
            opt.clip_grad_norm_(0.05)
        if (i + 1) % passes == 0:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert not opt.repeating
    if pattern == "break":      # on without join: every rank has this batch
        x, y, m = data(comm.rank, 100)
        torch.nn.functional.mse_loss(model(x, m), y).backward()
        opt.step()
    return model, opt, logged


def train_reference(size: int, pattern: str) -> tuple[Any, Any, list[float]]:
    model = make(pattern)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    loaders = [batches(r, size, pattern) for r in range(size)]
    passes = 2 if pattern == "accumulate" else 1
    steps = (MOST - 1 if pattern == "break" else MOST) // passes
    logged = []
    for s in range(steps):
        ts = range(s * passes, (s + 1) * passes)
        parts = [loaders[r][t] for t in ts for r in range(size) if t < len(loaders[r])]
        x, y, m = (torch.cat([p[k] for p in parts]) for k in range(3))
        loss = torch.nn.functional.mse_loss(model(x, m), y)
        logged.append(loss.item())
        if pattern == "divide-initial":      # DDP's default: the repeats' zeros in the average
            loss = loss * len(parts) / (size * passes)
        opt.zero_grad()
        loss.backward()
        if pattern == "scaler-clip-metric":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    if pattern == "break":
        x, y, m = (torch.cat([data(r, 100)[k] for r in range(size)]) for k in range(3))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x, m), y).backward()
        opt.step()
    return model, opt, logged


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([v.reshape(-1).double() for v in model.state_dict().values()]).numpy()


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_uneven_inputs_train_as_one_process_on_the_batches_there_were(comm, strategy, pattern):
    model, opt, logged = train_ranks(comm, strategy, pattern)
    ref, ref_opt, ref_logged = train_reference(comm.size, pattern)
    vec = flat(model)
    assert_same_on_every_rank(comm, vec)
    np.testing.assert_allclose(vec, flat(ref), rtol=2e-5, atol=2e-6)
    state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sorted(state) == sorted(ref_state)
    for i, want in ref_state.items():
        np.testing.assert_allclose(state[i]["momentum_buffer"].numpy(), want["momentum_buffer"].numpy(),
                                   rtol=2e-5, atol=2e-6, err_msg=f"param {i}")
    if pattern == "scaler-clip-metric":
        np.testing.assert_allclose(logged, ref_logged, rtol=1e-5)


@pytest.mark.mpi
def test_join_refusals_raise_on_every_rank(comm):
    model = make("plain")
    selsync = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=SelSync(),
                                   comm=comm, find_unused_parameters=True)
    with pytest.raises(ValueError, match="selsync does not average"):
        selsync.join([data(comm.rank, 0)])
    selsync.close()

    model = make("plain")
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)       # the body trains outside the optimizer
    opt = DistributedOptimizer(head, model, comm=comm, find_unused_parameters=True)
    with pytest.raises(ValueError, match="4 parameters of the model outside the optimizer"):
        opt.join([data(comm.rank, 0)])
    opt.close()

    model = make("plain")
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                               find_unused_parameters=True)
    if comm.size > 1:
        empty = [] if comm.rank == comm.size - 1 else [data(comm.rank, 0)]
        with pytest.raises(ValueError, match=f"ranks \\[{comm.size - 1}\\] got no batch at all"):
            for _ in opt.join(empty):
                pass
    with pytest.raises(ValueError, match="closure"):
        for x, y, m in opt.join([data(comm.rank, 0)]):
            opt.step(lambda x=x, y=y, m=m: torch.nn.functional.mse_loss(model(x, m), y))
    for _ in opt.join([]):      # every rank empty: nothing to train on, nothing raised
        raise AssertionError("no batch to yield")
    x, y, m = data(comm.rank, 1)    # the optimizer trains on as before
    torch.nn.functional.mse_loss(model(x, m), y).backward()
    opt.step()
    assert_same_on_every_rank(comm, flat(model))
    opt.close()


def test_join_on_one_rank_yields_the_loader():
    comm = commlib.init()
    if comm.size != 1:
        pytest.skip("one process")
    model = make("plain")
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                               find_unused_parameters=True)
    loader = [data(0, t) for t in range(3)]
    seen = [x for x, _, _ in opt.join(loader)]
    assert len(seen) == 3
    assert all(a is b[0] for a, b in zip(seen, loader, strict=True))
    assert not opt.repeating
    opt.close()


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_running_statistics_come_from_a_rank_that_had_a_batch(comm, strategy):
    """Plain BatchNorm on the input (statistics of the data alone): every rank ends with those of the
    lowest rank that had each batch, never of a repeat (rank 0 runs out first)."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
    ref = torch.nn.BatchNorm1d(6)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               strategy=STRATEGIES[strategy](), comm=comm)
    counts = [2 if r == 0 else MOST for r in range(comm.size)]
    for x, y, _ in opt.join([data(comm.rank, t) for t in range(counts[comm.rank])]):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for t in range(max(counts)):
        ref(data(min(r for r in range(comm.size) if t < counts[r]), t)[0])
    for name in ("running_mean", "running_var"):
        got = getattr(model[0], name).numpy()
        assert_same_on_every_rank(comm, got)
        np.testing.assert_allclose(got, getattr(ref, name).numpy(), rtol=1e-6, err_msg=name)
    opt.close()
