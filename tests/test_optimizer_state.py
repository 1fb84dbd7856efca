"""The wrapped optimizer's state and step through DistributedOptimizer, against one process.

Its state consolidated in the wrapped optimizer's format, checkpointed and resumed (on fewer ranks
too), averaged where SelSync asks, edited as a loop edits one process's (``opt.state`` reset,
cleared, deleted, assigned); its own step hooks and an LR scheduler made over it before wrapping.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import HAVE_TORCH, rank_part
from torch_reference import (
    LOCAL,
    STEPS,
    STRATEGIES,
    Net,
    assert_close,
    batch,
    distributed,
    loss_fn,
    make_model,
    make_optimizer,
    reference,
    same_on_all_ranks,
)

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
    from commlib.collectives import AllReduce, DeAR, SelSync
    from commlib.errors import ValidationError


@pytest.mark.mpi
@pytest.mark.parametrize("sync_state", [True, False, None])
def test_selsync_sync_optimizer_state_averages_momentum(comm, sync_state):
    """SelSync in parameter mode asks the binding (``syncs_optimizer_state()``) to average the
    optimizer's state on synced steps, by default (``None``; it kept each rank's own, the
    prototype's flaw): every rank then holds the single-process momentum.  With ``False``,
    parameters still match (SGD is linear) but each rank keeps its own momentum."""
    strategy = SelSync(inner=AllReduce(cap_mb=0.0003), delta=0.0, mode="params",
                       sync_optimizer_state=sync_state)
    assert strategy.sync_optimizer_state is (sync_state is not False)
    assert SelSync(mode="grads").sync_optimizer_state is False    # grads mode: after drift only
    model, opt = distributed(comm, "sgd", strategy, STEPS)
    with opt.flush():
        ref, ref_opt = reference("sgd", comm.size, STEPS)
        assert_close(model, ref)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if name in ("unused", "frozen"):
            assert "momentum_buffer" not in opt.state.get(p, {}), name
            continue
        mine = opt.state[p]["momentum_buffer"].numpy()
        table = comm.allgather(mine)
        if sync_state is not False:
            np.testing.assert_allclose(mine, ref_opt.state[q]["momentum_buffer"].numpy(),
                                       rtol=2e-5, atol=2e-6, err_msg=name)
            assert all(np.array_equal(t, table[0]) for t in table), name
        elif comm.size > 1:
            assert not all(np.array_equal(t, table[0]) for t in table), name


@pytest.mark.mpi(min_size=2)
def test_selsync_grads_mode_keeps_replicas_identical_after_local_steps(comm):
    """SelSync in grads mode, SGD with momentum: after local steps (each rank's momentum its own) the
    synchronized step that re-aligns the replicas averages the momentum too, so that the synchronized
    steps after it leave them identical (each rank's own momentum took them apart again: 0.035)."""
    model = make_model(comm.rank)
    gate = SelSync(delta=0.5, window=2, warmup=2, mode="grads")
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                               strategy=gate, comm=comm, find_unused_parameters=True)
    for step in range(12):
        x, y = rank_part(comm, LOCAL, *batch(step, comm.size))
        opt.zero_grad()
        loss_fn(model, x, y * {4: 8.0, 5: 0.5, 8: 0.1}.get(step, 1.0)).backward()    # jumps: the gate syncs
        opt.step()
        if gate.trace[-1][4]:
            same_on_all_ranks(comm, model)
    syncs = [t[4] for t in gate.trace]
    assert any(not a and b and c for a, b, c in zip(syncs, syncs[1:], syncs[2:])), syncs


def resume(comm, on, name: str, model: Net, opt, cut: int, steps: int) -> tuple[Net, DistributedOptimizer]:
    """Checkpoint ``model``/``opt`` (trained ``cut`` steps on ``comm``) without ``flush()``, rebuild
    everything fresh on ``on`` and train to ``steps``, each of its ranks taking an equal slice of the
    same global batch."""
    msd, osd, ssd = copy.deepcopy(model.state_dict()), opt.state_dict(), opt.sched.state_dict()
    model2 = make_model(comm.rank + 7)
    opt2 = DistributedOptimizer(make_optimizer("sgd", model2), model2, strategy=STRATEGIES[name](), comm=on,
                                find_unused_parameters=True)
    model2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    sched = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    sched.load_state_dict(ssd)
    assert opt2.strategy.steps == cut
    per = LOCAL * comm.size // on.size
    for step in range(cut, steps):
        x, y = batch(step, comm.size)
        mine = slice(on.rank * per, (on.rank + 1) * per)
        opt2.zero_grad()
        loss_fn(model2, x[mine], y[mine]).backward()
        opt2.step()
        sched.step()
    return model2, opt2


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_checkpoint_resumes_on_fewer_ranks(comm, name):
    """A checkpoint taken on every rank resumes on half of them (a smaller allocation), each taking
    a bigger slice of the same global batch: training goes on as one process's."""
    steps, cut = 5, 2
    ref, _ = reference("sgd", comm.size, steps)
    model, opt = distributed(comm, "sgd", STRATEGIES[name](), cut, extra_forward=False)
    half = comm.split(comm.rank % 2)          # two jobs of size // 2 (or 1) ranks, each resuming
    try:
        model2, _ = resume(comm, half, name, model, opt, cut, steps)
        for (k, v), w in zip(model2.state_dict().items(), ref.state_dict().values()):
            np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    finally:
        half.close()


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_consolidated_state_equals_reference_state(comm, name):
    model, opt = distributed(comm, "adamw", STRATEGIES[name](), 3)
    sd = opt.state_dict()
    _, ref_opt = reference("adamw", comm.size, 3)
    ref_sd = ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    for i, st in ref_sd["state"].items():
        for k, v in st.items():
            np.testing.assert_allclose(np.asarray(sd["state"][i][k]), np.asarray(v), rtol=2e-5, atol=1e-7,
                                       err_msg=f"param {i} {k}")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_state_round_trip_mid_training(comm, name):
    steps, cut = 6, 3
    full, full_opt = distributed(comm, "sgd", STRATEGIES[name](), steps, extra_forward=False)
    full_opt.flush()
    full_opt_params = [p.detach().clone() for p in full.parameters()]
    # train `cut` steps, checkpoint, rebuild everything fresh, continue
    model, opt = distributed(comm, "sgd", STRATEGIES[name](), cut, extra_forward=False)
    opt.flush()
    model2, opt2 = resume(comm, comm, name, model, opt, cut, steps)
    opt2.flush()
    for p, q in zip(model2.parameters(), full_opt_params):
        np.testing.assert_allclose(p.detach().numpy(), q.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.mpi
@pytest.mark.parametrize("edit", ["assign", "clear", "del", "whole"])
@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_optimizer_state_edits_act_as_in_one_process(comm, name, edit):
    """What code does to ``opt.state`` between steps, as to one process's optimizer, acts on the
    update as there (DeAR's state in pieces too): a new ``defaultdict`` (Adam's reset; it was
    ignored), ``clear()``, ``del opt.state[p]``, or whole tensors assigned to one parameter."""
    import collections

    def run(distributed: bool) -> Net:
        model = make_model(comm.rank if distributed else 0)
        opt = make_optimizer("adamw", model)
        if distributed:
            opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[name](), comm=comm,
                                       find_unused_parameters=True)
        for step in range(4):
            x, y = batch(step, comm.size)
            if distributed:
                x, y = rank_part(comm, LOCAL, x, y)
            if step == 2:
                w = model.fc2.weight
                if edit == "assign":
                    opt.state = collections.defaultdict(dict)
                elif edit == "clear":
                    opt.state.clear()
                elif edit == "del":
                    del opt.state[model.fc1.weight]
                else:
                    opt.state[w] = {"step": torch.tensor(7.0), "exp_avg": torch.full_like(w, 0.01),
                                    "exp_avg_sq": torch.full_like(w, 1e-4)}
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
        if distributed and name == "dear":
            with pytest.raises(KeyError, match="ZeRO-1"):
                opt.state[model.fc1.weight]["exp_avg"]
        return model

    model, ref = run(True), run(False)
    same_on_all_ranks(comm, model)
    assert_close(model, ref)


def train_steps(comm, model: Net, opt: torch.optim.Optimizer, steps: range, mine: bool,
                sched: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
    """The reference loop's ``steps``, on this rank's slice of each global batch (``mine``) or all of it."""
    for step in steps:
        x, y = batch(step, comm.size)
        if mine:
            x, y = rank_part(comm, LOCAL, x, y)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_hooks_and_a_scheduler_of_the_wrapped_optimizer_run_as_in_one_process(comm, name):
    """Step hooks registered on the optimizer before wrapping run once a step, the post-hook on this
    step's parameters (an EMA kept in one; under DeAR they never ran), torch's global optimizer hooks
    once a step (they ran twice), and an LR scheduler made over the optimizer before wrapping steps
    without warning that the optimizer did not step (it did, under DeAR)."""
    import warnings

    from torch.optim.optimizer import register_optimizer_step_post_hook

    def run(distributed: bool) -> tuple[list[torch.Tensor], list[str], list[str]]:
        model = make_model(comm.rank if distributed else 0)
        opt = make_optimizer("adamw", model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        ema: list[torch.Tensor] = []
        calls: list[str] = []

        def keep_ema(*_):
            calls.append("post")
            with torch.no_grad():
                for e, p in zip(ema, model.parameters()):
                    e.lerp_(p, 0.5)

        opt.register_step_pre_hook(lambda *_: calls.append("pre"))
        opt.register_step_post_hook(keep_ema)
        if distributed:
            opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[name](), comm=comm,
                                       find_unused_parameters=True)
        ema += [p.detach().clone() for p in model.parameters()]      # rank 0's start, once wrapped
        counted = register_optimizer_step_post_hook(lambda *_: calls.append("global"))
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                train_steps(comm, model, opt, range(3), mine=distributed, sched=sched)
        finally:
            counted.remove()
        return ema, calls, [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]

    (ema, calls, warned), (ref_ema, ref_calls, _) = run(True), run(False)
    assert calls == ref_calls == ["pre", "post", "global"] * 3
    assert warned == []
    for e, r in zip(ema, ref_ema):
        np.testing.assert_allclose(e.numpy(), r.numpy(), rtol=2e-5, atol=2e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("held", ["checkpoint", "adagrad"])
@pytest.mark.parametrize("name", ["allreduce", "dear", "dear-1bucket", "selsync0-grads"])
def test_state_the_optimizer_holds_when_wrapped_trains_on_as_in_one_process(comm, name, held):
    """State the optimizer holds before it is wrapped is the state the update reads: a checkpoint
    loaded into the plain optimizer, then wrapped (resuming), and Adagrad's accumulators, which its
    constructor makes from ``initial_accumulator_value``.  Under DeAR both were dropped: its shards
    started from fresh state (Adam's moments at zero, Adagrad's sums at 0 instead of 0.5)."""
    def plain(model: Net) -> torch.optim.Optimizer:
        if held == "adagrad":
            return torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5)
        return torch.optim.Adam(model.parameters(), lr=0.01)

    cut = 2 if held == "checkpoint" else 0
    ref = make_model(0)
    ref_opt = plain(ref)
    train_steps(comm, ref, ref_opt, range(cut), mine=False)
    msd, osd = copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_opt.state_dict())
    train_steps(comm, ref, ref_opt, range(cut, STEPS), mine=False)

    model = make_model(comm.rank + 7)
    model.load_state_dict(msd)
    opt = plain(model)
    if held == "checkpoint":
        opt.load_state_dict(osd)
    opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[name](), comm=comm,
                               find_unused_parameters=True)
    train_steps(comm, model, opt, range(cut, STEPS), mine=True)
    with opt.flush():
        assert_close(model, ref)
    sd = opt.state_dict()
    for i, st in ref_opt.state_dict()["state"].items():
        for k, v in st.items():
            np.testing.assert_allclose(np.asarray(sd["state"][i][k]), np.asarray(v), rtol=2e-5, atol=1e-7,
                                       err_msg=f"param {i} {k}")


def checkpoint_and_reference(comm, cut: int) -> tuple[Net, dict, dict]:
    """One process trained with Adam to the end, and its model's and optimizer's state at step ``cut``."""
    ref = make_model(0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    train_steps(comm, ref, ref_opt, range(cut), mine=False)
    msd, osd = copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_opt.state_dict())
    train_steps(comm, ref, ref_opt, range(cut, STEPS), mine=False)
    return ref, msd, osd


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "dear", "dear-1bucket"])
def test_a_checkpoint_rank_0_loads_alone_reaches_every_rank_by_broadcast(comm, name):
    """Horovod's resume: rank 0 alone loads the checkpoint, then ``broadcast_parameters`` and
    ``broadcast_optimizer_state`` give every rank its model, state and hyperparameters; training
    goes on as one process's.  Under DeAR the broadcast sent the state gathered from the shards, of
    which only rank 0's pieces came from the checkpoint (the others' were fresh)."""
    cut = 2
    ref, msd, osd = checkpoint_and_reference(comm, cut)

    model = make_model(comm.rank + 7)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (comm.rank + 1)), model,
                               strategy=STRATEGIES[name](), comm=comm, find_unused_parameters=True)
    if comm.rank == 0:
        model.load_state_dict(msd)
        opt.load_state_dict(osd)
    broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    broadcast_optimizer_state(opt, root_rank=0, comm=comm)
    assert opt.param_groups[0]["lr"] == 0.01
    train_steps(comm, model, opt, range(cut, STEPS), mine=True)
    with opt.flush():
        assert_close(model, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["allreduce", "dear"])
@pytest.mark.parametrize("forgot", ["model", "optimizer", "optimizer-before-wrapping", "nothing",
                                    "different"])
def test_a_checkpoint_that_leaves_the_replicas_apart_raises_on_every_rank(comm, name, forgot):
    """Rank 0 alone loads the checkpoint and broadcasts one part of it, or loads the optimizer's
    state before wrapping: the replicas would train apart (silently, as under Horovod and DDP).  The
    next ``step()`` raises the same ValidationError on every rank, before the update, naming the
    load and the call that mends it; mended and the step taken again, training goes on as one
    process's.  Rank 0 loading other weights for a moment (an evaluation) and back passes; every
    rank loading a checkpoint of its own (different ones) raises too."""
    cut = 2
    ref, msd, osd = checkpoint_and_reference(comm, cut)

    model = make_model(comm.rank + 7)
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    if comm.rank == 0 and forgot == "optimizer-before-wrapping":
        model.load_state_dict(msd)
        inner.load_state_dict(osd)
    opt = DistributedOptimizer(inner, model, strategy=STRATEGIES[name](), comm=comm,
                               find_unused_parameters=True)          # rank 0's parameters everywhere
    if forgot == "nothing":         # what the replicas train from is loaded on every rank
        model.load_state_dict(msd)
        opt.load_state_dict(osd)
        if comm.rank == 0:          # and rank 0 alone evaluates other weights, then puts them back
            model.load_state_dict({k: v + 1 for k, v in msd.items()})
            model.load_state_dict(msd)
    elif forgot == "different":     # every rank its own file: only rank 0's is the checkpoint
        model.load_state_dict({k: v + comm.rank for k, v in msd.items()})
        opt.load_state_dict(osd)
    elif forgot != "optimizer-before-wrapping":
        if comm.rank == 0:
            model.load_state_dict(msd)
            opt.load_state_dict(osd)
        if forgot == "model":
            broadcast_optimizer_state(opt, root_rank=0, comm=comm)
        else:
            broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    if forgot != "nothing":
        what, mend = (("model.load_state_dict", "broadcast_parameters") if forgot in ("model", "different")
                      else ("opt.load_state_dict", "broadcast_optimizer_state"))
        where = "every rank" if forgot == "different" else r"rank\(s\) \[0\] .*not on \[1"
        with pytest.raises(ValidationError, match=rf"{what}\(\) ran on {where}.*replicas now differ.*"
                                                  rf"{mend}\(.*root_rank=0\)"):
            train_steps(comm, model, opt, range(cut, cut + 1), mine=True)
        if forgot in ("model", "different"):
            broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
        elif forgot == "optimizer" or name == "allreduce":
            broadcast_optimizer_state(opt, root_rank=0, comm=comm)
        else:                       # DeAR's pieces on the other ranks never held it: load everywhere
            opt.load_state_dict(osd)
    train_steps(comm, model, opt, range(cut, STEPS), mine=True)      # the failed step taken again
    with opt.flush():
        assert_close(model, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_replicas_wrapped_apart_without_a_broadcast_raise_at_the_first_step(comm, name):
    """Wrapped with ``broadcast=False`` (as the Horovod API wraps, leaving the broadcast to the user)
    from different initial parameters: the first ``step()`` raises on every rank, before the
    update, saying so (they trained apart silently); after the broadcast the replicas train alike.
    From the same parameters, ``broadcast=False`` passes."""
    model = make_model(comm.rank + 7)           # each rank its own initialization
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                               strategy=STRATEGIES[name](), broadcast=False, find_unused_parameters=True)
    with pytest.raises(ValidationError, match=r"differ at the first step \(wrapped with broadcast=False\).*"
                                              r"broadcast_parameters\(model.state_dict\(\), root_rank=0\)"):
        train_steps(comm, model, opt, range(1), mine=True)
    broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    train_steps(comm, model, opt, range(STEPS), mine=True)
    with opt.flush():
        same_on_all_ranks(comm, model)
    alike = make_model(0)
    opt = DistributedOptimizer(torch.optim.SGD(alike.parameters(), lr=0.1), alike, comm=comm,
                               strategy=STRATEGIES[name](), broadcast=False, find_unused_parameters=True)
    train_steps(comm, alike, opt, range(STEPS), mine=True)


@pytest.mark.mpi(min_size=2)
def test_rank_0_evaluating_other_weights_under_selsync_is_no_load_of_its_own(comm):
    """SelSync's replicas differ between synchronizations with no load at all: rank 0 loading other
    weights for an evaluation and putting them back is not taken for a checkpoint it alone loaded
    (the replicas, compared at the next synchronized step, differed: every rank raised)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, comm=comm,
                               strategy=SelSync(inner=AllReduce(), delta=0.5, mode="grads", window=2))
    synced = 0
    for step in range(8):
        if step == 3 and comm.rank == 0:
            kept = {k: v.clone() for k, v in model.state_dict().items()}
            model.load_state_dict({k: v + 1 for k, v in kept.items()})
            model.load_state_dict(kept)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + comm.rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        synced += opt.strategy.synced
    assert 0 < synced < 8         # local steps (replicas apart) and synchronized ones after the load


@pytest.mark.mpi(min_size=2)
def test_a_tuned_checkpoint_rank_0_loads_alone_replans_every_rank_at_the_next_forward(comm):
    """The same resume from a checkpoint whose cap was tuned (not the new optimizer's): every rank
    re-plans to it at the next training forward and trains on as one process.  Rank 0 re-planned
    inside ``load_state_dict()``, alone: every rank raised ``MismatchError`` in the broadcast."""
    steps, cut = 8, 5
    tune = {"trials": 3, "window": 1, "skip": 0, "low_mb": 0.0001, "high_mb": 0.002}
    ref, _ = reference("sgd", comm.size, steps)
    model, opt = distributed(comm, "sgd", DeAR(cap_mb=0.0003, first_cap_mb=0.0001, tune=tune), cut,
                             extra_forward=False)
    assert opt.strategy.tuner.done
    msd, osd, ssd = copy.deepcopy(model.state_dict()), opt.state_dict(), opt.sched.state_dict()

    model2 = make_model(comm.rank + 7)
    opt2 = DistributedOptimizer(make_optimizer("sgd", model2), model2, comm=comm, find_unused_parameters=True,
                                strategy=DeAR(cap_mb=0.005, first_cap_mb=0.0001, tune=tune))
    sched = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    if comm.rank == 0:
        model2.load_state_dict(msd)
        opt2.load_state_dict(osd)
    broadcast_parameters(model2.state_dict(), root_rank=0, comm=comm)
    broadcast_optimizer_state(opt2, root_rank=0, comm=comm)
    sched.load_state_dict(ssd)
    train_steps(comm, model2, opt2, range(cut, steps), mine=True, sched=sched)
    assert opt2.strategy.cap_bytes == opt.strategy.cap_bytes
    assert [len(b.slots) for b in opt2.buckets] == [len(b.slots) for b in opt.buckets]
    with opt2.flush():
        assert_close(model2, ref)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_an_empty_parameter_and_per_group_state_keys_are_as_in_one_process(comm, name):
    """A parameter of no element (a register-token table sized 0 by a config) trains, is saved and
    resumes as in one process; the state of each parameter has its own group's keys only (Adam's
    ``max_exp_avg_sq`` in the ``amsgrad`` group, not in the other), checkpointed and loaded back."""

    class Tokens(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.extra = torch.nn.Parameter(torch.zeros(0, 8))     # zero tokens
            self.inp, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.inp(torch.cat([self.extra, x]))))

    def train(dist: bool, steps: range, model=None, opt=None):
        if model is None:
            torch.manual_seed(0)
            model = Tokens()
            opt = torch.optim.Adam([{"params": [model.extra, *model.inp.parameters()], "amsgrad": True},
                                    {"params": list(model.out.parameters()), "weight_decay": 0.1}], lr=0.01)
            if dist:
                opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[name](), comm=comm)
        for step in steps:
            x, y = batch(step, comm.size)
            if dist:
                x, y = rank_part(comm, LOCAL, x, y)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x)[:, :4], y).backward()
            opt.step()
        return model, opt

    def assert_state_equal(sd: dict, ref_sd: dict) -> None:
        assert sd["param_groups"] == ref_sd["param_groups"]
        assert sorted(sd["state"]) == sorted(ref_sd["state"]), (sd, ref_sd)
        for i, st in ref_sd["state"].items():
            assert sorted(sd["state"][i]) == sorted(st), f"param {i}"
            for k, v in st.items():
                assert np.shape(sd["state"][i][k]) == np.shape(v), f"param {i} {k}"
                np.testing.assert_allclose(np.asarray(sd["state"][i][k]), np.asarray(v), rtol=2e-5,
                                           atol=1e-7, err_msg=f"param {i} {k}")

    ref, ref_opt = train(False, range(4))
    model, opt = train(True, range(2))
    ckpt = copy.deepcopy(opt.state_dict())
    train(True, range(2, 4), model, opt)
    with opt.flush():
        assert_close(model, ref)
        assert_state_equal(opt.state_dict(), ref_opt.state_dict())
    # resumed from the checkpoint in fresh objects: the same
    torch.manual_seed(0)
    model2, opt2 = train(True, range(0), None, None)
    half, half_opt = train(False, range(2))
    model2.load_state_dict(half.state_dict())
    opt2.load_state_dict(ckpt)
    train(True, range(2, 4), model2, opt2)
    with opt2.flush():
        assert_close(model2, ref)
        assert_state_equal(opt2.state_dict(), ref_opt.state_dict())


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "dear"])
@pytest.mark.parametrize("kind", ["sgd", "adamw", "nadam"])
def test_a_0dim_parameters_state_survives_a_replan_and_a_load(comm, name, kind):
    """A 0-dim parameter (a learnable temperature) with a state of its own shape, ``()`` like its
    step count: a re-plan (``tune=``'s, ``replan()``) or a load cut it as a step count, whole, into
    a piece of shape ``[1]``, and DeAR's next step raised "output with shape [] doesn't match the
    broadcast shape [1]".  The run with both trains as one process on the concatenated batch."""
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=0.05),
            "nadam": lambda p: torch.optim.NAdam(p, lr=0.05)}

    def run(dist: bool) -> list[float]:
        model = torch.nn.Module()
        model.t = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
        model.w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
        opt = make[kind](list(model.parameters()))
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=AllReduce() if name == "allreduce" else DeAR(),
                                       comm=comm)
        ranks = [comm.rank] if dist else list(range(comm.size))
        for step in range(4):
            opt.zero_grad()
            loss = sum((model.t * (r + 1) + model.w.sum() * model.t ** 2 * (step + 1)) for r in ranks)
            (loss / len(ranks)).backward()
            opt.step()
            if dist and step == 1:
                opt.replan(2 << 20)
            if dist and step == 2:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        return [model.t.item(), *model.w.tolist()]

    # (torch's own load casts NAdam's float32 mu_product to the parameter's float64: 5e-11 off)
    np.testing.assert_allclose(run(True), run(False), rtol=1e-9 if kind == "nadam" else 1e-12, atol=1e-14)


def _tuned(comm, cap_mb: float, tune: dict | bool):
    model = make_model(comm.rank)
    opt = DistributedOptimizer(make_optimizer("sgd", model), model, comm=comm, find_unused_parameters=True,
                               strategy=DeAR(cap_mb=cap_mb, first_cap_mb=0.0001, tune=tune))
    return model, opt


def _trials_after_each_step(comm, model, opt, steps: range) -> list[int]:
    trials = []
    for step in steps:
        train_steps(comm, model, opt, range(step, step + 1), mine=True)
        trials.append(len(opt.strategy.tuner.history))
    return trials


@pytest.mark.mpi
def test_a_resumed_tuned_run_ends_its_trials_at_the_steps_of_the_run_that_went_on(comm):
    """The first step after a resume has no step before it to be timed from: it was not counted, so
    each trial after it ended (and the buckets re-planned) a step later than in the run that went on.
    It counts now, untimed; a fresh run still leaves its first step out."""
    steps, cut = 9, 4          # the cut falls inside a trial window of 2 steps
    tune = {"trials": 4, "window": 2, "skip": 0, "low_mb": 0.0001, "high_mb": 0.002}
    model, opt = _tuned(comm, 0.0003, tune)
    went_on = _trials_after_each_step(comm, model, opt, range(steps))
    assert went_on == [0, 0, 1, 1, 2, 2, 3, 3, 4], went_on

    model, opt = _tuned(comm, 0.0003, tune)
    before = _trials_after_each_step(comm, model, opt, range(cut))
    msd, osd = copy.deepcopy(model.state_dict()), opt.state_dict()
    model2, opt2 = _tuned(comm, 0.0003, tune)
    model2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    assert before + _trials_after_each_step(comm, model2, opt2, range(cut, steps)) == went_on


@pytest.mark.mpi
def test_an_untuned_checkpoint_starts_a_tuned_strategys_search_at_its_cap(comm):
    """An untuned checkpoint's cap replaced the strategy's, but its tuner kept its own: the first trial
    was recorded under a cap the buckets never had, without a word.  It warns now, and the search
    starts afresh at the checkpoint's cap."""
    tune = {"trials": 2, "window": 1, "skip": 0, "low_mb": 0.0001, "high_mb": 0.002}
    model, opt = _tuned(comm, 0.0005, False)
    train_steps(comm, model, opt, range(2), mine=True)
    saved_cap = opt.strategy.cap_bytes
    msd, osd = copy.deepcopy(model.state_dict()), opt.state_dict()
    model2, opt2 = _tuned(comm, 0.0003, tune)
    train_steps(comm, model2, opt2, range(1), mine=True)       # its tuner exists: made at setup
    model2.load_state_dict(msd)
    with pytest.warns(UserWarning, match="saved without tune=, so the cap search starts afresh"):
        opt2.load_state_dict(osd)
    tuner = opt2.strategy.tuner
    assert tuner.cap == saved_cap == opt2.strategy.cap_bytes and tuner.history == []
    train_steps(comm, model2, opt2, range(2, 4), mine=True)
    assert tuner.history[0][0] == saved_cap, tuner.history
