"""Steps whose gradients are not finite (an inf in one rank's sample), in the loops people write:
the loop skips them (its clipping norm is not finite) or GradScaler does, the loop zeroes with
``model.zero_grad()`` or adds a parameter group right after one; every later step must be one
process's on the concatenated batch (float64, tight tolerances).  (The overflow patterns of the
training-loop sweep: ``fp16-scaler`` in test_train_loops.py.)
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import HAVE_TORCH, STRATEGIES

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

if HAVE_TORCH:
    import torch

    from commlib.bindings.torch import DistributedOptimizer

    torch.set_num_threads(1)

LOCAL = 4          # samples per rank per step
STEPS = 4
MAX_NORM = 0.05    # small enough that every step clips


def batch_with_an_inf(comm, seed: int, inf: bool, dist: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 global batch (5 features, 3 targets); with ``inf``, one input of the last rank's
    sample is infinite; ``dist``: this rank's slice."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(LOCAL * comm.size, 5, generator=g, dtype=torch.float64)
    y = torch.randn(LOCAL * comm.size, 3, generator=g, dtype=torch.float64)
    if inf:
        x[-1, 2] = float("inf")
    return (x.chunk(comm.size)[comm.rank], y.chunk(comm.size)[comm.rank]) if dist else (x, y)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
@pytest.mark.parametrize("scaler", [False, True])
def test_a_non_finite_step_leaves_no_trace_in_a_model_zero_grad_loop(comm, strategy, scaler):
    """One sample of the last rank holds an inf at step 1; the loop zeroes with ``model.zero_grad()``,
    clips with ``opt.clip_grad_norm_`` and skips the step its norm (or GradScaler) finds not finite.
    Every later step is one process's: the norms and the parameters.  Clipping multiplied the
    buckets' padding (beyond the parameters, never zeroed by ``model.zero_grad()``) by the NaN factor,
    so every later norm read NaN (and under GradScaler every replica went NaN)."""

    def run(dist: bool) -> tuple[list[float], np.ndarray]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[strategy](), comm=comm)
            assert any(b.padded > b.numel for b in opt.buckets), "no padding to test"
        amp = torch.amp.GradScaler("cpu", init_scale=64.0) if scaler else None
        norms = []
        for step in range(STEPS + 1):
            x, y = batch_with_an_inf(comm, 50 + step, step == 1, dist)
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            (amp.scale(loss) if amp else loss).backward()
            if amp:
                amp.unscale_(opt)
            norm = (opt.clip_grad_norm_(MAX_NORM) if dist
                    else torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            norms.append(float(norm))
            if amp:
                amp.step(opt)
                amp.update()
            elif torch.isfinite(norm):
                opt.step()
        return norms, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    (got, params), (want, ref) = run(True), run(False)
    assert not np.isfinite(got[1]) and not np.isfinite(want[1])
    np.testing.assert_allclose(got[2:], want[2:], rtol=1e-12)
    np.testing.assert_allclose(params, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_add_param_group_after_a_step_grad_scaler_skipped(comm, strategy):
    """GradScaler skips step 1 (an inf on the last rank); the loop adds a group at the top of step 2,
    before zeroing.  With ``grad_scaler=`` the skipped step ends there and the run is one process's;
    without it the refusal says what happened and what to do (it said to add the group after step(),
    which the loop had called)."""

    def run(dist: bool, hand_over: bool = True) -> np.ndarray:
        torch.manual_seed(0)
        body, head = torch.nn.Linear(5, 3).double(), torch.nn.Linear(5, 3).double()
        model = torch.nn.ModuleList([body, head])
        scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
        opt = torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9)
        if dist:
            opt = DistributedOptimizer(opt, model, strategy=STRATEGIES[strategy](), comm=comm,
                                       grad_scaler=scaler if hand_over else None)
        for step in range(STEPS):
            x, y = batch_with_an_inf(comm, 70 + step, step == 1, dist)
            if step == 2:
                if dist and not hand_over:
                    with pytest.raises(RuntimeError, match="GradScaler skipped: pass grad_scaler="):
                        opt.add_param_group({"params": head.parameters(), "lr": 0.05})
                    return np.zeros(0)
                opt.add_param_group({"params": head.parameters(), "lr": 0.05})
            opt.zero_grad()
            out = body(x) + (head(x) if step >= 2 else 0)
            scaler.scale(torch.nn.functional.mse_loss(out, y)).backward()
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() == 32.0
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    np.testing.assert_allclose(run(True), run(False), rtol=1e-12, atol=1e-14)
    run(True, hand_over=False)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["allreduce", "dear", "sparse-dense", "syncswitch-bsp",
                                      "syncswitch-dear"])
def test_a_step_skipped_on_one_rank_alone_raises_on_every_rank(comm, strategy):
    """Rank 0 decides alone to skip a step (zero_grad() after backward(), no step()) while the others
    update: the replicas differed silently (DeAR: equal on every rank and wrong, rank 0's shard
    not updated, then gathered everywhere; Sync-Switch's BSP phase: apart until a switch). The next
    backward raises the same error on every rank; a skip every rank makes alike goes on."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               strategy=STRATEGIES[strategy](), comm=comm)
    for step in range(4):
        x, y = batch_with_an_inf(comm, step, False, True)
        opt.zero_grad()
        if step == 3:
            with pytest.raises(RuntimeError, match="some ranks updated and others skipped step"):
                torch.nn.functional.mse_loss(model(x), y).backward()
            break
        torch.nn.functional.mse_loss(model(x), y).backward()
        if not (step == 2 and comm.rank == 0) and step != 1:     # step 1: every rank skips alike
            opt.step()
    opt.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["grads", "params"])
def test_a_step_skipped_on_one_rank_under_selsync_is_averaged_away(comm, mode):
    """SelSync (delta 0: every step synchronizes), rank 0 skips a step alone while the others
    update: in grads mode the replicas stayed apart for good, silently (its sync steps average
    the gradients, and the parameters only after local steps). The skip counts as drift now: the
    next step's agreement carries it and that step averages the parameters (and the momentum),
    so every replica is equal again after it; params mode averaged them anyway."""
    from commlib.collectives import SelSync

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                               strategy=SelSync(delta=0.0, window=2, warmup=2, mode=mode), comm=comm)
    for step in range(6):
        x, y = batch_with_an_inf(comm, step, False, True)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if not (step == 3 and comm.rank == 0):
            opt.step()
        if step >= 4:       # step 4's agreement carried the skip: its update re-aligned them
            with opt.flush():
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
                momentum = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                                      for p in model.parameters()]).numpy()
            for mine in (flat, momentum):
                table = comm.allgather(mine.copy())
                assert all(np.array_equal(t, table[0]) for t in table), (step, table)
    opt.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("where", ["mid", "out"])
def test_a_backward_that_raised_on_one_rank_and_was_caught_raises_on_every_rank(comm, strategy, passes,
                                                                                where):
    """The last rank's backward raises mid-pass (an autograd Function's backward, after some buckets
    were sent), the loop catches it and goes on: that rank's next pass paired with its peers' open
    one, a step apart, and the replicas trained apart silently (a metric all-reduce at the end gave
    3.99 for 10 at 4 ranks).  Every rank raises the same error before any update, and the
    communicator goes on.  ``out``: the model's last operation raises, before any parameter's
    gradient: no pass had begun, so nothing told the peers (the steps paired a batch apart).  (A
    backward that raises before it reaches the model, in the loss's own, leaves no trace: that
    rank skipped the batch; the README says so.)"""
    bad = comm.rank == comm.size - 1

    class Boom(torch.autograd.Function):
        armed = False

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if Boom.armed:
                raise ArithmeticError("boom")
            return g

    class Booming(torch.nn.Module):      # the model's last operation (a fused kernel, say) raises
        def forward(self, x):
            return Boom.apply(x)

    torch.manual_seed(0)
    first, last = torch.nn.Linear(5, 8).double(), torch.nn.Linear(8, 3).double()
    model = torch.nn.Sequential(first, torch.nn.Tanh(), last, Booming())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               strategy=STRATEGIES[strategy](), comm=comm,
                               backward_passes_per_step=passes)
    start = [p.detach().clone() for p in model.parameters()]
    raised = []
    for step in range(3):
        try:
            opt.zero_grad()
            for p in range(passes):
                x, y = batch_with_an_inf(comm, 10 * step + p, False, True)
                Boom.armed = bad and step == 1 and p == passes - 1
                out = last(Boom.apply(torch.tanh(first(x)))) if where == "mid" else model(x)
                torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
        except ArithmeticError:
            continue                                    # skip the bad batch, here alone
        except RuntimeError as e:
            raised.append((step, str(e)))
            break
    assert len(raised) == 1 and f"a backward() raised on rank {comm.size - 1}" in raised[0][1]
    assert raised[0][0] == (2 if bad else 1)
    for p, q in zip(model.parameters(), start):         # one update (step 0), the same on every rank
        mine = p.detach().numpy().ravel()
        assert np.array_equal(comm.allgatherv(mine).reshape(comm.size, -1)[0], mine)
        assert not torch.equal(p.detach(), q)
    assert float(comm.allreduce(np.ones(1))[0]) == comm.size


@pytest.mark.mpi
def test_a_gradient_of_the_input_alone_is_no_pass(comm):
    """``torch.autograd.grad`` of a training forward's output with respect to its input (a gradient
    penalty, a saliency map) reaches the model's output but computes no parameter's gradient: it is
    no pass, and the steps around it train as one process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    ref = copy.deepcopy(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch_with_an_inf(comm, step, False, True)
        xs, ys = batch_with_an_inf(comm, step, False, False)
        saliency = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(model(saliency).sum(), saliency)
        assert grad.shape == x.shape
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(xs), ys).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-12, atol=1e-14)



@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, extra", [("allreduce", "step"), ("allreduce", "backward"),
                                             ("dear", "step"), ("dear", "backward"),
                                             ("sparse-dense", "step"), ("selsync-local", "step"),
                                             ("selsync-local-params", "step")])
def test_an_extra_call_on_one_rank_raises_on_every_rank(comm, strategy, extra):
    """The last rank alone calls ``step()`` again without a backward, or runs ``backward()`` twice
    before ``step()``: its extra reduction paired with its peers' next step, and the replicas
    trained apart silently (a metric all-reduce gave 6.02 for 10 at 4 ranks), ``COMMLIB_CHECK=1``
    alike.  The step's agreement carries what each rank's reduction follows: every rank raises
    the same error at the peers' next step, before the extra step's update.  (DeAR's extra
    ``step()`` all-gathered its shards first, which met the peers' reduce-scatter.)  SelSync's
    local steps make no such agreement: there the words ride on its flag all-reduce (its extra
    ``step()`` was a silent local update more, its flags paired with the peers' a step apart)."""
    from commlib.collectives import AllReduce, SelSync

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    local = {"selsync-local": "grads", "selsync-local-params": "params"}
    make = (lambda: SelSync(inner=AllReduce(), delta=1e9, warmup=0, mode=local[strategy])) \
        if strategy in local else STRATEGIES[strategy]
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=make(), comm=comm)
    odd = comm.rank == comm.size - 1
    raised = None
    for step in range(3):
        x, y = batch_with_an_inf(comm, step, False, True)
        try:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if odd and step == 1 and extra == "backward":
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if odd and step == 1 and extra == "step":
                opt.step()
        except RuntimeError as e:
            raised = (step, str(e))
            break
    assert raised is not None and "the ranks are at different points of their steps" in raised[1], raised
    assert raised[0] == (1 if odd else 2)
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    same = np.array_equal(comm.allgatherv(mine).reshape(comm.size, -1)[0], mine)
    # (the peers had stepped before the extra backward came; SelSync's local steps part the replicas)
    assert same or extra == "backward" or strategy in local
    assert float(comm.allreduce(np.ones(1))[0]) == comm.size



@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("gate", ["selsync", "syncswitch-asp"])
def test_a_checkpoint_right_after_a_skipped_step_resumes_as_the_run_went_on(comm, gate):
    """``scaler.step(opt); scaler.update()`` skipped a step (an inf on the last rank), then every
    rank saved model, optimizer and scaler, before the next ``zero_grad()``: the skipped step ended
    only there, so the checkpoint was a step behind.  SelSync resumed 3e-4 off the run that went
    on (its gate's step and meter one behind); Sync-Switch, saved in ASP, parted the ranks' phases
    at the switch back to BSP (a MismatchError).  Saving ends the skipped step first."""
    import copy

    from commlib.collectives import AllReduce, SchedulePolicy, SelSync, SyncSwitch

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
        strategy = (SelSync(delta=0.3, mode="grads", window=3, warmup=2) if gate == "selsync" else
                    SyncSwitch(AllReduce(), policy=SchedulePolicy([(0, "bsp"), (3, "asp"), (5, "bsp")])))
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                   strategy=strategy, grad_scaler=scaler, comm=comm)
        return model, opt, scaler

    def step(model, opt, scaler, s):
        g = torch.Generator().manual_seed(100 * s + comm.rank)
        x, y = torch.randn(LOCAL, 6, generator=g), torch.randn(LOCAL, 3, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if s == 3 and comm.rank == comm.size - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def rest(model, opt, scaler):
        for s in range(4, 8):
            step(model, opt, scaler, s)
            phases = comm.allgather_object(opt.strategy.phase if gate != "selsync" else "-", label="phase")
            assert len(set(phases)) == 1, f"step {s}: phases {phases}"
        opt.close()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    model, opt, scaler = setup()
    for s in range(4):
        step(model, opt, scaler, s)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                           "scaler": scaler.state_dict()})
    comm.barrier()
    went_on = rest(model, opt, scaler)
    model, opt, scaler = setup()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    scaler.load_state_dict(saved["scaler"])
    resumed = rest(model, opt, scaler)
    if gate == "selsync":
        np.testing.assert_array_equal(resumed, went_on)
    else:       # (ASP's pulls see the peers' pushes as they come: not one run's values; replicas equal)
        table = np.asarray(comm.allgather(resumed)).reshape(comm.size, -1)
        assert (table == table[0]).all()
