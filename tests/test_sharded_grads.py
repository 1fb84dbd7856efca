"""Norms of ``.grad`` under DeAR, whose ranks hold the averaged gradient on their own shards only.

Code written for one process reads them (torch's ``clip_grad_norm_`` and ``get_total_norm``, a
logged ``p.grad.norm()``): each must read the norm one process computes on the concatenated
batch, in float64 here (the reference), whatever the order, the tensor or the spelling; reads that
are not a function of the shards' norms, and every other read of the values, gather the whole
average first, on every rank.  (Training with torch's ``clip_grad_norm_`` against one process:
pattern ``clip-torch`` in ``test_train_loops.py``; a read on rank 0 alone: broken-job cases
``norm_on_rank0`` and ``values_on_rank0``.)
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest

from conftest import HAVE_TORCH, SMALL

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.collectives import DeAR

    torch.set_num_threads(1)

LOCAL = 3
ORDERS = [2.0, 1.0, 3.5, 0.0, float("inf"), float("-inf")]


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 3)).double()


def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(LOCAL * size, 2, 6, 6, generator=g, dtype=torch.float64)
    x[:, :, 0, 0] = 0.0       # some gradient elements exactly zero: the 0-"norm" counts the others
    return x, torch.randn(LOCAL * size, 3, generator=g, dtype=torch.float64)


def backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    torch.nn.functional.mse_loss(model(x), y).backward()


def reference(size: int) -> list[torch.Tensor]:
    model = make()
    backward(model, *batch(size))
    return [p.grad for p in model.parameters()]


def sharded(comm) -> tuple[torch.nn.Module, DistributedOptimizer]:
    model = make()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                               strategy=DeAR(**SMALL))
    x, y = batch(comm.size)
    sl = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
    opt.zero_grad()
    backward(model, x[sl], y[sl])
    return model, opt


@pytest.mark.mpi(min_size=2)
def test_norms_of_sharded_gradients_read_as_one_process(comm):
    model, opt = sharded(comm)
    ref = reference(comm.size)
    grads = [p.grad for p in model.parameters()]
    for ord in ORDERS:
        want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, ord) for g in ref]), ord)
        np.testing.assert_allclose(torch.nn.utils.get_total_norm(grads, ord), want, rtol=1e-12,
                                   err_msg=f"ord {ord}")
        np.testing.assert_allclose(torch.nn.utils.get_total_norm(grads, ord, foreach=True), want,
                                   rtol=1e-12, err_msg=f"ord {ord}, foreach")
    w, rw = model[2].weight.grad, ref[2]
    spellings = {"Tensor.norm": w.norm(), "torch.norm": torch.norm(w, p="fro"),
                 "linalg.norm": torch.linalg.norm(w), "Tensor.norm(1)": w.norm(1),
                 "vector_norm(keepdim)": torch.linalg.vector_norm(w, keepdim=True),
                 "vector_norm(dim=all)": torch.linalg.vector_norm(w, 2, dim=(0, 1)),
                 "vector_norm(dtype)": torch.linalg.vector_norm(w, dtype=torch.float64)}
    for name, got in spellings.items():
        want = torch.linalg.vector_norm(rw, 1 if "(1)" in name else 2)
        assert got.shape == ((1, 1) if "keepdim" in name else ()), name
        np.testing.assert_allclose(got.reshape(()), want, rtol=1e-12, err_msg=name)
    # a foreach norm over them and plain tensors (another optimizer's gradients): each its own
    mixed = torch._foreach_norm([w, torch.ones(3, dtype=torch.float64)])
    np.testing.assert_allclose(mixed[0], torch.linalg.vector_norm(rw), rtol=1e-12)
    np.testing.assert_allclose(mixed[1], 3 ** 0.5, rtol=1e-12)
    # the update reads the same averaged shards: clipping with torch's function matches one process
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    ref_model = make()
    backward(ref_model, *batch(comm.size))
    want = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.01)
    np.testing.assert_allclose(total, want, rtol=1e-12)
    opt.step()
    torch.optim.SGD(ref_model.parameters(), lr=0.1).step()
    for p, q in zip(model.state_dict().values(), ref_model.state_dict().values()):
        np.testing.assert_allclose(p, q, rtol=1e-12, atol=1e-15)
    # after step() .grad is still the sharded average: a norm logged there reads the same
    np.testing.assert_allclose(torch.nn.utils.get_total_norm(grads), torch.nn.utils.get_total_norm(
        [p.grad for p in ref_model.parameters()]), rtol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_gradient_reads_as_one_processs_norm(comm, bad):
    """One element of one rank's gradient not finite: every rank's ``.grad`` is non-finite (so that
    each rank's GradScaler skips), and its norms read what one process's read: inf for an infinity,
    NaN for a NaN (they read NaN for an infinity before)."""
    norms = []
    for size, rank in ((comm.size, comm.rank), (1, 0)):
        model = make()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                                   strategy=DeAR(**SMALL)) if size > 1 else None
        poke = torch.zeros(3, dtype=torch.float64)
        if size == 1 or rank == comm.size - 1:
            poke[1] = bad
        model[2].bias.register_hook(lambda g, poke=poke: g + poke)
        x, y = batch(comm.size)
        sl = slice(rank * LOCAL, rank * LOCAL + LOCAL * (comm.size if size == 1 else 1))
        backward(model, x[sl], y[sl])
        if opt is not None:
            assert all(not torch.isfinite(p.grad).any() for p in model.parameters())
        read = [torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]),
                model[2].bias.grad.norm()]
        clipped = (opt.clip_grad_norm_(1.0) if opt is not None
                   else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        norms.append([str(float(v)) for v in [*read, clipped]])
        if opt is not None:
            opt.close()
    want = "nan" if bad != bad else "inf"
    assert norms == [[want] * 3] * 2, norms


@pytest.mark.mpi(min_size=2)
def test_after_synchronize_and_in_copies_norms_are_local_reads(comm):
    model, opt = sharded(comm)
    ref = reference(comm.size)
    opt.synchronize()           # .grad is the whole average on every rank: no collective in a norm
    for p, r in zip(model.parameters(), ref):
        np.testing.assert_allclose(p.grad, r, rtol=1e-12, atol=1e-15)
    if comm.rank == 0:          # one rank alone reads a norm: nothing to wait for
        np.testing.assert_allclose(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]),
                                   torch.nn.utils.get_total_norm(ref), rtol=1e-12)
    comm.barrier()
    # a copied gradient is a plain tensor of its own; a saved gradient loads as a plain tensor
    twin = copy.deepcopy(model[0].weight.grad)
    assert type(twin) is torch.Tensor and twin.data_ptr() != model[0].weight.grad.data_ptr()
    buf = io.BytesIO()
    torch.save(model[0].weight.grad, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert type(loaded) is torch.Tensor
    np.testing.assert_array_equal(loaded, model[0].weight.grad.detach().clone())
    # after zero_grad() (until the next reduction) .grad is this rank's own: a norm read is local
    opt.zero_grad()
    if comm.rank == 0:
        assert float(model[0].weight.grad.norm()) == 0.0
    comm.barrier()


@pytest.mark.mpi(min_size=2)
def test_two_norms_follow_unscale_and_clipping_without_communication(comm):
    """The AMP loop: unscale, clip with torch's function, log the norm on rank 0 alone.  The
    2-norms taken with the reduction follow both in-place scalings, so that rank 0 reads them
    alone; a read that had to communicate would be a call the other ranks never make, and every
    rank would fail at the barrier after it (MismatchError)."""
    model = make()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                               strategy=DeAR(**SMALL))
    ref_model = make()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    x, y = batch(comm.size)
    sl = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
    for run, (m, o, xs, ys) in enumerate([(model, opt, x[sl], y[sl]), (ref_model, ref_opt, x, y)]):
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        o.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(m(xs), ys)).backward()
        scaler.unscale_(o)
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        if run == 0:
            got = total
            if comm.rank == 0:      # one rank alone: held
                after = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
                weight = m[2].weight.grad.norm()
            comm.barrier()
        else:
            np.testing.assert_allclose(got, total, rtol=1e-12)
            if comm.rank == 0:
                np.testing.assert_allclose(after, torch.nn.utils.get_total_norm(
                    [p.grad for p in m.parameters()]), rtol=1e-12)
                np.testing.assert_allclose(after, 0.01, rtol=1e-6)
                np.testing.assert_allclose(weight, m[2].weight.grad.norm(), rtol=1e-12)
        scaler.step(o)
        scaler.update()
    for p, q in zip(model.state_dict().values(), ref_model.state_dict().values()):
        np.testing.assert_allclose(p, q, rtol=1e-12, atol=1e-15)
    # another change (an added term) is not followed: the next read takes the norms again, on every rank
    model[2].bias.grad.add_(1.0)
    ref_model[2].bias.grad.add_(1.0)
    np.testing.assert_allclose(model[2].bias.grad.norm(), ref_model[2].bias.grad.norm(), rtol=1e-12)
    # scalings of every spelling are followed: twice by one factor, a division, a factor per tensor
    half = torch.tensor(0.5, dtype=torch.float64)
    for m in (model, ref_model):
        grads = [p.grad for p in m.parameters()]
        torch._foreach_mul_(grads, half)
        torch._foreach_mul_(grads, half)
        grads[0].div_(4.0)
        torch._foreach_mul_(grads, [float(i + 1) for i in range(len(grads))])
    if comm.rank == 0:
        for p, q in zip(model.parameters(), ref_model.parameters()):
            np.testing.assert_allclose(p.grad.norm(), q.grad.norm(), rtol=1e-12)
    comm.barrier()


@pytest.mark.mpi(min_size=2)
def test_reads_of_the_values_see_the_whole_average(comm):
    """Reads that the shards' norms do not give (a norm over a dimension, a matrix norm, a sum, a
    clone, ``isfinite``, ``.data``, a list) read what one process reads: the first gathers the whole
    average on every rank (they read this rank's own pass outside its shards before).  In-place
    writes that read no gradient (a clamp) communicate nothing."""
    model, opt = sharded(comm)
    ref = reference(comm.size)
    w, rw = model[2].weight.grad, ref[2]
    seq = comm.seq
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e3)      # writes only: no collective
    assert comm.seq == seq
    got = w.norm(dim=0)
    np.testing.assert_allclose(got, rw.norm(dim=0), rtol=1e-12)
    assert comm.seq > seq       # gathered once; then .grad is plain, every read local
    seq = comm.seq
    reads = {"matrix norm": (torch.linalg.norm(w, ord=2), torch.linalg.norm(rw, ord=2)),
             "nuclear": (w.norm(p="nuc"), rw.norm(p="nuc")),
             "negative order": (torch.linalg.vector_norm(w, -1.0), torch.linalg.vector_norm(rw, -1.0)),
             "sum": (w.sum(), rw.sum()), "abs max": (w.abs().max(), rw.abs().max()),
             "clone": (w.clone(), rw), "data": (w.data, rw),
             "tolist": (torch.tensor(w.tolist(), dtype=torch.float64), rw),
             "isfinite": (torch.isfinite(w).all(), torch.tensor(True))}
    for name, (a, b) in reads.items():
        np.testing.assert_allclose(a, b, rtol=1e-12, err_msg=name)
    for p, r in zip(model.parameters(), ref):
        np.testing.assert_allclose(p.grad, r, rtol=1e-12, atol=1e-15)
    assert comm.seq == seq


@pytest.mark.mpi(min_size=2)
def test_gradient_centralization_and_a_read_after_step_train_as_one_process(comm):
    """Gradient centralization (each weight's gradient minus its mean over the input dimensions,
    in place) before the step, and the gradient logged after it: each reads values, on every rank."""
    model, opt = sharded(comm)
    ref_model = make()
    backward(ref_model, *batch(comm.size))
    for m in (model, ref_model):
        for p in m.parameters():
            if p.dim() > 1:
                p.grad.sub_(p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True))
    opt.step()
    torch.optim.SGD(ref_model.parameters(), lr=0.1).step()
    for p, q in zip(model.state_dict().values(), ref_model.state_dict().values()):
        np.testing.assert_allclose(p, q, rtol=1e-12, atol=1e-15)
    for p, q in zip(model.parameters(), ref_model.parameters()):       # after step(): the whole average
        np.testing.assert_allclose(p.grad.abs().max(), q.grad.abs().max(), rtol=1e-12)
