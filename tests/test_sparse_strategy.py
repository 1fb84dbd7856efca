"""The sparse strategy, SparseAllReduce, as a binding drives it and through the torch binding.

Selectors and error feedback alone: test_sparsify.py.
"""

from __future__ import annotations

import math
import pickle
import warnings

import numpy as np
import pytest

import commlib
from commlib.collectives import TensorSpec, plan_buckets
from commlib.sparsify import ExDyna, HardThreshold, SparseAllReduce, TopK

from conftest import HAVE_GPU, HAVE_TORCH, NO_GPU_REASON, checkpoint_bytes, heavy_tailed_grad, resume_from


def host64(x) -> np.ndarray:
    """A float64 host copy of a numpy, cupy or torch array."""
    if type(x).__module__.startswith("cupy"):
        x = x.get()
    elif type(x).__module__.startswith("torch"):
        x = x.float().numpy()
    return np.array(x, dtype=np.float64, copy=True)


def _strategy_run(comm, strategy, grads_like, steps, start=0, make=np.asarray, poke=None):
    """Drive a strategy as a binding does; returns each step's averaged gradient (host copies).
    ``poke(grads_like)``: edits each step's gradient before the exchange."""
    n = int(grads_like.shape[0])
    buckets = plan_buckets([TensorSpec(0, n, str(grads_like.dtype).replace("torch.", ""), 4)],
                           comm.size, strategy.cap_bytes, strategy.first_cap_bytes)
    if strategy.comm is None:
        strategy.setup(comm, buckets, [grads_like], [grads_like], broadcast=False)
    out = []
    for t in range(start, start + steps):
        grads_like[...] = make(heavy_tailed_grad(comm.rank, t, n))
        if poke is not None:
            poke(grads_like)
        strategy.bucket_ready(0)
        strategy.before_update()
        out.append(host64(grads_like))
        strategy.after_update()
    return out


@pytest.mark.mpi(min_size=1)
def test_strategy_writes_the_sparse_average_back(comm):
    n = 30_000
    buf = np.zeros(n, np.float32)
    s = SparseAllReduce(selector=ExDyna(0.01), history=True)
    got = _strategy_run(comm, s, buf, 3)
    assert len(s.buckets) == 1 and s.steps == 3
    st_ = s.last_stats[0]
    assert np.count_nonzero(got[-1]) <= st_.union == st_.k
    allg = comm.allgatherv(got[-1]).reshape(comm.size, n)
    assert np.all(allg == allg[0])                          # every rank applies the same update
    assert len(s.history[0]) == 3
    assert s.stats["bytes"] == pytest.approx(sum(h.bytes for h in s.history[0]))
    assert (s.stats["bytes"] > 0) == (comm.size > 1)
    assert "ExDyna(density=0.01" in repr(s)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("selector", ["exdyna", "topk", "hard"])
@pytest.mark.parametrize("follow", [True, False])
def test_a_changing_loss_scale_is_followed(comm, selector, follow):
    """Gradients handed over in the units of a loss scale that changes between steps (GradScaler's
    growth and backoff, powers of two), each change told with ``rescale_gradients``: every step's
    average is the unscaled run's times the scale, exactly (residuals and thresholds follow).  Not
    told, the residual carried over a change counts old/new times, and the runs part.  (MiCRO's
    threshold starts from an absolute value, the prototype's rule: in the scaled units from step 1.)"""
    scales = [2.0**10, 2.0**11, 2.0**11, 2.0**9, 2.0**12, 2.0**12, 2.0**12]
    n, step = 20_000, [0]

    def make():
        return SparseAllReduce(selector={"exdyna": ExDyna(0.01), "topk": TopK(0.01),
                                         "hard": HardThreshold(0.01)}[selector])

    def scaled(g):
        t = step[0]
        step[0] += 1
        if follow and t and scales[t] != scales[t - 1]:
            s.rescale_gradients(scales[t] / scales[t - 1])
        g *= scales[t]

    plain = _strategy_run(comm, make(), np.zeros(n, np.float32), len(scales))
    s = make()
    got = _strategy_run(comm, s, np.zeros(n, np.float32), len(scales), poke=scaled)
    same = [np.array_equal(g / k, p) for g, k, p in zip(got, scales, plain)]
    assert same == [True] * len(scales) if follow else same[0] and not any(same[1:])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("before_setup", [False, True])
def test_strategy_state_round_trips(comm, before_setup):
    n = 25_000
    s = SparseAllReduce(selector=ExDyna(0.02))
    _strategy_run(comm, s, np.zeros(n, np.float32), 4)
    saved = pickle.loads(pickle.dumps(s.state_dict()))
    assert saved["buckets"][0]["selector"]["threshold"]["threshold"] == s.selectors[0].threshold
    first = _strategy_run(comm, s, s.grads[0], 4, start=4)
    fresh = SparseAllReduce(selector=ExDyna(0.02))
    buf = np.zeros(n, np.float32)
    if before_setup:
        fresh.load_state_dict(saved)
    else:
        _strategy_run(comm, fresh, buf, 0)
        fresh.load_state_dict(saved)
    again = _strategy_run(comm, fresh, buf, 4, start=4)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert fresh.steps == s.steps == 8


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("selector", ["exdyna", "topk"])
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_an_overflowed_gradient_is_averaged_densely_and_spares_the_residuals(comm, selector, bad):
    """A non-finite element in one rank's gradient (fp16 loss scaling overflows on purpose) reaches
    every rank as the dense average does (DDP: inf/NaN where it was, GradScaler and apply_if_finite
    then skip the step everywhere), and that step leaves residuals and selectors as they were: the
    steps after it equal a run without it.  ExDyna kept an overflow outside the rank's partition in
    its residual (the skip came a step late, on a good step) and never sent a NaN (no rank skipped;
    the NaN stayed in the residual for good)."""
    n = 5000
    make = {"exdyna": lambda: ExDyna(0.02), "topk": lambda: TopK(0.02)}[selector]
    where = (comm.size - 1, n - 7)          # one element of the last rank's gradient

    def overflow(g):
        if comm.rank == where[0]:
            g[where[1]] = bad

    def state(strategy):
        return pickle.dumps(strategy.state_dict()["buckets"])

    s, buf = SparseAllReduce(selector=make()), np.zeros(n, np.float32)
    _strategy_run(comm, s, buf, 2)
    before = state(s)
    [got] = _strategy_run(comm, s, buf, 1, start=2, poke=overflow)
    dense = np.stack([heavy_tailed_grad(r, 2, n) for r in range(comm.size)]).astype(np.float64)
    dense[where] = bad
    np.testing.assert_allclose(got, dense.mean(0), rtol=1e-6, atol=1e-6)       # inf or NaN there
    assert state(s) == before                              # residual, threshold, step: untouched
    later = _strategy_run(comm, s, buf, 2, start=3)
    w, wbuf = SparseAllReduce(selector=make()), np.zeros(n, np.float32)
    _strategy_run(comm, w, wbuf, 2)
    without = _strategy_run(comm, w, wbuf, 2, start=3)      # the same run, step 2 never taken
    for a, b in zip(later, without):
        np.testing.assert_array_equal(a, b)


@pytest.mark.mpi(min_size=1)
def test_strategy_state_from_another_rank_drops_the_residual(comm):
    n = 5000
    s = SparseAllReduce(selector=ExDyna(0.02))
    _strategy_run(comm, s, np.zeros(n, np.float32), 2)
    state = s.state_dict()
    state["rank"] = (comm.rank + 1) % (comm.size + 1)
    fresh = SparseAllReduce(selector=ExDyna(0.02))
    _strategy_run(comm, fresh, np.zeros(n, np.float32), 0)
    with pytest.warns(UserWarning, match="residuals start from zero"):
        fresh.load_state_dict(state)
    assert not fresh.feedback[0].residual.any()
    assert fresh.selectors[0].threshold == s.selectors[0].threshold


@pytest.mark.mpi(min_size=1)
def test_strategy_state_from_another_world_keeps_step_and_threshold(comm):
    """Saved at another world size: the step and the threshold carry over, partition
    boundaries start afresh (they belong to the ranks), residuals start from zero."""
    n = 5000
    s = SparseAllReduce(selector=ExDyna(0.02))
    _strategy_run(comm, s, np.zeros(n, np.float32), 3)
    state = s.state_dict()
    saved = state["buckets"][0]["selector"]
    state["world_size"] = comm.size + 1
    saved["partitions"] = {"bad": "boundaries of another world, never read"}
    fresh = SparseAllReduce(selector=ExDyna(0.02))
    _strategy_run(comm, fresh, np.zeros(n, np.float32), 0)
    start = fresh.selectors[0].partitions.state_dict()
    with pytest.warns(UserWarning, match="partition boundaries from the start"):
        fresh.load_state_dict(state)
    sel = fresh.selectors[0]
    assert sel.step == saved["step"] == 3
    assert sel.threshold == s.selectors[0].threshold is not None
    assert sel.policy.state_dict() == saved["threshold"]
    assert sel.partitions.state_dict() == start
    assert not fresh.feedback[0].residual.any()


@pytest.mark.mpi(min_size=1)
def test_strategy_rejects_integer_gradients(comm):
    s = SparseAllReduce()
    buf = np.zeros(10, np.int32)
    b = plan_buckets([TensorSpec(0, 10, "int32", 4)], comm.size)
    with pytest.raises(commlib.ValidationError, match="floating"):
        s.setup(comm, b, [buf], [buf], broadcast=False)


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_strategy_on_torch_tensors(comm, dtype):
    import torch

    n = 8192
    t = torch.zeros(n, dtype=getattr(torch, dtype))
    s = SparseAllReduce(selector=ExDyna(0.05))
    got = _strategy_run(comm, s, t, 3, make=lambda a: torch.from_numpy(a).to(t.dtype))
    assert s.feedback[0].residual.dtype == np.float32
    assert 0 < np.count_nonzero(got[-1]) <= s.last_stats[0].union
    allg = comm.allgatherv(got[-1]).reshape(comm.size, n)
    assert np.all(allg == allg[0])


def _train_mlp(comm, strategy, steps: int, momentum: float = 0.0):
    """A small MLP trained ``steps`` steps through the torch binding, each rank on its own data;
    returns the flat parameters (flushed) and the optimizer."""
    import torch

    from commlib.bindings.torch import DistributedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), model,
                               strategy=strategy, comm=comm)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.flush()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(), opt


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_drops_into_the_torch_binding(comm):
    strategy = SparseAllReduce(selector=ExDyna(0.05))
    flat, opt = _train_mlp(comm, strategy, 4)
    allp = comm.allgatherv(flat.astype(np.float64)).reshape(comm.size, -1)
    assert np.all(allp == allp[0])                          # replicas stay identical
    assert strategy.steps == 4 and strategy.last_stats[0].union == strategy.last_stats[0].k
    state = opt.state_dict()["commlib"]["strategy"]
    assert state["name"] == "sparse" and len(state["buckets"]) == 1


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("saved, loaded", [
    ("exdyna", "topk"), ("exdyna", "exdyna-reference"), ("exdyna", "exdyna-64-blocks"),
    ("selsync-exdyna", "selsync-topk")])
def test_a_refused_checkpoint_changes_nothing(comm, saved, loaded):
    """A checkpoint of other selector settings is refused on every rank (``ValueError``) before any of
    it is loaded, as torch refuses a load: the optimizer's momentum had been replaced by the
    checkpoint's, and the strategy's step count, before the selector refused its state."""
    from commlib.collectives import SelSync

    def make(kind):
        kind, gated = (kind[len("selsync-"):], True) if kind.startswith("selsync-") else (kind, False)
        selector = {"exdyna": lambda: ExDyna(0.05), "topk": lambda: TopK(0.05),
                    "exdyna-reference": lambda: ExDyna(0.05, threshold="reference"),
                    "exdyna-64-blocks": lambda: ExDyna(0.05, num_blocks=64)}[kind]()
        sparse = SparseAllReduce(selector=selector)
        return SelSync(inner=sparse, delta=0.0, mode="grads") if gated else sparse

    _, other = _train_mlp(comm, make(saved), 3, momentum=0.9)
    ckpt = checkpoint_bytes(opt=other)
    _, opt = _train_mlp(comm, make(loaded), 2, momentum=0.9)
    before = checkpoint_bytes(opt=opt)
    with pytest.raises(ValueError, match="given to"):
        resume_from(ckpt, opt=opt)
    assert checkpoint_bytes(opt=opt) == before


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_selsync_gates_the_sparse_exchange(comm):
    """``SelSync(inner=SparseAllReduce(selector=ExDyna()), mode="grads")``, DESIGN's composition, through
    the torch binding: at ``delta=0`` every step is the sparse exchange's own (the same parameters and
    residuals as ``SparseAllReduce`` alone); with local steps after the warm-up, the exchange runs on
    the synchronized steps only and its residuals wait for them."""
    from commlib.collectives import SelSync

    def run(gate: bool, delta: float = 0.0):
        sparse = SparseAllReduce(selector=ExDyna(0.05))
        strategy = SelSync(inner=sparse, delta=delta, window=2, mode="grads") if gate else sparse
        return _train_mlp(comm, strategy, 6, momentum=0.9)[0], sparse, strategy

    (gated, inner, _), (alone, sparse, _) = run(True), run(False)
    np.testing.assert_array_equal(gated, alone)
    np.testing.assert_array_equal(inner.feedback[0].residual, sparse.feedback[0].residual)
    _, inner, gate = run(True, delta=math.inf)
    assert gate.stats["syncs"] == 2 and gate.stats["local_steps"] == 4      # the warm-up's, then local
    assert inner.steps == 2


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_grad_scaler_skips_an_overflowed_step_on_every_rank(comm, bad):
    """ExDyna under ``GradScaler``: one rank's loss overflows at step 2; every rank's scaler skips
    that step and halves its scale, and the run goes on as one that never had step 2 (its scale
    halved by hand): parameters and the strategy's state equal.  The skip came at step 3 (inf:
    held in the residual, sent a step late) or never (NaN)."""
    torch = pytest.importorskip("torch")
    binding = pytest.importorskip("commlib.bindings.torch")

    def run(take):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        strategy = SparseAllReduce(selector=ExDyna(0.05))
        opt = binding.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                           strategy=strategy, comm=comm)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scales = []
        for step in range(5):
            if step not in take:
                scaler.update(new_scale=scaler.get_scale() / 2)
                continue
            g = torch.Generator().manual_seed(100 * step + comm.rank)
            x, y = torch.randn(8, 20, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step == 2 and comm.rank == comm.size - 1:
                loss = loss + model[0].bias[0] * float(bad)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        return scales, params, pickle.dumps(strategy.state_dict()["buckets"])

    scales, params, state = run([0, 1, 2, 3, 4])
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    _, params_without, state_without = run([0, 1, 3, 4])
    np.testing.assert_array_equal(params, params_without)
    assert state == state_without


class _ScaledRun:
    """A small model trained under a GradScaler (handed to DistributedOptimizer or not) with ExDyna or
    SelSync over TopK, whose state lives in the gradients' units; ``steps`` trains on, the same batches
    whatever object runs them, and ``checkpoint``/``resume`` go through a torch.save'd file's bytes."""

    def __init__(self, comm, strategy, scaler, give, seed=0):
        import torch

        from commlib.bindings.torch import DistributedOptimizer
        from commlib.collectives import SelSync

        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        strat = (SparseAllReduce(selector=ExDyna(0.05)) if strategy == "exdyna" else
                 SelSync(SparseAllReduce(selector=TopK(0.05)), delta=0.05, warmup=2, mode="grads"))
        self.opt = DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9),
                                        self.model, strategy=strat, comm=comm,
                                        grad_scaler=scaler if give else None)
        self.comm, self.scaler = comm, scaler

    def steps(self, first, last):
        import torch

        for step in range(first, last):
            g = torch.Generator().manual_seed(100 * step + self.comm.rank)
            x, y = torch.randn(8, 20, generator=g), torch.randn(8, 4, generator=g)
            self.opt.zero_grad()
            self.scaler.scale(torch.nn.functional.mse_loss(self.model(x), y)).backward()
            self.scaler.unscale_(self.opt)
            self.scaler.step(self.opt)
            self.scaler.update()
        return self

    def checkpoint(self) -> bytes:
        return checkpoint_bytes(model=self.model, opt=self.opt, scaler=self.scaler)

    def resume(self, ckpt: bytes):
        resume_from(ckpt, model=self.model, opt=self.opt, scaler=self.scaler)
        return self

    def params(self) -> np.ndarray:
        import torch

        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).numpy()


def _doubling_scaler(enabled=True):
    """A GradScaler from 2^8 doubling every second step (after steps 1, 3, 5, 7)."""
    import torch

    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, enabled=enabled)


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("strategy", ["exdyna", "selsync"])
@pytest.mark.parametrize("given", [True, False])
def test_a_grad_scaler_handed_over_trains_as_the_unscaled_run(comm, strategy, given):
    """The loop's GradScaler handed to DistributedOptimizer (``grad_scaler=``), its scale doubling every
    second step: the run trains bit for bit as the one without loss scaling (ExDyna's residuals and
    threshold, SelSync's norm average and its inner TopK's residuals follow each change).  Not handed
    over, the runs part (the residual carried over a change counted half)."""
    plain = _ScaledRun(comm, strategy, _doubling_scaler(enabled=False), True).steps(0, 8)
    assert plain.scaler.get_scale() == 1.0
    got = _ScaledRun(comm, strategy, _doubling_scaler(), given).steps(0, 8)
    assert got.scaler.get_scale() == 2.0**12
    assert np.array_equal(got.params(), plain.params()) == given


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("strategy", ["exdyna", "selsync"])
def test_a_run_resumed_after_a_scale_change_trains_as_the_one_that_went_on(comm, strategy):
    """A checkpoint taken right after the scaler doubled its scale (the strategy's state still in the
    old units, the scaler's at the new), resumed into a new model, optimizer and scaler on every rank:
    the rest of the run is bit for bit the uninterrupted one's (the scale the state is in was saved
    with the optimizer's state, so the first resumed step rescales it as the run that went on did)."""
    whole = _ScaledRun(comm, strategy, _doubling_scaler(), True).steps(0, 8)
    first = _ScaledRun(comm, strategy, _doubling_scaler(), True).steps(0, 4)
    assert first.scaler.get_scale() == 2.0**10          # doubled at step 3's update: the state is at 2^9
    resumed = _ScaledRun(comm, strategy, _doubling_scaler(), True, seed=1).resume(first.checkpoint())
    np.testing.assert_array_equal(resumed.steps(4, 8).params(), whole.params())


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("zero_grad", ["opt", "model"])
def test_an_idle_parameters_sent_residual_is_applied(comm, zero_grad):
    """A head no rank uses in a step, after steps that left it a residual: what the exchange sends of
    that residual is applied (SGD at lr 1: the head moves by the mean over ranks of what left their
    residuals), whether ``.grad`` was zeroed or set to None; it was left out of the update as unused,
    with its residual spent."""
    torch = pytest.importorskip("torch")
    binding = pytest.importorskip("commlib.bindings.torch")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"body": torch.nn.Linear(6, 8), "head": torch.nn.Linear(8, 3)})
    strategy = SparseAllReduce(selector=TopK(0.5), cap_mb=1e-6)          # a bucket per tensor
    opt = binding.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model,
                                       strategy=strategy, comm=comm, find_unused_parameters=True)
    head = {2, 3}     # trained parameters in optimizer order: body.weight, body.bias, head.weight, head.bias

    def residual_of_head() -> np.ndarray:
        parts = sorted((sl.index, strategy.feedback[b.index].residual[sl.offset:sl.offset + sl.numel])
                       for b in opt.buckets for sl in b.slots if sl.index in head)
        return comm.allreduce(np.concatenate([r for _, r in parts]).astype(np.float64)) / comm.size

    g = torch.Generator().manual_seed(comm.rank)
    for step in range(3):
        if step == 2:
            r0 = residual_of_head()
            p0 = torch.cat([p.detach().reshape(-1) for p in model["head"].parameters()])
        (opt if zero_grad == "opt" else model).zero_grad()
        h = torch.tanh(model["body"](torch.randn(4, 6, generator=g)))
        loss = h.pow(2).mean() + (model["head"](h).pow(2).mean() if step < 2 else 0.0)
        loss.backward()
        opt.step()
    moved = (torch.cat([p.detach().reshape(-1) for p in model["head"].parameters()]) - p0).numpy()
    spent = residual_of_head() - r0
    assert np.abs(spent).max() > 0                  # the exchange sent some of the head's residual
    np.testing.assert_allclose(moved, spent, rtol=1e-5, atol=1e-6)



# ---------------------------------------------------------------------- GPU (cupy)
@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
def test_strategy_on_cupy_gradients():
    import cupy
    from mpi4py import MPI

    c = commlib.init(comm=MPI.COMM_WORLD, backend="mpi", cuda_aware=False)
    buf = cupy.zeros(50_000, cupy.float32)
    s = SparseAllReduce(selector=ExDyna(0.01))
    got = _strategy_run(c, s, buf, 3, make=cupy.asarray)
    assert isinstance(s.feedback[0].residual, cupy.ndarray)
    assert np.count_nonzero(got[-1]) <= s.last_stats[0].union == s.last_stats[0].k
    c.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("selector", ["exdyna", "exdyna-reference", "micro"])
def test_density_one_is_the_dense_average_from_the_first_step(comm, selector):
    """``density=1``: every element travels at every step, as the dense average; the threshold's
    window left the smallest values (and every zero) in the residual while it settled (4762 of 5000
    in the union at step 0, 43 of 328 parameters off a dense step through torch)."""
    from commlib.sparsify import MiCRO

    n = 5000
    make = {"exdyna": lambda: ExDyna(1.0), "exdyna-reference": lambda: ExDyna(1.0, threshold="reference"),
            "micro": lambda: MiCRO(1.0)}[selector]
    s = SparseAllReduce(selector=make())
    zeros = np.zeros(n, np.float32)

    def poke(g):
        g[::7] = 0                                          # exact zeros travel too
    got = _strategy_run(comm, s, zeros, 3, poke=poke)
    for t, avg in enumerate(got):
        grads = [heavy_tailed_grad(r, t, n).astype(np.float64) for r in range(comm.size)]
        for g in grads:
            g[::7] = 0
        np.testing.assert_allclose(avg, np.mean(grads, axis=0), rtol=1e-6, atol=1e-7)
        assert s.last_stats[0].union == n
    assert not np.any(s.feedback[0].residual)


@pytest.mark.mpi(min_size=1)
def test_a_state_of_other_selector_settings_warns(comm):
    """A checkpoint of ExDyna(0.02) loaded into ExDyna(0.05) loaded silently (the density changed
    unnoticed); it loads with a warning naming both."""
    n = 5000
    s = SparseAllReduce(selector=ExDyna(0.02))
    _strategy_run(comm, s, np.zeros(n, np.float32), 2)
    other = SparseAllReduce(selector=ExDyna(0.05))
    _strategy_run(comm, other, np.zeros(n, np.float32), 0)
    with pytest.warns(UserWarning, match=r"state of ExDyna\(density=0.02.* loaded into ExDyna\(density=0.05"):
        other.load_state_dict(s.state_dict())
    assert other.selectors[0].step == 2
    same = SparseAllReduce(selector=ExDyna(0.02))
    _strategy_run(comm, same, np.zeros(n, np.float32), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(s.state_dict())                # the same settings: silent
