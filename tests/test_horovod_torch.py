"""commlib.horovod.torch: Horovod's PyTorch API, every result against a float64 or single-process reference.

Single-process tests check the surface; the ``mpi`` tests run under ``mpiexec -n 2`` and
``-n 4``: collectives against numpy over every rank's input (each rank can rebuild all
inputs), errors raised on every rank with the job still usable after them.  ``DistributedOptimizer``
against one process on the concatenated batch: ``tests/test_horovod_optimizer.py``.
"""

from __future__ import annotations

import importlib
import pickle
import threading
import time

import numpy as np
import pytest

from conftest import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    import commlib.horovod.torch as hvd
    from commlib.collectives import DeAR

    torch.set_num_threads(1)

DTYPES = ["int8", "int32", "int64", "float16", "float32", "float64"]


def rank_tensor(r: int, shape: tuple, dtype: str, salt: int = 0) -> torch.Tensor:
    """Rank r's input: small integers (exact in every dtype)."""
    g = np.random.default_rng([r, salt, len(shape), 7])
    return torch.from_numpy(g.integers(-5, 6, size=shape)).to(getattr(torch, dtype))


def stacked(size: int, shape: tuple, dtype: str, salt: int = 0) -> np.ndarray:
    return np.stack([rank_tensor(r, shape, dtype, salt).double().numpy() for r in range(size)])


# ---------------------------------------------------------------------- one process
def test_surface_and_basics():
    hvd.init()
    hvd.init()                                   # idempotent
    assert hvd.is_initialized() and 0 <= hvd.rank() < hvd.size()
    assert 0 <= hvd.local_rank() < hvd.local_size() and 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert not hvd.gloo_built() and not hvd.gloo_enabled() and isinstance(hvd.nccl_built(), int)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    with pytest.raises(NotImplementedError):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    with pytest.raises(NotImplementedError):
        hvd.start_timeline("/tmp/x.json")
    with pytest.raises(NotImplementedError, match="elastic training"):
        hvd.elastic.run(lambda state: None)
    with pytest.raises(NotImplementedError, match="elastic training"):
        hvd.elastic.TorchState(model=None)


def test_compression_fp16_passes_integers_unchanged():
    for dtype in (torch.uint8, torch.int8, torch.int32, torch.int64):
        t = torch.arange(6, dtype=dtype)
        c, ctx = hvd.Compression.fp16.compress(t)
        assert c.dtype == dtype and torch.equal(hvd.Compression.fp16.decompress(c, ctx), t)
    t = torch.linspace(-2, 2, 9, dtype=torch.float64)
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16
    d = hvd.Compression.fp16.decompress(c, ctx)
    assert d.dtype == torch.float64 and torch.allclose(d, t, atol=1e-3)


def test_second_import_name_refused():
    with pytest.raises(ImportError, match="commlib.horovod"):
        importlib.import_module("commlib.bindings.horovod")


def test_optimizer_argument_errors():
    hvd.init()
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    with pytest.raises(ValueError, match="unique"):
        named = list(a.named_parameters()) + list(b.named_parameters())
        hvd.DistributedOptimizer(opt, named_parameters=named)
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(opt, named_parameters=list(a.named_parameters()))
    with pytest.raises(ValueError, match="model="):
        hvd.DistributedOptimizer(opt, strategy=DeAR())


# ---------------------------------------------------------------------- collectives
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_ops_against_numpy(dtype):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    shape = (3, 5)
    all_in = stacked(n, shape, dtype)
    cases = [(hvd.Sum, all_in.sum(0)), (hvd.Min, all_in.min(0)), (hvd.Max, all_in.max(0)),
             (hvd.Product, all_in.prod(0))]
    # Horovod's integer average: the sum times 1/size in float64, truncated toward zero (-3/2: -1)
    trunc_avg = np.trunc(all_in.sum(0) * (1.0 / n)) if dtype.startswith("int") else all_in.sum(0) / n
    cases.append((hvd.Average, trunc_avg))
    for op, want in cases:
        got = hvd.allreduce(rank_tensor(r, shape, dtype), op=op)
        assert got.dtype == getattr(torch, dtype) and got.shape == shape
        if dtype == "int8":
            want = want.astype(np.int64).astype(np.int8)          # wraps as Horovod's int8 sum
        np.testing.assert_allclose(got.double().numpy(), want, rtol=2e-3 if dtype == "float16" else 1e-12,
                                   atol=0)
    # in place, the old average= keyword, scale factors (integers scale in float64, truncated)
    t = rank_tensor(r, shape, dtype)
    with pytest.warns(DeprecationWarning):
        assert hvd.allreduce_(t, average=False) is t
    want = cases[0][1].astype(np.int8) if dtype == "int8" else cases[0][1]
    np.testing.assert_allclose(t.double().numpy(), want, rtol=2e-3 if dtype == "float16" else 0)
    if dtype in ("int32", "float64"):
        got = hvd.allreduce(rank_tensor(r, shape, dtype), op=hvd.Sum, prescale_factor=0.5,
                            postscale_factor=3.0)
        pre = np.trunc(all_in * 0.5) if dtype == "int32" else all_in * 0.5
        want = pre.sum(0) * 3.0
        np.testing.assert_allclose(got.double().numpy(), np.trunc(want) if dtype == "int32" else want)
        # Average and a postscale: one scale by postscale / size, as Horovod's (it floor-divided, then
        # scaled: floor(3 / 2) * 3 = 3 where Horovod gives trunc(3 * 3 / 2) = 4)
        got = hvd.allreduce(rank_tensor(r, shape, dtype), op=hvd.Average, postscale_factor=3.0)
        want = all_in.sum(0) * (3.0 / n)
        np.testing.assert_allclose(got.double().numpy(), np.trunc(want) if dtype == "int32" else want)


@pytest.mark.mpi(min_size=2)
def test_async_handles_poll_and_fused_results():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    shapes = [(17,), (4, 4), (2, 3, 5), (1,), (0,), (33,)]
    handles = [hvd.allreduce_async(rank_tensor(r, s, "float32", i), op=hvd.Sum, name=f"t{i}")
               for i, s in enumerate(shapes)]
    assert not all(hvd.poll(h) for h in handles)          # asynchronous: not all done at submission
    for i, (h, s) in enumerate(zip(handles, shapes)):
        np.testing.assert_array_equal(hvd.synchronize(h).numpy(), stacked(n, s, "float32", i).sum(0))
    assert hvd.synchronize(handles[0]) is None              # a handle is consumed once


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["uint8", "int16", "bfloat16", "float32", "int64"])
def test_allgather_broadcast_alltoall_reducescatter(dtype):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    parts = [rank_tensor(k, (k + 1, 3), "int64").abs().to(getattr(torch, dtype)) for k in range(n)]
    got = hvd.allgather(parts[r])
    assert got.dtype == parts[r].dtype
    assert torch.equal(got, torch.cat(parts))
    for root in range(n):
        t = rank_tensor(r, (4, 2), "int64").abs().to(getattr(torch, dtype))
        want = rank_tensor(root, (4, 2), "int64").abs().to(getattr(torch, dtype))
        out = hvd.broadcast(t, root)
        assert torch.equal(out, want) and (r == root or not torch.equal(t, want) or torch.equal(t, want))
        assert hvd.broadcast_(t, root) is t and torch.equal(t, want)
    # alltoall: rank k sends k + s + 1 rows to rank s, each row tagged by (sender, receiver)
    send = torch.cat([torch.full((r + s + 1, 2), 10 * r + s) for s in range(n)]).to(getattr(torch, dtype))
    out, got_splits = hvd.alltoall(send, torch.tensor([r + s + 1 for s in range(n)], dtype=torch.int32))
    want = torch.cat([torch.full((k + r + 1, 2), 10 * k + r) for k in range(n)]).to(getattr(torch, dtype))
    assert torch.equal(out, want) and got_splits.tolist() == [k + r + 1 for k in range(n)]
    for splits in ([r + s + 1 for s in range(n)], torch.tensor([r + s + 1 for s in range(n)])):  # list, int64
        out, got_splits = hvd.alltoall(send, splits)
        assert torch.equal(out, want) and got_splits.tolist() == [k + r + 1 for k in range(n)]
    if dtype in ("float32", "int64"):
        x = rank_tensor(r, (2 * n + 1, 3), dtype)
        full = stacked(n, (2 * n + 1, 3), dtype).sum(0)
        rows = [3] + [2] * (n - 1)                        # the first n % size ranks get one more row
        start = sum(rows[:r])
        np.testing.assert_array_equal(hvd.reducescatter(x, op=hvd.Sum).numpy(), full[start:start + rows[r]])


@pytest.mark.mpi(min_size=2)
def test_alltoall_of_an_empty_tensor_from_numpy():
    """A rank with nothing to send (MoE dispatch: no tokens) whose (0, 4) tensor comes from numpy
    (strides (0, 0)): it raised there alone while its peers completed the exchange, and its next
    alltoall received their stale rows, silently."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.from_numpy(np.empty((0, 4), np.float32)) if r == 0 else torch.full((2 * n, 4), 100.0 + r)
    out, got = hvd.alltoall(x, splits=[0] * n if r == 0 else [2] * n)
    want = [100.0 + k for k in range(1, n) for _ in range(2)]
    assert got.tolist() == [0] + [2] * (n - 1) and out.shape == (2 * (n - 1), 4)
    assert out[:, 0].tolist() == want
    out = hvd.alltoall(torch.full((2 * n, 4), 200.0 + r))
    assert out[:, 0].tolist() == [200.0 + k for k in range(n) for _ in range(2)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "int8", "bool"])
def test_a_rank_receiving_no_rows_gets_an_empty_tensor(dtype):
    """Every rank sends all its rows to rank 0: the others receive none, which raised on them alone
    (torch cannot view an empty byte buffer as a wider dtype), the backward pass too.  All-gathers and
    reduce-scatters of no rows on any rank give empty tensors of the input's dtype."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dt = getattr(torch, dtype)
    for tail in [(), (2,)]:
        def rows(k, tail=tail):
            return (torch.arange(3 * int(np.prod(tail))).reshape(3, *tail) + 10 * k).to(dt)
        out, got = hvd.alltoall(rows(r), splits=[3] + [0] * (n - 1))
        assert out.dtype == dt
        if r == 0:
            assert got.tolist() == [3] * n and torch.equal(out, torch.cat([rows(k) for k in range(n)]))
        else:
            assert got.tolist() == [0] * n and out.shape == (0, *tail)
    x = torch.arange(3.0, requires_grad=True)
    out, got = hvd.alltoall(x * (r + 1), splits=[3] + [0] * (n - 1))
    (out * (torch.arange(out.shape[0]) // 3 + 1)).sum().backward()   # rank 0 weighs sender k's rows by k+1
    assert x.grad.tolist() == [float(r + 1) * (r + 1)] * 3
    for shape in [(0, 3), (0,)]:
        g = hvd.allgather(torch.zeros(shape, dtype=dt))
        assert g.shape == shape and g.dtype == dt
    rs = hvd.reducescatter(torch.zeros(0, 3, dtype=torch.float32), op=hvd.Sum)
    assert rs.shape == (0, 3) and rs.dtype == torch.float32
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(n)] * 2   # the job goes on


@pytest.mark.mpi(min_size=2)
def test_grouped_allreduce_async_returns_one_handle():
    """Horovod 0.28: one int handle for the group; ``poll`` and ``synchronize`` take it and
    ``synchronize`` returns the list of results (the in-place form: the tensors themselves)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    a, b = rank_tensor(r, (2,), "float32", 1), rank_tensor(r, (3, 2), "float64", 2)
    h = hvd.grouped_allreduce_async([a, b], op=hvd.Sum)
    assert isinstance(h, int) and hvd.poll(h) in (False, True)
    outs = hvd.synchronize(h)
    assert isinstance(outs, list) and len(outs) == 2
    np.testing.assert_array_equal(outs[0].numpy(), stacked(n, (2,), "float32", 1).sum(0))
    np.testing.assert_array_equal(outs[1].numpy(), stacked(n, (3, 2), "float64", 2).sum(0))
    assert hvd.synchronize(h) is None and torch.equal(a, rank_tensor(r, (2,), "float32", 1))
    h = hvd.grouped_allreduce_async_([a, b], op=hvd.Max, name="grp")
    while not hvd.poll(h):
        time.sleep(0.001)
    outs = hvd.synchronize(h)
    assert outs[0] is a and outs[1] is b
    np.testing.assert_array_equal(b.numpy(), stacked(n, (3, 2), "float64", 2).max(0))
    # a name in the group already outstanding refuses the whole group: none of it is queued
    h1 = hvd.allreduce_async(torch.ones(1), name="grp.1", op=hvd.Sum)
    with pytest.raises(ValueError, match="grp.1"):
        hvd.grouped_allreduce_async([torch.ones(1), torch.ones(1)], name="grp")
    assert hvd.synchronize(h1).tolist() == [float(n)]
    h = hvd.grouped_allreduce_async([torch.ones(1), torch.ones(2)], name="grp", op=hvd.Sum)   # names free
    outs = hvd.synchronize(h)
    assert [o.tolist() for o in outs] == [[float(n)], [float(n)] * 2]
    assert [o.tolist() for o in hvd.grouped_allreduce_([torch.ones(1), torch.ones(2)], op=hvd.Sum)] == \
        [[float(n)], [float(n)] * 2]
    x, y = torch.ones(2, requires_grad=True), torch.ones(3, dtype=torch.float64, requires_grad=True)
    gx, gy = hvd.grouped_allreduce([x, y], op=hvd.Sum)
    (gx.sum() + gy.sum()).backward()
    assert x.grad.tolist() == [float(n)] * 2 and y.grad.tolist() == [float(n)] * 3


@pytest.mark.mpi(min_size=2)
def test_autograd_follows_horovod_conventions():
    """Horovod 0.28's backward functions (its test_horovod_*_grad expectations): allgather and
    broadcast average the upstream gradients over ranks (broadcast: zeros off the root),
    reducescatter all-gathers them times size() under Sum and times 1 under Average."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for firsts in ([2] * n, [k + 1 for k in range(n)]):          # equal and differing first dimensions
        x = torch.ones(firsts[r], 3, dtype=torch.float64, requires_grad=True)
        g = torch.cat([torch.full((f, 3), float(k)) for k, f in enumerate(firsts)]).double()   # alike on all
        hvd.allgather(x).backward(g)
        assert torch.equal(x.grad, torch.full((firsts[r], 3), float(r), dtype=torch.float64))
    x = torch.ones(2, requires_grad=True)
    hvd.allgather(x).backward(torch.full((2 * n,), float(r + 1)))   # differing upstream: their average
    assert x.grad.tolist() == [(n + 1) / 2] * 2
    x = torch.tensor(1.0, requires_grad=True)                        # 0-d: one row each
    hvd.allgather(x).backward(torch.ones(n))
    assert x.grad.shape == () and x.grad.item() == 1.0
    for root in range(n):
        x = torch.ones(4, dtype=torch.float64, requires_grad=True)
        hvd.broadcast(x, root).backward(torch.ones(4, dtype=torch.float64))
        assert torch.equal(x.grad, torch.full((4,), 1.0 if r == root else 0.0, dtype=torch.float64))
    for op, want in [(hvd.Sum, float(n)), (hvd.Average, 1.0)]:
        x = torch.ones(2 * n, 3, requires_grad=True)
        y = hvd.reducescatter(x, op=op)
        y.backward(torch.ones_like(y))
        assert torch.equal(x.grad, torch.full((2 * n, 3), want))
    x = torch.ones(3, 2, dtype=torch.float64, requires_grad=True)    # allreduce: allreduce of the upstream
    hvd.allreduce(x, op=hvd.Sum).backward(torch.ones(3, 2, dtype=torch.float64))
    assert torch.equal(x.grad, torch.full((3, 2), float(n), dtype=torch.float64))


@pytest.mark.mpi(min_size=2)
def test_bool_tensors_reduce_logically_and_refuse_average():
    """Sum/Max: logical or, Min/Product: logical and, as bool; Average (the default) has no bool
    result: refused with ValueError on every rank, and the job goes on."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    b = torch.tensor([True, True, r == 0, False])
    for op, want in [(hvd.Sum, [True, True, True, False]), (hvd.Max, [True, True, True, False]),
                     (hvd.Min, [True, True, False, False]), (hvd.Product, [True, True, False, False])]:
        got = hvd.allreduce(b, op=op)
        assert got.dtype == torch.bool and got.tolist() == want
    for call in [lambda: hvd.allreduce(b), lambda: hvd.allreduce(b, op=hvd.Average),
                 lambda: hvd.allreduce_(b.clone()), lambda: hvd.synchronize(hvd.allreduce_async(b)),
                 lambda: hvd.grouped_allreduce([b, b.clone()]),
                 lambda: hvd.reducescatter(torch.ones(2 * n, dtype=torch.bool))]:
        with pytest.raises(ValueError, match="Average is not defined for bool"):
            call()
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(n)] * 2
    assert b.tolist() == [True, True, r == 0, False]
    rs = hvd.reducescatter(torch.tensor([r == 0] * (2 * n)), op=hvd.Sum)
    assert rs.dtype == torch.bool and rs.tolist() == [True, True]


@pytest.mark.mpi(min_size=2)
def test_objects_travel_with_cloudpickle_and_pickling_errors_reach_every_rank():
    """Lambdas and local classes travel (Horovod pickles with cloudpickle); an object that does not
    pickle raises ``pickle.PicklingError`` on every rank (its rank sends why), none waits."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()

    class Local:
        def __init__(self, v):
            self.v = v

    f = hvd.broadcast_object((lambda x: x + 1) if r == 1 else None, root_rank=1)
    assert f(1) == 2
    obj = hvd.broadcast_object(Local(7) if r == 0 else None, root_rank=0)
    assert type(obj).__name__ == "Local" and obj.v == 7
    fs = hvd.allgather_object(lambda k=r: 10 * k)
    assert [g() for g in fs] == [10 * k for k in range(n)]
    t0 = time.monotonic()
    with pytest.raises(pickle.PicklingError, match="rank 1 could not pickle its object"):
        hvd.broadcast_object(threading.Lock() if r == 1 else None, root_rank=1)
    with pytest.raises(pickle.PicklingError, match="rank 1 could not pickle its object"):
        hvd.allgather_object(threading.Lock() if r == 1 else r, name="objs")
    assert time.monotonic() - t0 < 30
    assert hvd.broadcast_object({"ok": r}, root_rank=0) == {"ok": 0}
    assert hvd.allgather_object(r, name="objs") == list(range(n))


@pytest.mark.mpi(min_size=2)
def test_autograd_through_collectives():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.ones(3, 2, dtype=torch.float64, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).backward(torch.ones(3, 2, dtype=torch.float64))
    assert torch.equal(x.grad, torch.full((3, 2), float(n), dtype=torch.float64))
    x = torch.ones(r + 1, 2, dtype=torch.float64, requires_grad=True)
    g = torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]).double()
    hvd.allgather(x).backward(g)          # Horovod: the upstream gradients averaged over ranks
    assert torch.equal(x.grad, torch.full((r + 1, 2), float(r), dtype=torch.float64))
    x = torch.ones(4, dtype=torch.float64, requires_grad=True)
    hvd.broadcast(x, 1).backward(torch.ones(4, dtype=torch.float64))
    assert torch.equal(x.grad, torch.full((4,), float(1 if r == 1 else 0), dtype=torch.float64))


@pytest.mark.mpi(min_size=2)
def test_mismatches_raise_on_every_rank_and_the_job_goes_on():
    hvd.init()
    r = hvd.rank()
    bad = [lambda: hvd.allreduce(torch.ones(3 + r)),                            # shape
           lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if r else torch.float64)),  # dtype
           lambda: hvd.broadcast(torch.ones(3), r),                             # root
           lambda: hvd.allgather(torch.ones(2, 2 + r)),                         # trailing shape
           lambda: hvd.allreduce(torch.ones(2)) if r else hvd.allgather(torch.ones(2))]   # operation
    for call in bad:
        with pytest.raises(RuntimeError):
            call()
        assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(hvd.size())))
    with pytest.raises(ValueError):                                              # rejected here: ValueError
        hvd.alltoall(torch.ones(hvd.size() + 1))
    h = hvd.allreduce_async(torch.ones(5), name="dup")
    with pytest.raises(ValueError, match="dup"):
        hvd.allreduce_async(torch.ones(5), name="dup")
    while not hvd.poll(h):      # finished but not synchronized: still outstanding, on every rank alike
        time.sleep(0.001)
    with pytest.raises(ValueError, match="'dup' is outstanding"):
        hvd.allreduce_async(torch.ones(5), name="dup")
    hvd.synchronize(h)
    again = hvd.synchronize(hvd.allreduce_async(torch.ones(5), name="dup", op=hvd.Sum))   # free again
    assert torch.equal(again, torch.full((5,), float(hvd.size())))


@pytest.mark.mpi(min_size=2)
def test_join_contributes_zeros_and_objects():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        assert hvd.join() == n - 1 or n > 2
    else:
        got = hvd.allreduce(rank_tensor(r, (6,), "float64"), op=hvd.Average)
        np.testing.assert_allclose(got.numpy(), stacked(n, (6,), "float64")[1:].sum(0) / n)
        with pytest.raises(RuntimeError, match="join"):
            hvd.allgather(torch.ones(2))
        assert 0 < hvd.join() < n
    obj = hvd.broadcast_object({"r": r, "x": [1, 2]} if r == 1 else None, root_rank=1)
    assert obj == {"r": 1, "x": [1, 2]}
    assert hvd.allgather_object({"rank": r} if r else "zero") == ["zero"] + [{"rank": k} for k in range(1, n)]
    hvd.barrier()



@pytest.mark.mpi(min_size=2)
def test_sync_batch_norm_reduces_over_the_ranks_horovod_was_given():
    """``hvd.init(comm=half)`` (Horovod on part of the job): ``hvd.SyncBatchNorm`` took its
    statistics over every rank of the job (commlib's default communicator), 0.4-0.6 off the
    half's batch norm, and a half that never ran it left the other waiting for good."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    half = world.Split(world.rank % 2, world.rank)
    hvd.shutdown()
    hvd.init(comm=half)
    try:
        assert hvd.size() == half.size
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(world.rank))
        out = hvd.SyncBatchNorm(4)(x)
        mine = [r for r in range(world.size) if r % 2 == world.rank % 2]
        batch = torch.cat([torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in mine])
        ref = torch.nn.functional.batch_norm(batch.double(), None, None, training=True)
        k = mine.index(world.rank)
        np.testing.assert_allclose(out.detach().double().numpy(), ref[3 * k:3 * k + 3].numpy(), atol=1e-5)
    finally:
        hvd.shutdown()
        half.Free()
        hvd.init()


# ---------------------------------------------------------------------- DistributedOptimizer


@pytest.mark.mpi(min_size=2)
def test_a_strided_column_a_bad_root_and_differing_parameters_leave_the_engine_running():
    """An in-place all-reduce of a matrix's column (a strided 1-D view) stopped the engine on every
    rank ("array is not contiguous"), and every later call said "Horovod has been shut down; call
    hvd.init() first", which did nothing.  A root out of range, and ``broadcast_parameters`` over
    tensors that differ across ranks, raised ``ValidationError``, which ``except
    hvd.HorovodInternalError`` missed."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    w = torch.arange(6, dtype=torch.float64).reshape(3, 2) + r
    col = w[:, 0]
    assert hvd.allreduce_(col, op=hvd.Sum) is col
    np.testing.assert_array_equal(w[:, 0].numpy(), sum(np.arange(0, 6, 2) + k for k in range(n)))
    np.testing.assert_array_equal(w[:, 1].numpy(), np.arange(1, 6, 2) + r)     # the other column untouched
    with pytest.raises(hvd.HorovodInternalError, match=f"root rank {n + 3} is not a rank of 0..{n - 1}"):
        hvd.broadcast(torch.ones(3), root_rank=n + 3)
    with pytest.raises(hvd.HorovodInternalError, match="differs across ranks"):
        hvd.broadcast_parameters({"w": torch.ones(2 + r)}, root_rank=0)
    np.testing.assert_array_equal(hvd.allreduce(torch.ones(2), op=hvd.Sum).numpy(), [n, n])
