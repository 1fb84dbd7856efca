"""SyncBatchNorm against torch's BatchNorm in one process on the concatenated batch (float64).

Training through DistributedOptimizer (AllReduce, DeAR) must leave parameters,
running statistics and evaluation outputs where one process leaves them; the
layer alone, with a different batch size on every rank, must give each rank
its slice of the single-process output and input gradient, and the sum of the
ranks' weight gradients.  Bad input on one rank raises on every rank.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

from conftest import HAVE_TORCH, assert_same_on_every_rank, rank_part

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer, SyncBatchNorm
    from commlib.collectives import AllReduce, DeAR

    torch.set_num_threads(1)

LOCAL = 3          # samples per rank per step
STEPS = 3
TOL = {"rtol": 1e-9, "atol": 1e-11}


class Net(torch.nn.Module if HAVE_TORCH else object):
    """Conv, BatchNorm2d, ReLU, pooled, Linear, BatchNorm1d: both kinds of input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 5)
        self.bn1 = torch.nn.BatchNorm1d(5, momentum=None)      # cumulative average
        self.out = torch.nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn2(self.conv(x))).mean((2, 3))
        return self.out(torch.relu(self.bn1(self.fc(h))))


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randn(LOCAL * size, 2, 5, 5, generator=g, dtype=torch.float64),
            torch.randn(LOCAL * size, 2, generator=g, dtype=torch.float64))


def train(comm, strategy: str | None) -> tuple[Net, list[np.ndarray]]:
    """``strategy=None``: plain BatchNorm in one process on the whole batch."""
    torch.manual_seed(comm.rank if strategy else 0)
    model = Net().double()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if strategy:
        model = SyncBatchNorm.convert_sync_batchnorm(model)
        s = {"allreduce": AllReduce, "dear": DeAR}[strategy](cap_mb=0.0002, first_cap_mb=0.0001)
        opt = DistributedOptimizer(base, model, strategy=s, comm=comm)
    else:
        opt = base
    evals = []
    for step in range(STEPS):
        x, y = batch(step, comm.size)
        if strategy:
            x, y = rank_part(comm, LOCAL, x, y)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            evals.append(model(batch(99, 1)[0]).numpy().copy())
        model.train()
    return model, evals


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_training_matches_one_process_on_the_whole_batch(comm, strategy):
    got, got_evals = train(comm, strategy)
    ref, ref_evals = train(comm, None)
    assert isinstance(got.bn2, SyncBatchNorm) and isinstance(got.bn1, SyncBatchNorm)
    sd, rsd = got.state_dict(), ref.state_dict()
    assert list(sd) == list(rsd)
    for k in sd:           # parameters and running statistics (num_batches_tracked too)
        np.testing.assert_allclose(sd[k].numpy(), rsd[k].numpy(), err_msg=k, **TOL)
    np.testing.assert_allclose(np.array(got_evals), np.array(ref_evals), **TOL)
    vec = torch.cat([v.reshape(-1).double() for v in sd.values()]).numpy()
    assert_same_on_every_rank(comm, vec)


def layer_case(comm, kwargs: dict, shape: tuple, dtype: Any = None) -> None:
    """One layer, rank r holding r + 2 samples: output, input gradient and running statistics are the
    single-process layer's on the concatenated batch; weight gradients sum to its own."""
    dtype = dtype or torch.float64
    counts = [r + 2 for r in range(comm.size)]
    g = torch.Generator().manual_seed(7)
    whole = torch.randn(sum(counts), *shape, generator=g, dtype=torch.float64) * 3 + 1
    probe = torch.randn(sum(counts), *shape, generator=g, dtype=torch.float64)
    lo = sum(counts[:comm.rank])
    mine = slice(lo, lo + counts[comm.rank])
    ref = torch.nn.BatchNorm1d(shape[0], **kwargs).double()
    if ref.weight is not None:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5, generator=g)
            if ref.bias is not None:
                ref.bias.uniform_(-1, 1, generator=g)
    sync = SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm1d(shape[0], **kwargs).double(), comm)
    sync.load_state_dict(ref.state_dict())
    ref, sync = ref.to(dtype), sync.to(dtype)
    for _ in range(2):
        x_ref = whole.to(dtype).clone().requires_grad_(True)
        y_ref = ref(x_ref)
        (y_ref.double() * probe).sum().backward()
        x = whole[mine].to(dtype).clone().requires_grad_(True)
        y = sync(x)
        (y.double() * probe[mine]).sum().backward()
        assert y.dtype == dtype
        tol = TOL if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
        np.testing.assert_allclose(y.detach().double().numpy(), y_ref[mine].detach().double().numpy(), **tol)
        np.testing.assert_allclose(x.grad.double().numpy(), x_ref.grad[mine].double().numpy(), **tol)
    for name, p in sync.named_parameters():
        total = comm.allreduce(p.grad.detach().double().numpy())
        np.testing.assert_allclose(total, dict(ref.named_parameters())[name].grad.double().numpy(), **tol)
    for name, b in sync.named_buffers():
        np.testing.assert_allclose(b.double().numpy(), dict(ref.named_buffers())[name].double().numpy(),
                                   err_msg=name, **tol)


CASES = {
    "default-3d": ({}, (3, 4)),
    "2d-input": ({}, (3,)),
    "cumulative": ({"momentum": None}, (3, 4)),
    "no-affine": ({"affine": False}, (3, 4)),
    "no-bias": ({"bias": False}, (3, 4)),
    "untracked": ({"track_running_stats": False}, (3, 4)),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(CASES))
def test_layer_with_uneven_batches_matches_the_whole_batch(comm, case):
    if "bias" in CASES[case][0] and "bias" not in inspect.signature(torch.nn.BatchNorm1d).parameters:
        pytest.skip(f"torch {torch.__version__}'s BatchNorm (the reference) has no bias argument")
    layer_case(comm, *CASES[case])


@pytest.mark.mpi
def test_float32_layer_matches_the_whole_batch(comm):
    layer_case(comm, {}, (3, 4), torch.float32)


@pytest.mark.mpi
def test_bfloat16_input_keeps_its_dtype(comm):
    """16-bit input is normalized in float32 and returned in its own dtype (as BatchNorm does)."""
    bn = SyncBatchNorm(3, comm=comm)
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(comm.rank))
    y = bn(x.bfloat16())
    assert y.dtype == torch.bfloat16
    np.testing.assert_allclose(y.float().detach().numpy(), SyncBatchNorm(3, comm=comm)(x).detach().numpy(),
                               atol=0.05)


@pytest.mark.mpi
def test_bad_input_on_one_rank_raises_on_every_rank(comm):
    bn = SyncBatchNorm(3, comm=comm)
    last = comm.size - 1
    x = torch.randn(4, 2 if comm.rank == last else 3, 5)
    if comm.size == 1:
        with pytest.raises(RuntimeError):      # torch's own batch_norm refuses it
            bn(x)
        return
    with pytest.raises(ValueError, match=f"ranks {last} rejected"):
        bn(x)
    y = bn(torch.randn(4, 3, 5))            # the layer and its communicator go on
    assert y.shape == (4, 3, 5)


@pytest.mark.mpi
def test_evaluation_does_not_communicate(comm):
    """model.eval() uses the running statistics: one rank alone can evaluate (no collective)."""
    bn = SyncBatchNorm(3, comm=comm)
    bn(torch.randn(4, 3))
    bn.eval()
    if comm.rank == 0:
        ref = torch.nn.BatchNorm1d(3).eval()
        ref.load_state_dict(bn.state_dict())
        x = torch.randn(2, 3)
        torch.testing.assert_close(bn(x), ref(x))
    comm.barrier()


def test_convert_keeps_parameters_and_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Sequential(torch.nn.BatchNorm2d(2, eps=1e-3, momentum=0.3)))
    params = {n: p for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    model[1].eval()
    out = SyncBatchNorm.convert_sync_batchnorm(model)
    assert out is model
    assert isinstance(out[1], SyncBatchNorm) and isinstance(out[2][0], SyncBatchNorm)
    assert (out[2][0].eps, out[2][0].momentum, out[1].training) == (1e-3, 0.3, False)
    assert all(p is params[n] for n, p in out.named_parameters())
    assert all(b is buffers[n] for n, b in out.named_buffers())
    single = SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm3d(5))
    assert isinstance(single, SyncBatchNorm) and single.num_features == 5


@pytest.mark.mpi(min_size=1)
def test_torch_sync_batchnorm_without_its_process_group_is_refused(comm):
    """torch's ``nn.SyncBatchNorm`` (a DDP script's ``convert_sync_batchnorm``) synchronizes over
    torch.distributed, which commlib does not start: wrapping such a model raises on every rank,
    naming the layers and commlib's conversion (each rank normalized with its own batch and kept
    its own running statistics, left out of the buffer broadcast: 0.31 apart after 3 steps at 2
    ranks, silently).  One rank is one process: nothing to refuse."""
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if comm.size == 1:
        DistributedOptimizer(opt, model, comm=comm).close()
        return
    with pytest.raises(ValueError, match=r"torch.nn.SyncBatchNorm layers \(1\).*convert_sync_batchnorm"):
        DistributedOptimizer(opt, model, comm=comm)
    model = SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.Linear(3, 4),
                                                                     torch.nn.BatchNorm1d(4)))
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm).close()


def test_horovod_name():
    """Horovod's layer is commlib's, whose communicator defaults to Horovod's ranks (those
    ``hvd.init(comm=...)`` was given: ``tests/test_horovod_torch.py``)."""
    import commlib.horovod.torch as hvd

    assert issubclass(hvd.SyncBatchNorm, SyncBatchNorm)
    assert isinstance(hvd.SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm1d(3)), hvd.SyncBatchNorm)


@pytest.mark.mpi
def test_a_deep_copy_shares_the_communicator_and_a_pickle_loads(comm):
    """An EMA model (copy.deepcopy) of a converted model, and torch.save of the whole model."""
    import copy
    import io

    model = SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(3)), comm)
    ema = copy.deepcopy(model)
    assert ema[0].comm is comm and ema[0].weight is not model[0].weight
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(comm.rank))
    torch.testing.assert_close(ema(x), model(x))       # both synchronized, over the same ranks
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded[0].comm is None                      # the default communicator from now on
    torch.testing.assert_close(loaded[0].running_mean, model[0].running_mean)


@pytest.mark.mpi
@pytest.mark.parametrize("first", ["eager", "compiled"])
def test_compiled_model_matches_eager(comm, first):
    """torch.compile runs the layer's communication eagerly (it is never traced).  Compiled first,
    on a communicator whose statistics' side communicator was not split yet: Dynamo traced the
    split (its pickling and board writes) and the first forward raised on every rank."""
    torch.manual_seed(0)
    fresh = comm.split(0)
    model = SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)), fresh)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(comm.rank), requires_grad=True)
    got = {}
    for name, m in sorted({"eager": model, "compiled": compiled}.items(), key=lambda kv: kv[0] != first):
        y = m(x)
        y.sum().backward()
        got[name] = (y.detach(), x.grad.clone())
        x.grad = None
    torch.testing.assert_close(got["compiled"], got["eager"])
    torch._dynamo.reset()
    fresh.close()
