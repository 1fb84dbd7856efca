"""The training loops people write, through DistributedOptimizer, against one process on the whole batch.

One body, looped over strategies and patterns: every rank trains on its slice
of each global batch; the reference is plain torch training the same model on
the concatenated batch with the same loop (clipping: ours, Horovod's, torch's
under a GradScaler; autocast, GradScaler with an inf injected on the last rank,
accumulation, a checkpoint resumed without ``flush()``, evaluation mid-training,
an unused head, a head used at some steps only (by some ranks' samples, or by none:
left out of that step's update, or updated with zeros after
``zero_grad(set_to_none=False)``), gradual unfreezing, a layer frozen after training then
unfrozen (its momentum kept meanwhile, through a checkpoint too), a parameter group added for
the unfrozen layer, the model converted to float64 and a parameter's ``.data``
assigned right after a step, unfreezing in a model trained in eval mode, gradients
computed with ``torch.func`` and assigned to ``.grad``, an EMA and weight clipping
right after each step, no ``flush()``, a gradient set to ``None`` after ``backward()``: by hand,
by a sub-module's ``zero_grad()``; reentrant activation checkpointing, whose recomputed segment
gives the first gradients of a backward in a backward of its own).
Parameters must match the reference and be bitwise equal across ranks.
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings

import numpy as np
import pytest

from conftest import HAVE_TORCH, SMALL, STRATEGIES, assert_same_on_every_rank, rank_part, readme_example

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib import ValidationError
    from commlib.bindings.torch import DistributedOptimizer
    from commlib.collectives import AllReduce, DeAR, SelSync, SyncSwitch

    torch.set_num_threads(1)

LOCAL = 4          # samples per rank per step (even: no_sync splits it in two)
STEPS = 4
CUT = 2            # checkpoint / evaluation / injected inf after this many steps
MAX_NORM = 0.05    # small enough that every step clips
CLIP_VALUE = 0.02  # clamps some gradient elements
WEIGHT_CLIP = 0.3  # clamps some parameters after each step (WGAN's critic)
# routed-head: which of the global batch's samples go through the aux head, per step (an expert
# every token reaches, none, only the first rank's, all): no rank uses it at step 1
ROUTED = [lambda i: True, lambda i: False, lambda i: i < LOCAL, lambda i: True]
PATTERNS = ["clip-horovod", "clip", "clip-torch", "bf16", "fp16-scaler", "no_sync", "checkpoint", "eval",
            "unused-head", "unfreeze", "refreeze", "add-group", "to-double", "eval-mode", "assigned-grads",
            "ema", "weight-clip", "routed-head", "routed-zeros", "dropped-grad", "checkpointed"]

# Mixed precision is compared with a single-process run under the same autocast.  The ranks'
# weight gradients come from 16-bit matmuls over their own slice, averaged afterwards, where the
# reference sums the whole batch in one matmul, so a gradient element may differ by about one
# unit in the last place of the format: 2**-8 relative for bf16, 2**-11 for fp16.  bf16 (no
# clipping, |g| <~ 1, lr 0.1, momentum 0.9, STEPS=4): about 4 * 0.1 * 4e-3 ~ 2e-3 in the
# parameters (measured: 5e-4 at 4 ranks).  fp16 (clipped to norm 0.05, so each step moves a
# parameter by <= 5e-3): about 4 * 5e-3 * 5e-4 ~ 1e-5, bounded at 2e-5 (measured: 1.5e-6).
TOLERANCE = {"bf16": (0.0, 2e-3), "fp16-scaler": (0.0, 2e-5)}     # (rtol, atol)


class Net(torch.nn.Module if HAVE_TORCH else object):
    def __init__(self, head: bool):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)
        if head:                       # a head this run never uses
            self.aux = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make(seed: int, pattern: str) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(head=pattern in ("unused-head", "routed-head", "routed-zeros"))
    params = model.fc2.parameters() if pattern == "add-group" else model.parameters()
    return model, torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(LOCAL * size, 6, generator=g), torch.randn(LOCAL * size, 3, generator=g)


def autocast(pattern: str):
    dtype = {"bf16": torch.bfloat16, "fp16-scaler": torch.float16}.get(pattern)
    return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()


def wrap(comm, strategy: str, model: Net, base: torch.optim.Optimizer) -> DistributedOptimizer:
    return DistributedOptimizer(base, model, strategy=STRATEGIES[strategy](), comm=comm)


def train(comm, strategy: str | None, pattern: str) -> dict:
    """``strategy=None``: the single-process reference on the whole batch."""
    rank, size = comm.rank, comm.size
    model, opt = make(rank if strategy else 0, pattern)
    if pattern in ("unfreeze", "eval-mode"):    # gradual unfreezing: fc1 frozen when wrapped, then fc2 frozen
        model.fc1.requires_grad_(False)
    if pattern == "eval-mode":      # trained in eval mode (dropout off, as RLHF loops do), fc1 unfrozen
        model.eval()
    if strategy:
        opt = wrap(comm, strategy, model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=pattern in ("fp16-scaler", "clip-torch"))
    out = {"norms": [], "evals": [], "scales": [], "state": {}}
    if pattern == "ema":        # after wrapping: the copy is current and a model of its own
        swa = torch.optim.swa_utils
        ema = swa.AveragedModel(model, multi_avg_fn=swa.get_ema_multi_avg_fn(0.5))
    for step in range(STEPS):
        x, y = batch(step, size)
        routed = torch.tensor([ROUTED[step](i) for i in range(len(x))])
        if strategy:
            x, y, routed = rank_part(comm, LOCAL, x, y, routed)
        if strategy and pattern in ("checkpoint", "refreeze") and step == CUT:     # resume fresh, no flush()
            buf = io.BytesIO()      # through torch.save and torch.load's default weights_only=True
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            buf.seek(0)
            msd, osd = torch.load(buf).values()
            if isinstance(opt.strategy, SyncSwitch):
                opt.strategy.close()
            model, base = make(rank + 7, pattern)
            if pattern == "refreeze":
                model.fc2.requires_grad_(False)
            opt = wrap(comm, strategy, model, base)
            model.load_state_dict(msd)
            opt.load_state_dict(osd)
        if pattern in ("unfreeze", "eval-mode") and step in (1, 3):
            (model.fc1 if step == 1 else model.fc2).requires_grad_(step == 1)
        if pattern == "refreeze" and step in (1, 3):    # frozen after training, then trained on
            model.fc2.requires_grad_(step == 3)
        if pattern == "add-group" and step == 1:       # fine-tune fc1 from now on, at its own rate
            opt.add_param_group({"params": model.fc1.parameters(), "lr": 0.05})
        if pattern == "to-double" and step in (1, 2):  # converted, then .data assigned, right after a step
            if step == 1:
                model.double()                          # re-planned in float64 at the next forward
            else:
                model.fc2.bias.data = torch.full_like(model.fc2.bias, 0.25)
        if pattern == "to-double" and step >= 1:
            x, y = x.double(), y.double()
        opt.zero_grad(set_to_none=pattern != "routed-zeros")     # zeros: an idle head still moves
        loss_fn = torch.nn.functional.mse_loss
        if pattern == "no_sync":
            half = len(x) // 2
            with opt.no_sync() if strategy else contextlib.nullcontext():
                (loss_fn(model(x[:half]), y[:half]) / 2).backward()
            loss = loss_fn(model(x[half:]), y[half:]) / 2
        elif pattern == "assigned-grads":   # computed functionally and assigned: no backward()
            assign_functional_grads(model, loss_fn, x, y)
        elif pattern.startswith("routed"):  # the head's loss on the routed samples, per sample of the batch
            h = torch.tanh(model.fc1(x))
            loss = loss_fn(model.fc2(h), y)
            if routed.any():                # not run without samples (as MoE layers skip an idle expert)
                loss = loss + model.aux(h[routed]).pow(2).sum() / len(x)
        elif pattern == "checkpointed":     # fc2 recomputed in a nested backward, where its gradients come
            h = torch.tanh(model.fc1(x))    # first (before fc1's, in the enclosing backward)
            loss = loss_fn(torch.utils.checkpoint.checkpoint(model.fc2, h, use_reentrant=True), y)
        else:
            with autocast(pattern):
                loss = loss_fn(model(x), y)
        if pattern == "fp16-scaler" and step == CUT - 1 and (not strategy or rank == size - 1):
            # one rank overflows in one gradient element: every rank must skip this step
            loss = loss + model.fc1.bias[0] * float("inf")
        if pattern != "assigned-grads":
            scaler.scale(loss).backward()
        if pattern == "dropped-grad" and step == 1:   # dropped after backward(): this step leaves it
            model.fc2.weight.grad = None
        if pattern == "dropped-grad" and step == 2:
            model.fc1.zero_grad()                       # a module's default: set_to_none=True
        if pattern == "clip-horovod":
            if strategy:
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            with opt.skip_synchronize() if strategy else contextlib.nullcontext():
                opt.step()
        elif pattern in ("clip", "fp16-scaler", "clip-torch"):
            scaler.unscale_(opt)
            if pattern == "clip-torch":     # by value, then by norm: the norm of the clamped average
                torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
            norm = (opt.clip_grad_norm_(MAX_NORM) if strategy and pattern != "clip-torch"
                    else torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            out["norms"].append(float(norm))
            scaler.step(opt)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        else:
            opt.step()
        if pattern == "ema":        # right after step(), no flush(): DeAR's all-gathers are in flight
            ema.update_parameters(model)
        if pattern == "weight-clip":
            for p in model.parameters():
                p.data.clamp_(-WEIGHT_CLIP, WEIGHT_CLIP)
        if pattern == "refreeze" and step == CUT:      # fc2 frozen: its momentum is in the checkpoint
            out["state"] = {i: {k: np.asarray(v).copy() for k, v in st.items()}
                            for i, st in opt.state_dict()["state"].items()}
        if pattern == "eval" and step == CUT:
            model.eval()
            with torch.no_grad():
                out["evals"].append(model(batch(99, 1)[0]).numpy().copy())
            model.train()
    out["model"] = model
    out["opt"] = opt
    out["ema"] = params_of(ema.module) if pattern == "ema" else None
    return out


def assign_functional_grads(model: Net, loss_fn, x: torch.Tensor, y: torch.Tensor) -> None:
    """``p.grad = ...`` from ``torch.func.grad`` (no backward() on the model: no hook fires)."""
    params = dict(model.named_parameters())
    grads = torch.func.grad(lambda ps: loss_fn(torch.func.functional_call(model, ps, (x,)), y))(params)
    for name, p in params.items():
        p.grad = grads[name]


def params_of(model: Net) -> np.ndarray:
    """Through ``model.state_dict()``, whose hook completes DeAR's all-gathers (no ``flush()``)."""
    return torch.cat([v.reshape(-1) for v in model.state_dict().values()]).numpy()


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_loop_trains_as_one_process(comm, strategy, pattern):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(comm, strategy, pattern)
    ref = train(comm, None, pattern)
    opt = got["opt"]
    vec = params_of(got["model"])
    assert_same_on_every_rank(comm, vec)
    rtol, atol = TOLERANCE.get(pattern, (2e-5, 2e-6))
    np.testing.assert_allclose(vec, params_of(ref["model"]), rtol=rtol, atol=atol)
    np.testing.assert_allclose(got["evals"], ref["evals"], rtol=rtol, atol=atol)
    assert sorted(got["state"]) == sorted(ref["state"])
    for i, st in ref["state"].items():
        for k, v in st.items():
            np.testing.assert_allclose(got["state"][i][k], v, rtol=rtol, atol=atol, err_msg=f"param {i} {k}")
    if pattern == "ema":
        np.testing.assert_allclose(got["ema"], ref["ema"], rtol=rtol, atol=atol)
    # the norm of fp16-made gradients differs as they do (2**-11 relative per element); at the
    # skipped step it is inf or nan, on every rank as in the reference
    finite = np.isfinite(ref["norms"])
    np.testing.assert_array_equal(np.isfinite(got["norms"]), finite)
    np.testing.assert_allclose(np.array(got["norms"])[finite], np.array(ref["norms"])[finite],
                               rtol=1e-3 if pattern == "fp16-scaler" else 1e-5)
    assert got["scales"] == ref["scales"]       # the injected inf halved the scale on every rank
    unused_warned = [w for w in caught if "no rank gave a gradient" in str(w.message)]
    assert len(unused_warned) == (pattern == "unused-head"), [str(w.message) for w in caught]
    if pattern == "unused-head":
        np.testing.assert_array_equal(got["model"].aux.weight.detach().numpy(),
                                      make(0, pattern)[0].aux.weight.detach().numpy())
    if isinstance(opt.strategy, SyncSwitch):
        assert opt.strategy.phase == "bsp"
        opt.strategy.close()


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_gradients_are_averaged_when_backward_returns(comm, strategy):
    """``.grad`` right after ``backward()`` is the whole batch's gradient (DeAR: after ``synchronize()``)."""
    model, base = make(comm.rank, "plain")
    opt = wrap(comm, strategy, model, base)
    ref, _ = make(0, "plain")
    x, y = batch(0, comm.size)
    mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
    torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    if strategy == "dear":
        opt.synchronize()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=2e-5, atol=1e-7)
    opt.step()
    if isinstance(opt.strategy, SyncSwitch):
        opt.strategy.close()


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_clip_bad_arguments_raise_on_every_rank(comm, strategy):
    model, base = make(comm.rank, "plain")
    opt = wrap(comm, strategy, model, base)
    x, y = batch(0, comm.size)
    torch.nn.functional.mse_loss(model(x[:LOCAL]), y[:LOCAL]).backward()
    before = comm.seq
    if strategy == "allreduce":      # the same bad argument on every rank: raised before any collective
        with pytest.raises(ValueError, match="max_norm -1.0"):
            opt.clip_grad_norm_(-1.0)
        assert comm.seq == before
    else:                            # one rank's bad argument: every rank raises after the norm's all-gather
        with pytest.raises(ValueError, match="rejected their arguments|max_norm nan"):
            opt.clip_grad_norm_(float("nan") if comm.rank == comm.size - 1 else 1.0)
    opt.step()


@pytest.mark.mpi
def test_selsync_gate_survives_an_overflowed_step(comm):
    """A step GradScaler skips (inf gradient) makes the gate sync and leaves its EWMA finite."""
    model, base = make(comm.rank, "plain")
    gate = SelSync(inner=AllReduce(**SMALL), delta=0.5, window=2, warmup=1, mode="grads")
    opt = DistributedOptimizer(base, model, strategy=gate, comm=comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(4):
        x, y = batch(step, comm.size)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[:LOCAL]), y[:LOCAL])
        if step == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert np.isfinite(gate.meter.value) and gate.trace[2][4]      # the overflowed step synced
    assert scaler.get_scale() == 512.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("inner", ["allreduce", "dear"])
def test_selsync_params_mode_makes_one_ranks_overflow_every_ranks(comm, inner):
    """SelSync(mode="params") synchronizes by averaging parameters, not gradients: an overflow on one
    rank (at a warm-up step and at a gated one) still reaches every rank, so every rank's GradScaler
    skips that step (no rank's parameters move) and backs off, alike (one rank skipped while the
    others updated, the parameter average mixed them, and the scalers parted)."""
    model, base = make(0, "plain")
    strategy = AllReduce(**SMALL) if inner == "allreduce" else DeAR(**SMALL)
    gate = SelSync(inner=strategy, delta=0.3, window=2, warmup=2, mode="params")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = DistributedOptimizer(base, model, strategy=gate, comm=comm, grad_scaler=scaler)
    scales = []
    for step in range(7):
        x, y = batch(step + 17 * comm.rank, comm.size)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[:LOCAL]), y[:LOCAL])
        if step in (1, 4) and comm.rank == 0:
            loss = loss + model.fc1.bias[0] * float("inf")
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        if step in (1, 4):
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), step
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales[1] == 2 * scales[4] == 512.0, scales
    table = comm.allgather(np.array(scales))
    assert all(np.array_equal(t, table[0]) for t in table), table
    opt.flush()
    assert_same_on_every_rank(comm, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_add_param_group_refusals_leave_the_optimizer_as_it_was(comm, strategy):
    """A group that differs on one rank raises on every rank and is not added; adding one between
    backward() and step() raises; after step() the same group is added (its training against one
    process is pattern add-group)."""
    model, base = make(comm.rank, "add-group")
    opt = wrap(comm, strategy, model, base)
    last = comm.size - 1
    if comm.size > 1:
        params = [model.fc1.weight] if comm.rank == last else list(model.fc1.parameters())
        with pytest.raises(ValidationError, match=f"rank {last}"):
            opt.add_param_group({"params": params, "lr": 0.05})
    assert len(opt.param_groups) == len(base.param_groups) == 1
    x, y = batch(0, comm.size)
    torch.nn.functional.mse_loss(model(x[:LOCAL]), y[:LOCAL]).backward()
    with pytest.raises(RuntimeError, match="before the forward"):
        opt.add_param_group({"params": model.fc1.parameters(), "lr": 0.05})
    assert len(opt.param_groups) == 1
    opt.step()
    opt.add_param_group({"params": model.fc1.parameters(), "lr": 0.05})
    assert [len(g["params"]) for g in base.param_groups] == [2, 2]


@pytest.mark.mpi
def test_readme_loop_runs_verbatim(comm, tmp_path):
    """README's torch example, run as it stands, against the same loop in one process on whole batches."""
    rank, size = comm.rank, comm.size

    def loader(first: int, n: int, ranks: slice) -> list:
        return [tuple(t[ranks] for t in batch(first + i, size)) for i in range(n)]

    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    model, _ = make(rank, "plain")
    ns = {"model": model, "loss_fn": torch.nn.functional.mse_loss, "loader": loader(0, 3, mine),
          "val_loader": loader(50, 2, mine), "epochs": 2, "device": "cpu", "amp_dtype": torch.bfloat16,
          "path": tmp_path / "ckpt.pt"}
    exec(compile(readme_example("Training with a strategy (PyTorch)"), "README.md", "exec"), ns)

    ref, _ = make(0, "plain")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
    ema = None          # AveragedModel: the first update copies, the next ones lerp
    for _epoch in range(2):
        for x, y in loader(0, 3, slice(None)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(ref(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                if ema is None:
                    ema = [p.detach().clone() for p in ref.parameters()]
                else:
                    torch._foreach_lerp_(ema, list(ref.parameters()), 1 - 0.999)
            sched.step()
    vec = params_of(model)
    assert_same_on_every_rank(comm, vec)
    moved = np.abs(params_of(ref) - params_of(make(0, "plain")[0])).max()
    np.testing.assert_allclose(vec, params_of(ref), rtol=0, atol=moved / 20)    # bf16: see TOLERANCE
    ema_vec = torch.cat([p.detach().reshape(-1) for p in ns["ema"].module.parameters()]).numpy()
    ema_ref = torch.cat([e.reshape(-1) for e in ema]).numpy()
    np.testing.assert_allclose(ema_vec, ema_ref, rtol=0, atol=moved / 20)
    with torch.no_grad():
        val = sum(torch.nn.functional.mse_loss(ref(x), y).item() for x, y in loader(50, 2, slice(None))) / 2
    assert ns["val_loss"] == pytest.approx(val, rel=2e-3)     # every rank's: the mean over all shards
    if rank == 0:
        saved = torch.load(ns["path"])
        saved_params = torch.cat([v.reshape(-1) for v in saved["model"].values()]).numpy()
        np.testing.assert_array_equal(saved_params, vec)
        plain = torch.optim.AdamW(make(0, "plain")[0].parameters(), lr=1e-3)
        plain.load_state_dict({k: v for k, v in saved["opt"].items() if k != "commlib"})


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_a_forward_with_nothing_trainable_keeps_the_plan(comm, strategy):
    """Features from the frozen model (train mode, grad on) between steps: no re-plan, no error."""

    def run(dist: bool) -> Net:
        model, opt = make(comm.rank if dist else 0, "plain")
        if dist:
            opt = wrap(comm, strategy, model, opt)
        for step in range(3):
            x, y = batch(step, comm.size)
            mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL) if dist else slice(None)
            if step == 1:
                model.requires_grad_(False)
                model(x[mine])
                model.requires_grad_(True)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
        return model

    vec = params_of(run(True))
    np.testing.assert_allclose(vec, params_of(run(False)), rtol=2e-5, atol=2e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_copies_of_the_model_are_current_and_inert(comm, strategy):
    """copy.deepcopy (an EMA), AveragedModel and torch.save of the wrapped model mid-training (DeAR's
    all-gathers in flight): the copies hold the current parameters, run without communicating (one
    rank alone, in training mode), and the original trains on as one process."""
    import io

    def run(dist: bool) -> tuple[Net, list]:
        model, opt = make(comm.rank if dist else 0, "plain")
        if dist:
            opt = wrap(comm, strategy, model, opt)
        copies = []
        for step in range(STEPS):
            x, y = batch(step, comm.size)
            mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL) if dist else slice(None)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
            if step == CUT:
                buf = io.BytesIO()
                torch.save(model, buf)
                buf.seek(0)
                copies = [copy.deepcopy(model), torch.optim.swa_utils.AveragedModel(model).module,
                          torch.load(buf, weights_only=False)]
        return model, copies

    got, copies = run(True)
    ref, ref_copies = run(False)
    np.testing.assert_allclose(params_of(got), params_of(ref), rtol=2e-5, atol=2e-6)
    for c in copies:
        np.testing.assert_allclose(params_of(c), params_of(ref_copies[0]), rtol=2e-5, atol=2e-6)
    if comm.rank == 0:                    # no collective behind a copy's forward or backward
        c = copies[0]
        c(batch(0, 1)[0]).sum().backward()
        c.eval()
        c(batch(0, 1)[0])
    comm.barrier()
    np.testing.assert_allclose(params_of(got), params_of(ref), rtol=2e-5, atol=2e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_gan_with_two_optimizers_trains_as_one_process(comm, strategy):
    """A generator and a discriminator, each with its own optimizer; the discriminator is frozen for
    the generator's step (its forward then trains nothing: no re-plan) and unfrozen for its own."""

    def run(dist: bool) -> np.ndarray:
        torch.manual_seed(0)
        gen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        disc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        og, od = torch.optim.Adam(gen.parameters(), lr=1e-2), torch.optim.Adam(disc.parameters(), lr=1e-2)
        if dist:
            og, od = wrap(comm, strategy, gen, og), wrap(comm, strategy, disc, od)
        g = torch.Generator().manual_seed(5)
        softplus = torch.nn.functional.softplus
        for _ in range(STEPS):
            z, real = torch.randn(2, LOCAL * comm.size, 4, generator=g)
            if dist:
                z, real = z.chunk(comm.size)[comm.rank], real.chunk(comm.size)[comm.rank]
            disc.requires_grad_(True)
            od.zero_grad()
            (softplus(-disc(real + 2)).mean() + softplus(disc(gen(z).detach())).mean()).backward()
            od.step()
            disc.requires_grad_(False)
            og.zero_grad()
            softplus(-disc(gen(z))).mean().backward()
            og.step()
        return torch.cat([v.reshape(-1) for m in (gen, disc) for v in m.state_dict().values()]).numpy()

    np.testing.assert_allclose(run(True), run(False), rtol=2e-5, atol=2e-6)
