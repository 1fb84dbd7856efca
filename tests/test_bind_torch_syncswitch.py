"""bindings.torch with Sync-Switch: BSP, ASP and SSP in one job through DistributedOptimizer.

The BSP phase trains as one process (the training-loop tests run ``SyncSwitch(bsp=AllReduce())`` and
``SyncSwitch(bsp=DeAR())`` with the rest: test_train_loops.py); here, the switches: replicas and
optimizers that agree again at BSP, GradScalers that drifted apart in ASP (one scale again at BSP),
ASP's ranks that do not meet, and DeAR's sharded optimizer moved between pieces and whole tensors.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import HAVE_TORCH, SMALL
from torch_reference import LOCAL, batch, loss_fn, make_model, same_on_all_ranks

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
    from commlib.collectives import AllReduce, DeAR, SchedulePolicy, SyncSwitch


def local_step(comm, model, opt, step: int) -> None:
    """One training step on this rank's own batch (ranks see different data)."""
    x, y = batch(step + 17 * comm.rank, comm.size)
    opt.zero_grad()
    loss_fn(model, x[:LOCAL], y[:LOCAL]).backward()
    opt.step()


def training_forward(comm, model) -> None:
    """A forward with gradients, on every rank together (no backward): where a load deferred to the
    next training forward (a Sync-Switch checkpoint's phase) is taken, before steps taken in turns."""
    model(batch(0, comm.size)[0][:LOCAL])


def in_turns(comm, turns: bool, body, *args) -> None:
    """``body(*args)`` on every rank; with ``turns`` (ASP steps) one rank after another, so that the
    asynchronous steps are deterministic (not for a step whose switch back to BSP meets every rank at
    its barrier)."""
    for r in range(comm.size) if turns else [comm.rank]:
        if r == comm.rank:
            body(*args)
        if turns:
            comm.barrier()


@pytest.mark.mpi
def test_syncswitch_through_distributed_optimizer_keeps_replicas_identical_at_bsp(comm):
    """BSP -> ASP -> BSP inside one job, driven by the binding: replicas (and momentum) agree at BSP."""

    model = make_model(comm.rank)
    ss = SyncSwitch(bsp=AllReduce(cap_mb=0.0003), policy=SchedulePolicy([(0, "bsp"), (2, "asp"), (5, "bsp")],
                                                                       lr_scale=0.5))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                               strategy=ss, comm=comm, find_unused_parameters=True)
    phases = []
    for step in range(7):
        x, y = batch(step + 17 * comm.rank, comm.size)    # ranks see different data
        opt.zero_grad()
        loss_fn(model, x[:LOCAL], y[:LOCAL]).backward()
        opt.step()
        phases.append(ss.phase)
        if ss.phase == "bsp":
            opt.flush()
            same_on_all_ranks(comm, model)
            bufs = comm.allgather(torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                                             for p in (model.fc1.weight, model.fc2.weight)]).numpy())
            assert all(np.array_equal(bufs[r], bufs[0]) for r in range(comm.size))
    assert "asp" in phases and phases[-1] == "bsp", phases
    assert [s["to"] for s in ss.switches] == ["asp", "bsp"]
    ss.close()


@pytest.mark.mpi(min_size=2)
def test_a_flush_in_asp_gives_every_rank_the_same_parameters(comm):
    """``opt.flush()`` (and JAX's ``tx.flush``) in ASP: every rank's pushes land before any rank pulls
    the store, so an evaluation or a checkpoint after it sees one model on every rank; each rank
    pulled its own view, without the pushes of a peer still in its step (0.014 apart at 2 ranks)."""
    import time

    model = make_model(comm.rank)
    ss = SyncSwitch(bsp=AllReduce(cap_mb=0.0003), policy=SchedulePolicy([(0, "bsp"), (1, "asp")]))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, strategy=ss, comm=comm)
    for step in range(4):
        x, y = batch(step + 17 * comm.rank, comm.size)
        opt.zero_grad()
        loss_fn(model, x[:LOCAL], y[:LOCAL]).backward()
        if step == 3 and comm.rank == comm.size - 1:
            time.sleep(0.3)                 # the last rank's last step lands after the others flush
        opt.step()
    assert ss.phase == "asp"
    opt.flush()
    same_on_all_ranks(comm, model)
    ss.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bsp", ["allreduce", "dear"])
def test_adams_state_that_parted_in_asp_agrees_again_at_bsp(comm, bsp):
    """AdamW through BSP -> ASP -> BSP where a branch runs on rank 0 alone during ASP: there rank 0
    alone has (or advances) that parameter's state and every rank its own ``step`` counts.  At the
    return to BSP the state is averaged over the union of the ranks' entries, 0-dim ``step`` included
    (missing entries count as zeros): the replicas then stay identical, bit for bit (step counts
    that stayed apart took them apart by 6e-3; entries only rank 0 held paired its all-reduces with
    other calls: NaN, then a hang)."""
    inner = AllReduce(cap_mb=0.0003) if bsp == "allreduce" else DeAR(cap_mb=0.0003)
    model = make_model(comm.rank)
    model.branch = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(5)))
    ss = SyncSwitch(bsp=inner, policy=SchedulePolicy([(0, "bsp"), (2, "asp"), (6, "bsp")]))
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, strategy=ss,
                               comm=comm, find_unused_parameters=True)
    for step in range(10):
        x, y = batch(step + 17 * comm.rank, comm.size)
        opt.zero_grad()
        out = model(x[:LOCAL])
        if step >= 6 or (step >= 2 and comm.rank == 0):     # rank 0 alone during ASP
            out = out + model.branch
        torch.nn.functional.mse_loss(out, y[:LOCAL]).backward()
        opt.step()
    assert ss.phase == "bsp"
    opt.flush()
    same_on_all_ranks(comm, model)
    state = opt.state_dict()["state"]       # whole under DeAR too (a collective)
    at = [i for i, p in enumerate(model.parameters()) if p is model.branch or p is model.fc1.weight]
    steps = comm.allgather(np.array([float(state[i]["step"]) for i in at]))
    assert all(np.array_equal(s, steps[0]) for s in steps), steps
    ss.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bsp", ["allreduce", "dear"])
@pytest.mark.parametrize("skip_at", [3, 4])
@pytest.mark.parametrize("zero,resume", [("opt", False), ("opt", True), ("model", False)])
def test_grad_scalers_that_drifted_in_asp_agree_again_at_bsp(comm, bsp, skip_at, zero, resume):
    """Under ASP one rank's GradScaler skips an overflowed step and halves its scale alone (at step 3,
    or at step 4, the step at whose end BSP resumes: that rank's step then ends at its next
    ``opt.zero_grad()``, or with ``model.zero_grad()`` at its next forward); with ``grad_scaler=``
    the binding gives the scalers one scale and one growth count again at the first backward in BSP,
    so that the BSP steps after it (a growth among them) train as one process on the concatenated
    batch, from the replicas the return left.  Also across each rank's own checkpoint taken before
    that backward (``resume``: a fresh job loads it)."""
    def job():
        model = make_model(comm.rank)
        strategy = AllReduce(cap_mb=0.0003) if bsp == "allreduce" else DeAR(cap_mb=0.0003)
        ss = SyncSwitch(bsp=strategy, policy=SchedulePolicy([(0, "bsp"), (2, "asp"), (5, "bsp")]))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, strategy=ss,
                                   comm=comm, find_unused_parameters=True, grad_scaler=scaler)
        return model, ss, scaler, opt

    model, ss, scaler, opt = job()
    ref = ref_opt = None
    for step in range(10):
        x, y = batch(step + 17 * comm.rank, comm.size)
        opt.zero_grad() if zero == "opt" else model.zero_grad()
        if step == 5 and resume:                    # each rank's own checkpoint, into a fresh job
            opt.flush()
            saved = copy.deepcopy([model.state_dict(), opt.state_dict(), scaler.state_dict()])
            ss.close()
            model, ss, scaler, opt = job()
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            scaler.load_state_dict(saved[2])
        loss = loss_fn(model, x[:LOCAL], y[:LOCAL])
        if step == 5:               # back in BSP on every rank, by this forward: the reference starts
            ref = copy.deepcopy(model)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        if step == skip_at and comm.rank == 0:      # ASP: this rank alone overflows
            loss = loss + model.fc1.bias[0] * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step >= 5:
            xs = [batch(step + 17 * r, comm.size) for r in range(comm.size)]
            ref_opt.zero_grad()
            xcat, ycat = (torch.cat([b[k][:LOCAL] for b in xs]) for k in (0, 1))
            loss_fn(ref, xcat, ycat).backward()
            ref_opt.step()
            table = comm.allgather(np.array([scaler.get_scale(), scaler.state_dict()["_growth_tracker"]]))
            assert all(np.array_equal(t, table[0]) for t in table), (step, table)
    opt.flush()
    assert [s["to"] for s in ss.switches] == ["asp", "bsp"]
    assert scaler.get_scale() > 1024.0          # it grew in BSP, alike on every rank
    same_on_all_ranks(comm, model)
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)
    ss.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("end", ["close", "replace", "replace-same"])
def test_grad_scalers_agree_when_an_optimizer_in_asp_is_closed(comm, end):
    """Rank 0's scaler alone backs off in ASP; the job then leaves Sync-Switch in ASP by ``close()``,
    or by a new optimizer over the model (its strategy AllReduce, or the same SyncSwitch, which
    enters ASP again from replicas alike, then BSP at step 5), and trains on: the scalers are made
    one and the replicas alike when the old one ends, so the BSP steps that follow keep the
    replicas identical.  Replaced without ``close()``, Sync-Switch stayed in ASP, and the replicas
    and the scalers apart."""
    model = make_model(comm.rank)
    ss = SyncSwitch(bsp=AllReduce(), policy=SchedulePolicy([(0, "bsp"), (1, "asp"), (5, "bsp")]))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, strategy=ss, comm=comm,
                               grad_scaler=scaler)
    for step in range(4):
        x, y = batch(step + 17 * comm.rank, comm.size)
        opt.zero_grad()
        loss = loss_fn(model, x[:LOCAL], y[:LOCAL])
        if step == 2 and comm.rank == 0:            # ASP: this rank alone overflows
            loss = loss + model.fc1.bias[0] * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert ss.phase == "asp"
    if end == "close":
        opt.close()
    old = opt
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model,
                               strategy=ss if end == "replace-same" else AllReduce(), comm=comm,
                               grad_scaler=scaler, broadcast=False)
    assert ss.phase == ("asp" if end == "replace-same" else "bsp")
    same_on_all_ranks(comm, model)
    table = comm.allgather(np.array([scaler.get_scale(), scaler.state_dict()["_growth_tracker"]]))
    assert all(np.array_equal(t, table[0]) for t in table), table
    with pytest.raises(RuntimeError, match="closed by close" if end == "close" else "replaced by a newer"):
        old.step()
    for step in range(4, 7):
        x, y = batch(step + 17 * comm.rank, comm.size)
        opt.zero_grad()
        scaler.scale(loss_fn(model, x[:LOCAL], y[:LOCAL])).backward()
        scaler.step(opt)
        scaler.update()
    same_on_all_ranks(comm, model)
    ss.close()


@pytest.mark.mpi(min_size=2)
def test_asp_steps_leave_out_this_ranks_unused_parameters_without_meeting(comm):
    """Sync-Switch's ASP with a parameter no rank uses: each rank leaves out what it gave no gradient
    on its own, so the ranks do not meet at every step (an agreement there held ASP in lockstep:
    the slow rank's sleep set every rank's pace)."""
    import time


    model = make_model(comm.rank)
    ss = SyncSwitch(bsp=AllReduce(), policy=SchedulePolicy([(0, "bsp"), (1, "asp")]))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                               strategy=ss, comm=comm, find_unused_parameters=True)
    unused = model.unused.detach().clone()
    slow, steps = comm.size - 1, 0
    try:
        while ss.progress() < 6 * comm.size:
            x, y = batch(steps + 17 * comm.rank, comm.size)
            opt.zero_grad()
            loss_fn(model, x[:LOCAL], y[:LOCAL]).backward()
            opt.step()
            steps += 1
            if comm.rank == slow:
                time.sleep(0.05)
    finally:
        ss.close()
    counts = comm.allgather(np.array([steps]))[:, 0]
    assert counts[slow] < counts[0], counts
    assert torch.equal(model.unused.detach(), unused)


@pytest.mark.mpi
def test_syncswitch_over_dear_trains_as_over_allreduce_through_its_switches(comm):
    """``SyncSwitch(bsp=DeAR())``: BSP steps update AdamW over 1/size pieces (ZeRO-1), ASP steps update
    whole parameters from the moments gathered whole at the switch, which are averaged and split again
    on the way back.  The training is ``SyncSwitch(bsp=AllReduce())``'s (ASP's ranks take turns, so that
    the asynchronous steps are deterministic), the replicas and the checkpoint identical at BSP, and
    ``close()`` in ASP comes back to BSP alike.  It was refused ("use a non-sharded BSP strategy")."""
    from commlib.bindings.torch_state import ShardedParamState

    schedule = [(0, "bsp"), (2, "asp"), (5, "bsp"), (7, "asp")]

    def run(bsp):
        model = make_model(comm.rank)
        ss = SyncSwitch(bsp=bsp, policy=SchedulePolicy(schedule, lr_scale=0.5))
        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, strategy=ss,
                                   comm=comm, find_unused_parameters=True)
        pieces, trace = [], []
        for step in range(9):
            # ASP steps take turns, but for step 4's: its switch back to BSP meets every rank at a barrier
            in_turns(comm, ss.phase == "asp" and step != 4, local_step, comm, model, opt, step)
            pieces.append(isinstance(opt.state[model.fc1.weight], ShardedParamState))
            if ss.phase == "bsp":
                opt.flush()
                same_on_all_ranks(comm, model)
            trace.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy())
            if step == 5:
                mid = copy.deepcopy(opt.state_dict())   # BSP: consolidated from the pieces (a plain
                #                                           optimizer's holds its live tensors)
        ss.close()                      # in ASP (step 8's): back to BSP, the optimizers averaged and split
        same_on_all_ranks(comm, model)
        end = opt.state_dict()
        return trace, pieces, [s["to"] for s in ss.switches], end, mid

    dear, ref = run(DeAR(cap_mb=0.0003)), run(AllReduce(cap_mb=0.0003))
    assert dear[2] == ref[2] == ["asp", "bsp", "asp", "bsp"], dear[2]
    assert dear[1] == [True, False, False, False, True, True, False, False, False], dear[1]
    assert not any(ref[1])
    for step, (a, b) in enumerate(zip(dear[0], ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
    for sd, ref_sd in ((dear[3], ref[3]), (dear[4], ref[4])):
        assert sd["state"].keys() == ref_sd["state"].keys()
        for i, st in ref_sd["state"].items():
            for k, v in st.items():
                np.testing.assert_allclose(np.asarray(sd["state"][i][k]), np.asarray(v), rtol=1e-5, atol=1e-7,
                                           err_msg=f"parameter {i} {k}")
    table = comm.allgather(torch.cat([v.reshape(-1) for st in dear[3]["state"].values()
                                      for v in st.values() if v.dim()]).numpy())
    assert all(np.array_equal(t, table[0]) for t in table), "the optimizers differ after close()"


def train_in_turns(comm, model, ss, opt, steps) -> np.ndarray:
    """``local_step`` for each of ``steps``, in turns while in ASP; the parameters after, flat."""
    for step in steps:
        in_turns(comm, ss.phase == "asp", local_step, comm, model, opt, step)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def assert_state_is(opt, saved: dict) -> None:
    """``opt.state_dict()``'s optimizer state is the one in ``saved``, exactly."""
    state = opt.state_dict()["state"]
    assert state.keys() == saved["state"].keys()
    for i, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(state[i][k]), torch.as_tensor(v)), (i, k)


def adamw_job(comm, bsp: str) -> tuple:
    """A fresh job: model, ``SyncSwitch`` (BSP for 2 steps, then ASP) over ``bsp``, AdamW wrapped."""
    model = make_model(comm.rank)
    ss = SyncSwitch(bsp=AllReduce(cap_mb=0.0003) if bsp == "allreduce" else DeAR(cap_mb=0.0003),
                    policy=SchedulePolicy([(0, "bsp"), (2, "asp")]))
    return model, ss, DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model,
                                           strategy=ss, comm=comm, find_unused_parameters=True)


@pytest.mark.mpi
@pytest.mark.parametrize("taken", ["asp", "bsp"])
@pytest.mark.parametrize("bsp", ["allreduce", "dear"])
def test_a_checkpoint_resumes_in_its_phase_with_its_state(comm, bsp, taken):
    """Rank 0's checkpoint (Horovod's habit), taken in ASP or BSP and loaded on every rank of a fresh job
    that starts in BSP: the job goes on in the checkpoint's phase from its model and optimizer state,
    nothing lost (over DeAR an ASP state passes through the pieces of the BSP start, then whole again at
    the switch the load makes).  Loaded into the job while it is in ASP (a roll-back), it trains on
    alike: the parameter store takes the loaded parameters (it kept its own, and the next pull put them
    back), and over DeAR a BSP checkpoint's state goes to the pieces."""
    def train(model, ss, opt, steps):
        trace = []
        for step in steps:      # ASP's ranks take turns: the same steps give the same parameters
            in_turns(comm, ss.phase == "asp", local_step, comm, model, opt, step)
            trace.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy())
        return trace

    def load(model, opt, saved):        # a copy: torch's optimizer keeps the tensors it loads
        model.load_state_dict(saved[0])
        opt.load_state_dict(copy.deepcopy(saved[1]))
        training_forward(comm, model)   # the phase re-entered there, every rank together

    model, ss, opt = adamw_job(comm, bsp)
    done = 3 if taken == "asp" else 1
    train(model, ss, opt, range(done))
    assert ss.phase == taken
    sd = copy.deepcopy(opt.state_dict())      # on every rank: over DeAR in BSP, gathered from the pieces
    mine = (copy.deepcopy(model.state_dict()), sd) if comm.rank == 0 else None
    saved = comm.allgather_object(mine)[0]
    train(model, ss, opt, range(10, 12))
    assert ss.phase == "asp"
    load(model, opt, saved)             # roll back, in ASP
    rolled = train(model, ss, opt, range(done, done + 2))
    ss.close()

    model, ss, opt = adamw_job(comm, bsp)   # the job started again: BSP (over DeAR, the state in pieces)
    load(model, opt, saved)
    assert ss.phase == taken
    assert_state_is(opt, saved[1])
    for k, v in saved[0].items():
        assert torch.equal(model.state_dict()[k], v), k
    resumed = train(model, ss, opt, range(done, done + 2))
    ss.close()
    same_on_all_ranks(comm, model)
    for step, (a, b) in enumerate(zip(rolled, resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"step {step}")


def momentum_reset_job(comm, bsp: str) -> tuple:
    """A fresh job: model, ``SyncSwitch`` (BSP for 4 steps, then ASP, the momentum reset at the switch)
    over ``bsp``, SGD with momentum wrapped."""
    from commlib.collectives import OfflinePolicy

    model = make_model(comm.rank)
    ss = SyncSwitch(bsp=AllReduce(cap_mb=0.0003) if bsp == "allreduce" else DeAR(cap_mb=0.0003),
                    policy=OfflinePolicy(0.5, total_steps=8, lr_scale=0.5, momentum="reset"))
    return model, ss, DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                           model, strategy=ss, comm=comm, find_unused_parameters=True)


@pytest.mark.mpi
@pytest.mark.parametrize("job,switch", [(adamw_job, 2), (momentum_reset_job, 4)], ids=["adamw", "reset"])
@pytest.mark.parametrize("bsp", ["allreduce", "dear"])
def test_each_rank_resumes_its_own_asp_checkpoint_as_the_run_continued(comm, bsp, job, switch):
    """Each rank saves its own checkpoint in ASP (replicas, AdamW moments and the store's view apart,
    ranks in turns) and a fresh job, each rank loading its own, trains on as the run did: the store as
    it was (not filled from replicas that lag it), each rank its own optimizer state (over DeAR not a
    gather of every rank's pieces of theirs, which the BSP start's pieces made of it).  ``reset``:
    ``OfflinePolicy(momentum="reset")`` zeroed the momentum at the switch, and the checkpoint holds the
    momentum built since; the load's re-entry into ASP applied the switch's changes again and zeroed
    it (0.009 off at the next step)."""
    model, ss, opt = job(comm, bsp)
    train_in_turns(comm, model, ss, opt, range(switch + 2))
    assert ss.phase == "asp"
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    comm.barrier()      # every rank saved before any steps on (a peer's next push could land in a store
    done = train_in_turns(comm, model, ss, opt, range(switch + 2, switch + 5))  # view saved later:
    ss.close()                                                              # pushed twice on resume)

    model, ss, opt = job(comm, bsp)
    model.load_state_dict(saved[0])
    opt.load_state_dict(copy.deepcopy(saved[1]))
    assert ss.phase == "bsp"        # until the next training forward, where every rank has loaded
    assert opt.state_dict()["commlib"]["strategy"]["phase"] == "asp"      # the state as loaded meanwhile
    training_forward(comm, model)
    assert ss.phase == "asp"
    assert_state_is(opt, saved[1])
    resumed = train_in_turns(comm, model, ss, opt, range(switch + 2, switch + 5))
    ss.close()
    np.testing.assert_array_equal(resumed, done)


@pytest.mark.mpi
@pytest.mark.parametrize("bsp", ["allreduce", "dear"])
def test_horovods_resume_of_an_asp_checkpoint_trains_as_every_rank_loading_it(comm, bsp):
    """Rank 0 saves in ASP, alone (Horovod's habit); a fresh job where rank 0 alone loads it, then
    ``broadcast_parameters`` and ``broadcast_optimizer_state`` (Horovod's resume), trains on exactly
    as one where every rank loads that file: the phase re-entered on every rank together (in the
    broadcast), with rank 0's parameter store and optimizer state everywhere (over DeAR, the state
    whole again after passing through the BSP start's pieces)."""
    model, ss, opt = adamw_job(comm, bsp)
    train_in_turns(comm, model, ss, opt, range(4))
    assert ss.phase == "asp"
    saved = copy.deepcopy((model.state_dict(), opt.state_dict())) if comm.rank == 0 else None
    saved = comm.allgather_object(saved)[0]       # the file, readable everywhere
    ss.close()
    runs = []
    for horovod in (False, True):
        model, ss, opt = adamw_job(comm, bsp)
        if comm.rank == 0 or not horovod:
            model.load_state_dict(saved[0])
            opt.load_state_dict(copy.deepcopy(saved[1]))
        if horovod:
            broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
            broadcast_optimizer_state(opt, root_rank=0, comm=comm)
        else:
            training_forward(comm, model)
        assert ss.phase == "asp"
        assert_state_is(opt, saved[1])
        runs.append(train_in_turns(comm, model, ss, opt, range(4, 7)))
        ss.close()
    np.testing.assert_array_equal(runs[1], runs[0])


@pytest.mark.mpi
@pytest.mark.parametrize("bsp", ["allreduce", "dear"])
def test_a_second_pass_before_the_step_adds_up_in_both_phases(comm, bsp):
    """A second backward pass before ``step()`` (DCGAN's discriminator: real, then fake) adds to the
    gradients in BSP (reduced onto their average, as the BSP strategy does) and in ASP (this rank's own
    gradients): two passes then ``step()`` train as one pass of their summed loss (ASP's ranks take
    turns, so that it is deterministic).  It raised "cannot add another pass" in both phases."""
    def run(split: bool) -> np.ndarray:
        model = make_model(comm.rank)
        ss = SyncSwitch(bsp=AllReduce(cap_mb=0.0003) if bsp == "allreduce" else DeAR(cap_mb=0.0003),
                        policy=SchedulePolicy([(0, "bsp"), (2, "asp")]))
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                   strategy=ss, comm=comm, find_unused_parameters=True)
        def two_passes(step: int) -> None:
            x, y = batch(step + 17 * comm.rank, comm.size)
            opt.zero_grad()
            losses = [loss_fn(model, x[:LOCAL] * k, y[:LOCAL]) for k in (1.0, 0.5)]
            for loss in losses if split else [losses[0] + losses[1]]:
                loss.backward()
            opt.step()

        for step in range(5):
            in_turns(comm, ss.phase == "asp", two_passes, step)
        assert [s["to"] for s in ss.switches] == ["asp"]
        ss.close()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    np.testing.assert_allclose(run(True), run(False), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("bsp", ["allreduce", "dear"])
def test_close_in_asp_ends_in_bsp_with_a_plain_model(comm, bsp):
    """``opt.close()`` in ASP ends training as in BSP: the replicas and their optimizers alike, the
    windows freed, the model plain (no hook, ``.grad`` plain tensors; ``torch.jit.script`` compiles it)
    and ``state_dict()`` whole.  It left the replicas apart until the user's ``ss.close()``, which then
    put DeAR's sharded ``.grad`` views and hooks back on the closed optimizer's model."""
    from commlib.bindings.torch_grads import ShardedGrad

    model = make_model(comm.rank)
    ss = SyncSwitch(bsp=AllReduce(cap_mb=0.0003) if bsp == "allreduce" else DeAR(cap_mb=0.0003),
                    policy=SchedulePolicy([(0, "bsp"), (1, "asp")]))
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, strategy=ss,
                               comm=comm, find_unused_parameters=True)
    for step in range(3):
        local_step(comm, model, opt, step)
    assert ss.phase == "asp"
    opt.close()
    assert ss.phase == "bsp" and not ss.stores
    same_on_all_ranks(comm, model)
    ss.close()                          # the user's own close, as before: nothing left to do
    assert not any(isinstance(p.grad, ShardedGrad) for p in model.parameters())
    assert all(not m._forward_pre_hooks and not m._state_dict_pre_hooks for m in model.modules())
    torch.jit.script(model)
    state = opt.state_dict()["state"]
    table = comm.allgather(torch.cat([v.reshape(-1) for st in state.values() for v in st.values()]).numpy())
    assert all(np.array_equal(t, table[0]) for t in table), "the optimizers differ after close()"


@pytest.mark.mpi
def test_a_retired_optimizers_switch_callback_leaves_the_model_alone(comm):
    """A new ``DistributedOptimizer`` over the same model and the same ``SyncSwitch`` retires the old
    one, whose callback stays registered on the strategy: at the next switch it neither gathers its
    old pieces nor puts its hooks back on the parameters (they would take the new optimizer's
    gradients into the old buckets)."""
    model = make_model(comm.rank)
    ss = SyncSwitch(bsp=DeAR(cap_mb=0.0003), policy=SchedulePolicy([(0, "bsp"), (2, "asp")]))
    old = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, strategy=ss,
                               comm=comm, find_unused_parameters=True)
    new = None
    for step in range(4):
        if step == 1:
            new = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, strategy=ss,
                                       comm=comm, find_unused_parameters=True)
        local_step(comm, model, new or old, step)
    assert ss.phase == "asp" and "exp_avg" in new.state[model.fc1.weight]
    assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in model.parameters() if p.requires_grad)
    new.close()
    same_on_all_ranks(comm, model)


@pytest.mark.mpi
def test_a_synchronous_run_holds_no_store_so_many_optimizers_fit_in_a_job(comm):
    """The parameter store's windows (a copy of each bucket and MPI contexts) are made at the first
    switch out of BSP, not when wrapping: 200 optimizers made and dropped without ``close()`` in one
    job, as a hyperparameter search does, whose SyncSwitch stays in BSP (the default policy) fit; MPICH
    ran out of contexts at the 136th ("Too many communicators").  A switch to ASP makes the store."""
    for _ in range(200):
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        ss = SyncSwitch(bsp=AllReduce(**SMALL))
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=ss, comm=comm)
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        assert ss.stores == []
    ss.switch_to("asp")
    assert len(ss.stores) == len(opt.buckets) > 1
    opt.close()
    assert ss.stores == [] and ss.phase == "bsp"


@pytest.mark.mpi
@pytest.mark.parametrize("lr", ["float", "int", "tensor", "adam-tensor"])
def test_lr_scale_scales_a_learning_rate_of_any_kind(comm, lr):
    """ASP's ``lr_scale`` halves the update whatever the group's ``lr`` is: an int (``SGD(lr=1)``)
    or a tensor (``Adam(lr=torch.tensor(...))``) were left as they were (the update at full size),
    silently.  Each rank's ASP step is its own (taken in turns): the update halves exactly."""
    from commlib.collectives import OfflinePolicy

    def asp_update(lr_scale: float) -> torch.Tensor:
        model = make_model(0)
        rate = {"float": 1.0, "int": 1, "tensor": torch.tensor(1.0), "adam-tensor": torch.tensor(0.01)}[lr]
        inner = (torch.optim.Adam(model.parameters(), lr=rate) if lr == "adam-tensor" else
                 torch.optim.SGD(model.parameters(), lr=rate))
        ss = SyncSwitch(policy=OfflinePolicy(0.5, total_steps=4, lr_scale=lr_scale))
        opt = DistributedOptimizer(inner, model, strategy=ss, comm=comm)
        for step in range(2):                        # BSP, then the switch
            local_step(comm, model, opt, step)
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        in_turns(comm, True, local_step, comm, model, opt, 2)
        assert ss.phase == "asp"
        opt.close()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before

    full, half = asp_update(1.0), asp_update(0.5)
    assert full.abs().max() > 0
    torch.testing.assert_close(half, full / 2, rtol=1e-5, atol=1e-7)


@pytest.mark.mpi
def test_a_momentum_reset_without_a_momentum_hyperparameter_is_refused(comm):
    """``OfflinePolicy(momentum="reset")`` (or ``"ramp"``) under Adam reset nothing (Adam's first
    moment is ``exp_avg`` under its betas), silently: refused at wrapping, on every rank; SGD with
    momentum resets its buffer at the switch."""
    from commlib.collectives import OfflinePolicy
    from commlib.errors import ValidationError

    model = make_model(0)
    for momentum in ("reset", "ramp"):
        ss = SyncSwitch(policy=OfflinePolicy(0.5, total_steps=4, momentum=momentum))
        with pytest.raises(ValidationError, match="resets or ramps the momentum .* Adam has no such"):
            DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model, strategy=ss, comm=comm)
    ss = SyncSwitch(policy=OfflinePolicy(0.5, total_steps=4, momentum="reset"))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, strategy=ss,
                               comm=comm)
    for step in range(2):
        local_step(comm, model, opt, step)
    assert ss.phase == "asp"
    assert not opt.state[model.fc1.weight]["momentum_buffer"].any()
    opt.close()


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["sgd", "sgd-nesterov", "sgd-foreach", "rmsprop"])
def test_a_momentum_ramp_from_zero_restarts_the_buffer(comm, kind):
    """``OfflinePolicy(momentum="ramp")``: the coefficient is 0 at the switch step, and torch's SGD
    and RMSprop skip their momentum buffer at 0, so the BSP buffer came back at the next step
    (``0.45 * buf_BSP + g`` where ``buf = mu_t * buf + g`` gives ``0.45 * g + g``; the parameters
    22.1 off).  Each step's buffer is checked against the recurrence in float64 (a linear loss:
    the gradients, and so the buffers, do not depend on the parameters the ASP store moves)."""
    from commlib.collectives import OfflinePolicy

    torch.set_default_dtype(torch.float64)
    try:
        w = torch.nn.Parameter(torch.zeros(3))
        make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1),
                "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
                "sgd-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
                "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9)}[kind]
        opt = DistributedOptimizer(make([w]), torch.nn.ParameterList([w]), strategy=SyncSwitch(
            policy=OfflinePolicy(0.5, 6, momentum="ramp", ramp_steps=2)), comm=comm)
        every = [np.array([1.0, -2.0, 0.5]) * (1 + r) for r in range(comm.size)]
        damp = 0.1 if kind == "sgd" else 0.0
        buf, sq = None, np.zeros(3)
        for step in range(6):        # steps 0-2 BSP (the average), 3-5 ASP: mu 0, 0.45, 0.9
            g = np.mean(every, axis=0) if step < 3 else every[comm.rank]
            mu = 0.9 * (1.0 if step < 3 else min(1.0, (step - 3) / 2))
            if kind == "rmsprop":
                sq = 0.99 * sq + 0.01 * g * g
                d = g / (np.sqrt(sq) + 1e-8)
                buf = mu * (0 if buf is None else buf) + d
            else:
                buf = g.copy() if buf is None else mu * buf + (1 - damp) * g
            opt.zero_grad()
            (w * torch.tensor(every[comm.rank])).sum().backward()
            opt.step()
            got = opt.state_dict()["state"][0]["momentum_buffer"].numpy()
            np.testing.assert_allclose(got, buf, rtol=1e-12, atol=1e-14, err_msg=f"step {step}")
        opt.close()
    finally:
        torch.set_default_dtype(torch.float32)
