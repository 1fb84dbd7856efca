"""bindings.torch: DistributedOptimizer with AllReduce and DeAR against single-process training.

Every rank trains on its slice of a global batch; the reference is one
process training the same model on the whole batch (the model, data and reference:
torch_reference.py).  The wrapped optimizer's state and hooks: test_optimizer_state.py.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import HAVE_TORCH, clip_grad_norm, rank_part, trains_as_one_process
from conftest import STRATEGIES as LOOP_STRATEGIES
from torch_reference import (
    LOCAL,
    STEPS,
    STRATEGIES,
    assert_close,
    batch,
    distributed,
    loss_fn,
    make_model,
    reference,
    same_on_all_ranks,
)

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
    from commlib.collectives import DeAR

@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_matches_single_process(comm, kind, name):
    if "params" in name and kind == "adamw":
        pytest.skip("averaging parameters after local Adam steps is not BSP (Adam is nonlinear in the "
                    "gradient); gradient mode is, and SGD with momentum is in both modes")
    model, opt = distributed(comm, kind, STRATEGIES[name](), STEPS)
    assert len(opt.buckets) >= (3 if name in ("allreduce", "dear") else 1), opt.plan
    with opt.flush():
        same_on_all_ranks(comm, model)
        ref, _ = reference(kind, comm.size, STEPS)
        assert_close(model, ref)
    # the parameter without a gradient is untouched, as in single-process training
    np.testing.assert_array_equal(model.unused.detach().numpy(), make_model(0).unused.detach().numpy())


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_tuned_cap_replans_mid_training_and_still_matches(comm, kind):
    """The tuner re-plans buckets (and re-shards DeAR's optimizer state) between steps: same result."""
    steps = 8
    tune = {"trials": 3, "window": 1, "skip": 0, "low_mb": 0.0001, "high_mb": 0.002}
    model, opt = distributed(comm, kind, DeAR(cap_mb=0.0003, first_cap_mb=0.0001, tune=tune), steps)
    tuner = opt.strategy.tuner
    assert tuner.done and len(tuner.history) == 3
    caps = {c for c, _ in tuner.history}
    assert len(caps) > 1, tuner.history            # it did try other caps (and re-planned)
    assert opt.strategy.cap_bytes == tuner.best_cap
    with opt.flush():
        ref, _ = reference(kind, comm.size, steps)
        assert_close(model, ref)
        same_on_all_ranks(comm, model)
    sd = opt.state_dict()["commlib"]["strategy"]["tuner"]
    assert sd["history"] == tuner.history and sd["done"]


@pytest.mark.mpi
@pytest.mark.parametrize("set_passes", [False, True])
@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_backward_passes_per_step(comm, name, set_passes):
    """Three passes, each on a third of the batch with its loss scaled, add up to one pass."""
    model, opt = distributed(comm, "sgd", STRATEGIES[name](), 3, extra_forward=False, passes=1)
    model3, opt3 = distributed(comm, "sgd", STRATEGIES[name](), 3, extra_forward=False, passes=3,
                               set_passes=set_passes)
    opt.flush()
    opt3.flush()
    for p, q in zip(model.parameters(), model3.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_dear_leaves_gathers_in_flight_after_step_and_flush_lands_them(comm):
    """After step() the all-gathers are still in flight (a parameter used then waits for its own:
    test_param_reads); flush() lands them all."""
    model, opt = distributed(comm, "sgd", DeAR(cap_mb=0.0003, first_cap_mb=0.0001), 2, extra_forward=False)
    assert opt.strategy.writes_in_flight()         # all-gathers left to overlap a forward
    opt.flush()
    assert not opt.strategy.writes_in_flight()
    same_on_all_ranks(comm, model)


@pytest.mark.mpi
def test_broadcast_helpers(comm):
    model = make_model(comm.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (comm.rank + 1), momentum=0.9)
    loss_fn(model, *batch(comm.rank, 1)).backward()
    opt.step()
    broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    broadcast_optimizer_state(opt, root_rank=0, comm=comm)
    same_on_all_ranks(comm, model)
    bufs = comm.allgather(opt.state[model.fc1.weight]["momentum_buffer"].reshape(-1).numpy())
    assert all(np.array_equal(bufs[r], bufs[0]) for r in range(comm.size))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.mpi
def test_ddp_comm_hook_routes_buckets_through_commlib(comm):
    from mpi4py import MPI

    from benchmarks._common import init_gloo
    from commlib.bindings.torch import register_comm_hook

    dist, why = init_gloo(MPI.COMM_WORLD, True)
    if dist is None:
        pytest.skip(f"no gloo process group: {why}")
    try:
        model = make_model(comm.rank)
        del model.unused                                  # DDP insists every parameter gets a gradient
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0002)
        register_comm_hook(ddp, comm)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref = make_model(0)
        del ref.unused
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        before = comm.seq
        for step in range(3):
            x, y = batch(step, comm.size)
            mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
            opt.zero_grad()
            loss_fn(ddp, x[mine], y[mine]).backward()
            opt.step()
            ref_opt.zero_grad()
            loss_fn(ref, x, y).backward()
            ref_opt.step()
        assert comm.seq - before >= 3                # every step's buckets went through commlib
        for p, q in zip(model.parameters(), ref.parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=2e-5, atol=2e-6)
        # a DDP over part of the world (a rank alone here) with the world's communicator: its
        # gradients were averaged over the world, silently; refused, and its own split taken
        alone = [dist.new_group([r]) for r in range(comm.size)][comm.rank]
        sub = torch.nn.parallel.DistributedDataParallel(make_model(0).fc1, process_group=alone)
        if comm.size > 1:
            with pytest.raises(ValueError, match="process group holds ranks"):
                register_comm_hook(sub, comm)
        own = comm.split(comm.rank, 0)
        register_comm_hook(sub, own)
        own.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_channels_last_model_trains_and_checkpoints_as_one_process(comm, name, when):
    """A CNN in channels_last (converted before wrapping, or after a step: a re-plan) keeps its layout in
    the buckets and trains as one process; the checkpoint's AdamW state is the reference's, in the
    parameters' layout, and a fresh channels_last optimizer resumes from it (it was refused:
    "not contiguous")."""
    channels_last = torch.channels_last

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.ReLU(), torch.nn.Conv2d(6, 4, 3),
                                   torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(300 + step)
        x = torch.randn(2 * comm.size, 3, 8, 8, generator=g).contiguous(memory_format=channels_last)
        return x, torch.randn(2 * comm.size, 2, generator=g)

    def train(model, opt, steps: range, dist: bool) -> None:
        for step in steps:
            x, y = data(step)
            mine = slice(2 * comm.rank, 2 * comm.rank + 2) if dist else slice(None)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()

    ref = make(0).to(memory_format=channels_last)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    train(ref, ref_opt, range(3), False)
    model = make(comm.rank)
    if when == "before":
        model.to(memory_format=channels_last)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model,
                               strategy=STRATEGIES[name](), comm=comm)
    if when == "after":             # mid-training: AdamW's state moves to the new layout too
        train(model, opt, range(1), True)
        opt.flush()
        model.to(memory_format=channels_last)
    train(model, opt, range(1 if when == "after" else 0, 3), True)
    assert model[0].weight.is_contiguous(memory_format=channels_last)
    msd, osd = model.state_dict(), opt.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(msd[k], v, rtol=1e-5, atol=1e-6, msg=k)
    for i, st in ref_opt.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(osd["state"][i][key], st[key], rtol=1e-5, atol=1e-7, msg=f"{i} {key}")
    model2 = make(comm.rank + 9).to(memory_format=channels_last)
    opt2 = DistributedOptimizer(torch.optim.AdamW(model2.parameters(), lr=0.01), model2,
                                strategy=STRATEGIES[name](), comm=comm)
    model2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    train(ref, ref_opt, range(3, 5), False)
    train(model2, opt2, range(3, 5), True)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model2.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.mpi
@pytest.mark.parametrize("first,second", [("allreduce", "allreduce"), ("allreduce", "dear"),
                                          ("dear", "dear")])
def test_a_new_optimizer_for_the_same_model_replaces_the_old_one(comm, first, second):
    """A new phase of training with a new optimizer (AdamW, then SGD over the same parameters): the
    old DistributedOptimizer's hooks kept averaging (twice the communication) and re-planning against
    the new one's (with DeAR: "parameters were moved ... while dear's communication was still writing
    them").  The new one replaces it; the old one refuses to step; training matches one process."""
    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=0.01)

    ref = make_model(0)
    model = make_model(comm.rank)
    opt = DistributedOptimizer(adamw(model), model, strategy=STRATEGIES[first](), comm=comm,
                               find_unused_parameters=True)     # Net.unused never gets one
    ref_opt = adamw(ref)
    mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
    for step in range(STEPS):
        if step == 2:
            old = opt
            opt = DistributedOptimizer(sgd(model), model, strategy=STRATEGIES[second](), comm=comm,
                                       find_unused_parameters=True)
            ref_opt = sgd(ref)
            with pytest.raises(RuntimeError, match="replaced by a newer one"):
                old.step()
        x, y = batch(step, comm.size)
        for m, o, part in ((ref, ref_opt, slice(None)), (model, opt, mine)):
            o.zero_grad()
            loss_fn(m, x[part], y[part]).backward()
            o.step()
    opt.flush()
    same_on_all_ranks(comm, model)
    assert_close(model, ref)


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_close_leaves_a_plain_model_that_torch_jit_scripts(comm, name):
    """torch.jit.script compiles a module's hooks and cannot compile the wrapper's: it named none
    of them ("'ModelHook' object has no attribute '__name__'").  Now that error says what to do,
    and after ``close()`` the model and its parameters carry no hook: it scripts, the scripted
    model computes what one process's trained model computes, ``.grad`` is a plain tensor holding
    the whole average (where the strategy averages gradients), and ``step()`` refuses; for every
    strategy."""
    model, opt = distributed(comm, "sgd", STRATEGIES[name](), STEPS)
    ref, _ = reference("sgd", comm.size, STEPS)
    x, y = batch(STEPS, comm.size)
    mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
    opt.zero_grad()
    loss_fn(model, x[mine], y[mine]).backward()
    ref.zero_grad()
    loss_fn(ref, x, y).backward()
    twin = copy.deepcopy(model)                    # copies made during training: inert hooks
    ema = torch.optim.swa_utils.AveragedModel(model)
    with pytest.raises(AttributeError, match=r"call opt.close\(\) when training ends"):
        torch.jit.script(model)
    with pytest.raises(AttributeError, match=r"call opt.close\(\) when training ends"):
        torch.jit.script(twin)
    opt.close()
    for copied in (twin, ema.module):               # close() took the copies' hooks off too
        assert all(not m._forward_pre_hooks for m in copied.modules())
        with torch.no_grad():
            np.testing.assert_allclose(torch.jit.script(copied)(x).numpy(), ref(x).numpy(), rtol=1e-5,
                                       atol=1e-6)
    assert all(not m._forward_pre_hooks and not m._state_dict_pre_hooks for m in model.modules())
    assert all(not p._post_accumulate_grad_hooks and not p._backward_hooks for p in model.parameters())
    scripted = torch.jit.script(model)
    with torch.no_grad():
        np.testing.assert_allclose(scripted(x).numpy(), ref(x).numpy(), rtol=1e-5, atol=1e-6)
    local = opt.strategy.gradients_are_local()      # SelSync's parameter mode: each rank's own
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None and not local:
            assert type(p.grad) is torch.Tensor
            np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"closed by close\(\)"):
        opt.step()


class ComplexNet(torch.nn.Module if HAVE_TORCH else object):
    """A complex layer (spectral weights, as Fourier neural operators hold) before a real head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.complex64))
        self.b = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x.to(torch.complex64) @ self.w + self.b).abs())


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(LOOP_STRATEGIES))
def test_complex_parameters_train_as_one_process(comm, name):
    """Complex parameters (DDP averages them as pairs of reals): averaged, clipped by the global
    norm (of ``|z|``), updated (DeAR: on shards) and checkpointed as in one process.  The sparse
    exchange refuses them on every rank, saying so.  Wrapping refused every strategy
    ("dtype complex64 is not supported")."""
    from commlib import ValidationError
    from commlib.collectives import SyncSwitch

    def run(dist: bool):
        model = ComplexNet()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=LOOP_STRATEGIES[name](), comm=comm)
        norms = []
        for step in range(STEPS):
            x, y = batch(step, comm.size)
            if dist:
                x, y = rank_part(comm, LOCAL, x, y)
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
            opt.step()
        return model, opt, norms

    if name.startswith("sparse"):
        with pytest.raises(ValidationError, match="complex64; sparse exchange needs floating gradients"):
            run(True)
        return
    (model, opt, norms), (ref, ref_opt, ref_norms) = run(True), run(False)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == q.dtype
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=2e-5, atol=2e-6)
    for i, st in ref_sd["state"].items():
        for k, v in st.items():
            assert torch.as_tensor(sd["state"][i][k]).dtype == torch.as_tensor(v).dtype, (i, k)
            np.testing.assert_allclose(np.asarray(sd["state"][i][k]), np.asarray(v), rtol=2e-5, atol=1e-7)
    if isinstance(opt.strategy, SyncSwitch):
        opt.strategy.close()


@pytest.mark.mpi
def test_dropped_models_leave_no_owner_entries(comm):
    """Wrapping and dropping models again and again (a hyperparameter search in one process) kept
    an entry per parameter and per strategy in the binding's ownership tables for good (weakly held,
    but never removed): 170 B a parameter each time."""
    import gc

    from commlib.bindings import torch_owners

    def wrap_and_drop() -> None:
        model = make_model(0)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                   strategy=STRATEGIES["allreduce"](), comm=comm, find_unused_parameters=True)
        x, y = batch(0, comm.size)
        loss_fn(model, x[:LOCAL], y[:LOCAL]).backward()
        opt.step()
        opt.close()

    wrap_and_drop()
    gc.collect()
    before = len(torch_owners._OWNERS), len(torch_owners._DRIVERS)
    for _ in range(4):
        wrap_and_drop()
    gc.collect()
    assert (len(torch_owners._OWNERS), len(torch_owners._DRIVERS)) <= before


@pytest.mark.mpi
@pytest.mark.parametrize("assign", ["scaled", "constant", "scaled-clipped"])
@pytest.mark.parametrize("name", list(LOOP_STRATEGIES))
def test_a_grad_assigned_after_backward_is_what_the_update_reads(comm, name, assign):
    """``p.grad = p.grad * 0.5`` (or a tensor of the user's) between ``backward()`` and ``step()``:
    one process, DDP and AllReduce step with it; DeAR's shard update read the averaged gradient and
    ignored the assignment (the whole gradient applied, not half: 0.11 off), and ``opt.clip_grad_norm_``
    clipped by the norm of the gradients before it, under every strategy (1.8e-2 off after a step)."""
    def run(dist: bool) -> np.ndarray:
        model = make_model(comm.rank if dist else 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=LOOP_STRATEGIES[name](), comm=comm,
                                       find_unused_parameters=True)
        for step in range(3):
            x, y = batch(step, comm.size)
            part = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL) if dist else slice(None)
            opt.zero_grad()
            loss_fn(model, x[part], y[part]).backward()
            w = model.fc2.weight
            w.grad = torch.full_like(w, 0.25) if assign == "constant" else w.grad * 0.5
            if assign == "scaled-clipped":      # the norm of the gradients as they stand now
                clip_grad_norm(opt, model, dist, 0.1)
            opt.step()
        if dist:
            opt.flush()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    trains_as_one_process(comm, run)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_a_parameter_of_no_element_and_two_dimensions_trains(comm, name):
    """``nn.Linear(0, 3)``'s weight, shape ``(3, 0)``: contiguous, yet refused as having "gaps or
    overlaps" (its strides ``(1, 1)`` read as such), with ``.contiguous()`` for advice.  Wrapped, the
    model trains as one process on the concatenated batch."""
    def run(dist: bool) -> np.ndarray:
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"empty": torch.nn.Linear(0, 3), "fc": torch.nn.Linear(4, 3)}).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[name](), comm=comm)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(2 * comm.size, 4, generator=g, dtype=torch.float64)
            mine = x[2 * comm.rank:2 * comm.rank + 2] if dist else x
            opt.zero_grad()
            out = model["fc"](mine) + model["empty"](mine[:, :0])
            out.square().mean().backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    np.testing.assert_allclose(run(True), run(False), rtol=1e-12, atol=1e-14)
