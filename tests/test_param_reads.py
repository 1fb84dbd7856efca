"""Parameters read or written between a step and the forward that waits for them.

After a DeAR step the parameters' all-gathers overlap the next forward, and a module waits
for its own bucket.  Until a parameter whose bucket is in flight waited for it whenever its
values are used (``bindings/torch_params.py``), these read stale shards, silently: a module
that reads a child's weight without running the child (``nn.MultiheadAttention``'s
``out_proj``, inside every ``nn.TransformerEncoderLayer``), a pre-hook of the model's own that
runs before the wait (pruning's mask, the old ``weight_norm``), ``Lookahead`` around the
optimizer, and an EMA or weight clipping after ``step()`` (patterns ``ema`` and ``weight-clip``
in ``test_train_loops.py``), which also raced with the gathers.  Each result is checked against
one process training on the concatenated batch.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

from conftest import (
    HAVE_TORCH,
    SMALL,
    STRATEGIES,
    Lookahead,
    assert_same_on_every_rank,
    rank_part,
    ranks_at_most,
)

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch
    import torch.nn.utils.prune

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.bindings.torch_params import InFlightParameter
    from commlib.collectives import DeAR, SelSync, SyncSwitch

    torch.set_num_threads(1)

LOCAL = 3          # sequences per rank per step
STEPS = 4

#: DeAR under the gate too, and the gate's parameter averages (in flight after a step as well; linear
#: in the update, so at delta 0 with SGD they train as one process)
WITH_DEAR = dict(STRATEGIES, **{
    "selsync0-dear": lambda: SelSync(inner=DeAR(**SMALL), delta=0.0, mode="grads"),
    "selsync0-params": lambda: SelSync(inner=STRATEGIES["allreduce"](), delta=0.0, mode="params"),
})


class Encoder(torch.nn.Module if HAVE_TORCH else object):
    """A transformer encoder layer between two linear layers; no dropout."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(5, 16)
        self.layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=24, dropout=0.0,
                                                      batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(x)).mean(1))


def data(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(LOCAL * size, 4, 5, generator=g), torch.randn(LOCAL * size, 3, generator=g)


def params_of(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([v.reshape(-1) for v in model.state_dict().values()]).double().numpy()


def fit(comm, opt, forward, x: torch.Tensor, y: torch.Tensor, dist: bool) -> None:
    """One step on this rank's part of the global batch ``x, y`` (``dist``), or on all of it."""
    if dist:
        x, y = rank_part(comm, len(x) // comm.size, x, y)
    opt.zero_grad()
    torch.nn.functional.mse_loss(forward(x), y).backward()
    opt.step()


def train_encoder(comm, strategy: str | None, compiled: bool = False, graphs: list | None = None,
                  lookahead: bool = False) -> np.ndarray:
    """``strategy=None``: one process on the whole batch; ``graphs`` gets the number of graphs Dynamo
    compiled so far after each step; ``lookahead``: :class:`conftest.Lookahead` around the optimizer."""
    torch.manual_seed(comm.rank if strategy else 0)
    model = Encoder()
    # SGD: the key projection's bias gets a zero gradient up to rounding (softmax ignores it), which
    # Adam would turn into a full step of either sign
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if strategy:
        opt = DistributedOptimizer(opt, model, strategy=WITH_DEAR[strategy](), comm=comm)
    dist = opt
    if lookahead:
        opt = Lookahead(opt)
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    for step in range(STEPS):
        fit(comm, opt, forward, *data(step, comm.size), dist=bool(strategy))
        if graphs is not None:
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    if isinstance(dist, DistributedOptimizer) and isinstance(dist.strategy, SyncSwitch):
        dist.strategy.close()
    return params_of(model)


def check_as_one_process(comm, vec: np.ndarray, ref: np.ndarray) -> None:
    assert_same_on_every_rank(comm, vec)
    np.testing.assert_allclose(vec, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", list(WITH_DEAR))
def test_a_transformer_layer_trains_as_one_process(comm, strategy):
    """``nn.MultiheadAttention`` passes ``out_proj.weight`` to its functional form without running
    ``out_proj``, whose bucket's all-gather nothing waited for: DeAR was 1.35e-3 off one process
    in a probe (Linear, attention, Linear; 5 steps, 2 ranks), rank to rank alike."""
    check_as_one_process(comm, train_encoder(comm, strategy), train_encoder(comm, None))


@pytest.mark.mpi
@ranks_at_most(2, "the compiled graph and commlib's hooks do not depend on the rank count; at 4 "
                  "ranks each rank's compiles took 21 s of CI's suite")
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_a_compiled_transformer_layer_trains_as_one_process(comm, strategy):
    """From the second step on nothing compiles again: the attention's hook waits for ``out_proj``'s
    bucket, found in the first step that used it while in flight, so that the compiled attention
    meets plain parameters (it recompiled at every step, then ran eagerly)."""
    graphs: list[int] = []
    check_as_one_process(comm, train_encoder(comm, strategy, compiled=True, graphs=graphs),
                         train_encoder(comm, None))
    assert graphs[1:] == [graphs[1]] * (STEPS - 1), graphs


def reparametrized(kind: str) -> torch.nn.Module:
    """A model whose middle layer computes its weight in a forward pre-hook of its own, registered
    before wrapping, so that it runs before the optimizer's wait: pruning's ``weight_orig * mask``, the
    old ``torch.nn.utils.weight_norm``'s ``g * v / |v|``."""
    nn = torch.nn
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    if kind == "prune":
        torch.nn.utils.prune.l1_unstructured(model[2], "weight", amount=0.3)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)      # deprecated, still in use
            torch.nn.utils.weight_norm(model[2])
    return model


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["prune", "weight_norm"])
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_a_pre_hook_of_the_model_s_own_reads_current_parameters(comm, strategy, kind):
    """The model's own pre-hook read the layer's parameters before DeAR's wait for them: 1.9e-3 off
    one process after 5 steps (2 ranks), for both."""

    def run(dist: bool) -> np.ndarray:
        torch.manual_seed(comm.rank if dist else 0)
        model = reparametrized(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[strategy](), comm=comm)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            fit(comm, opt, model, torch.randn(4 * comm.size, 6, generator=g),
                torch.randn(4 * comm.size, 3, generator=g), dist)
        return params_of(model)

    check_as_one_process(comm, run(True), run(False))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_lookahead_around_the_optimizer_trains_as_one_process(comm, strategy):
    """``Lookahead(DistributedOptimizer(...))`` reads and writes the parameters right after the inner
    step: under DeAR it read half-gathered ones (7e-3 off one process after 5 steps, 2 ranks)."""
    check_as_one_process(comm, train_encoder(comm, strategy, lookahead=True),
                         train_encoder(comm, None, lookahead=True))


@pytest.mark.mpi
def test_values_wait_for_their_bucket_and_metadata_does_not(comm):
    """After a DeAR step: shapes, dtypes, ``.grad``, ``requires_grad``, hashing (``model.parameters()``
    builds a set) and ``isinstance`` leave the all-gathers in flight; the first use of a value waits
    for that parameter's bucket only, and gives it back its own class."""
    torch.manual_seed(comm.rank)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=DeAR(**SMALL),
                               comm=comm)
    x = torch.randn(4, 6)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    w0, w2 = model[0].weight, model[2].weight
    assert len(opt.buckets) > 1 and opt.strategy.writes_in_flight()
    assert isinstance(w0, torch.nn.Parameter) and isinstance(w0, InFlightParameter)
    assert type(w0).__name__ == "Parameter"
    seen = (w0.shape, w0.dtype, w0.device, w0.requires_grad, w0.grad is not None, w0.is_leaf,
            w0.numel(), w0.dim(), w0.stride(), w0.is_contiguous(), w0.data_ptr(), hash(w0),
            len(list(model.parameters())), w0 in {w0})
    assert seen[0] == (8, 6) and seen[-1]
    assert opt.strategy.writes_in_flight() and isinstance(w0, InFlightParameter)
    total = float(w2.sum())         # waits for w2's bucket only
    assert type(w2) is torch.nn.Parameter and isinstance(w0, InFlightParameter)
    assert opt.strategy.writes_in_flight()
    assert comm.allgather_object(total) == [total] * comm.size     # every rank's shard of w2 landed
    twin = copy.deepcopy(model[0].bias)         # a plain copy of the current value
    assert type(twin) is torch.nn.Parameter and type(model[0].bias) is torch.nn.Parameter
    model(x)                                    # the forward hooks wait for the rest
    assert type(w0) is torch.nn.Parameter and not opt.strategy.writes_in_flight()


#: strategies whose communication still writes the parameters after a step: DeAR's all-gathers,
#: SelSync's parameter averages (every step at delta 0, so that flush() starts nothing new)
IN_FLIGHT_AFTER_STEP = {
    "dear": lambda: DeAR(**SMALL),
    "selsync0-params": lambda: SelSync(inner=DeAR(**SMALL), delta=0.0, mode="params"),
    "selsync0-params-allreduce": lambda: SelSync(inner=STRATEGIES["allreduce"](), delta=0.0, mode="params"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", list(IN_FLIGHT_AFTER_STEP))
def test_an_ema_and_clipping_right_after_step_see_what_flush_gives(comm, strategy):
    """Written as in one process (no ``flush()``), an EMA and weight clipping after each step give
    what they give after ``opt.flush()``; the averages in flight are waited for, not raced with."""

    def run(flush: bool) -> np.ndarray:
        torch.manual_seed(comm.rank)
        model = Encoder()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                   strategy=IN_FLIGHT_AFTER_STEP[strategy](), comm=comm)
        ema = [p.detach().clone() for p in model.parameters()]
        for step in range(STEPS):
            fit(comm, opt, model, *data(step, comm.size), dist=True)
            if flush:
                opt.flush()
            # (one rank: SelSync averages nothing; DeAR's all-gather is there all the same)
            assert opt.strategy.writes_in_flight() == (not flush and (comm.size > 1 or strategy == "dear"))
            with torch.no_grad():
                torch._foreach_lerp_(ema, list(model.parameters()), 0.5)
                for p in model.parameters():
                    p.clamp_(-0.2, 0.2)
        return np.concatenate([params_of(model)] + [e.reshape(-1).double().numpy() for e in ema])

    got = run(False)
    assert_same_on_every_rank(comm, got)
    np.testing.assert_array_equal(got, run(True))
