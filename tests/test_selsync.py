"""SelSync: the significance metric, the consensus, both aggregation modes, state.

A float64 linear regression on flat bucket buffers is the model: each rank
computes its gradient on its own slice of a global batch, and a
single-process run on the concatenated batch is the BSP reference.
"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

import commlib
from commlib.collectives import AllReduce, DeAR, SyncSwitch, TensorSpec, plan_buckets
from commlib.collectives.selsync import SelSync, SignificanceMeter, l2_norm
from commlib.sparsify import ExDyna, SparseAllReduce

from conftest import HAVE_TORCH

DIM = (5, 7)          # two tensors, one bucket each
BATCH = 4             # per rank
LR = 0.05


def _problem(steps: int, size: int, seed: int = 7, noise: float = 0.5):
    """Global data: per step, ``size * BATCH`` rows of X and y (the same on every rank)."""
    rng = np.random.default_rng(seed)
    d = sum(DIM)
    w_true = rng.normal(size=d)
    X = rng.normal(size=(steps, size * BATCH, d))
    y = X @ w_true + noise * rng.normal(size=(steps, size * BATCH))
    return X, y


def _grad(w: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    return X.T @ (X @ w - y) / len(y)


class Model:
    """Flat bucket buffers for the two tensors of the regression, as a binding would hold them."""

    def __init__(self, size: int, w0: np.ndarray):
        specs = [TensorSpec(i, n, "float64", 8) for i, n in enumerate(DIM)]
        self.buckets = plan_buckets(specs, size, cap_bytes=8, first_cap_bytes=None)
        assert len(self.buckets) == 2
        self.params = [np.zeros(b.padded) for b in self.buckets]
        self.grads = [np.zeros(b.padded) for b in self.buckets]
        self.set_w(w0)

    def w(self) -> np.ndarray:
        return np.concatenate([p[:b.numel] for p, b in zip(self.params, self.buckets)])

    def set_w(self, w: np.ndarray) -> None:
        off = 0
        for p, b in zip(self.params, self.buckets):
            p[:b.numel] = w[off:off + b.numel]
            off += b.numel

    def set_grad(self, g: np.ndarray) -> None:
        off = 0
        for gb, b in zip(self.grads, self.buckets):
            gb[:b.numel] = g[off:off + b.numel]
            off += b.numel


def _train(comm, gate: SelSync, X, y, steps: int, votes=None, check_identical: bool = False,
           data_rank: int | None = None, momentum: float = 0.0, norm_first: bool = False):
    """Run ``steps`` steps; return per-step (synced, collectives made, w after the step).
    ``momentum``: SGD with momentum, its buffers registered with the gate.  ``norm_first``: as the
    JAX binding drives it, the gradient's norm handed over first (``observe_norm``), the buckets
    filled only where ``step_reads_gradients()`` says (else NaN, which a read would spread), the
    local update reading the gradient where it lives."""
    rank = comm.rank if data_rank is None else data_rank
    m = Model(comm.size, np.zeros(sum(DIM)))
    velocity = [np.zeros_like(p) for p in m.params]
    if momentum:
        gate.register_state_buffers(velocity)
    gate.setup(comm, m.buckets, m.params, m.grads)
    out = []
    for s in range(steps):
        for b in reversed(range(len(m.buckets))):
            gate.before_forward(b)
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        seq0 = comm.seq
        g = _grad(m.w(), X[s, rows], y[s, rows])
        if norm_first:
            gate.observe_norm(float(np.linalg.norm(g)))
        reads = not norm_first or gate.step_reads_gradients()
        m.set_grad(g if reads else np.full_like(g, np.nan))
        for b in range(len(m.buckets)):
            gate.bucket_ready(b)
        if votes is not None:
            gate.observe()
            gate.decide(want=bool(votes[s]))
        gate.before_update()
        if not reads:               # the update reads the local gradient where it lives
            m.set_grad(g)
        for p, g, v in zip(m.params, m.grads, velocity):
            v *= momentum
            v += g
            p -= LR * v
        gate.after_update()
        synced = gate.synced
        for b in reversed(range(len(m.buckets))):
            gate.before_forward(b)          # as the next forward does: the average has landed
        if check_identical and synced:
            w = m.w()
            everyone = comm.allgather(w)
            assert all(np.array_equal(everyone[0], e) for e in everyone), f"replicas differ after step {s}"
            seq0 += 1
        out.append((synced, comm.seq - seq0, m.w()))
    gate.flush()
    return out, m


def _reference(X, y, steps: int) -> list[np.ndarray]:
    """Single-process BSP on the concatenated batch."""
    w = np.zeros(X.shape[2])
    ws = []
    for s in range(steps):
        w = w - LR * _grad(w, X[s], y[s])
        ws.append(w.copy())
    return ws


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["grads", "params"])
@pytest.mark.parametrize("inner", ["allreduce", "dear"])
def test_delta_zero_is_bsp(comm, mode, inner):
    steps = 12
    X, y = _problem(steps, comm.size)
    gate = SelSync(inner=AllReduce() if inner == "allreduce" else DeAR(), delta=0.0, window=3, mode=mode)
    out, _ = _train(comm, gate, X, y, steps)
    ref = _reference(X, y, steps)
    for s, (synced, _, w) in enumerate(out):
        assert synced
        np.testing.assert_allclose(w, ref[s], rtol=1e-12, atol=1e-12)
    assert gate.stats["syncs"] == steps and gate.stats["local_steps"] == 0 and gate.stats["lssr"] == 0
    assert gate.stats["consensus_calls"] == 0        # known on every rank: no flag exchanged


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["grads", "params"])
def test_huge_delta_never_communicates_after_warmup(comm, mode):
    steps, warmup = 10, 3
    X, y = _problem(steps, comm.size)
    gate = SelSync(delta=math.inf, window=3, warmup=warmup, mode=mode)
    seq0 = comm.seq
    out, m = _train(comm, gate, X, y, steps)
    for s, (synced, ncoll, _) in enumerate(out):
        assert synced == (s < warmup)
        if s >= warmup:   # the flag only
            assert ncoll == (1 if comm.size > 1 else 0), f"step {s}: {ncoll} collectives"
    assert gate.stats["local_steps"] == steps - warmup
    assert gate.stats["lssr"] == pytest.approx((steps - warmup) / steps)
    sync_bytes = sum(b.nbytes for b in m.buckets) if comm.size > 1 else 0
    assert gate.stats["bytes_saved"] == pytest.approx((steps - warmup) * sync_bytes)
    # local SGD: each rank followed its own data; flush averaged the replicas
    w = m.w()
    everyone = comm.allgather(w)
    assert all(np.array_equal(everyone[0], e) for e in everyone)
    assert gate.stats["flush_syncs"] == (1 if comm.size > 1 else 0)
    assert comm.seq - seq0 > 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["grads", "params"])
@pytest.mark.parametrize("inner", ["allreduce", "dear"])
def test_any_rank_that_wants_sync_makes_all_sync_and_replicas_match(comm, mode, inner):
    steps, warmup = 14, 2
    X, y = _problem(steps, comm.size, seed=3)
    # rank r wants to sync at the steps where a shared draw picks it; nobody at others
    pick = np.random.default_rng(11).integers(-3, comm.size, size=steps)   # < 0: nobody wants
    votes = pick == comm.rank
    gate = SelSync(inner=AllReduce() if inner == "allreduce" else DeAR(), delta=math.inf, window=3,
                   warmup=warmup, mode=mode, average_on_flush=False)
    out, _ = _train(comm, gate, X, y, steps, votes=votes, check_identical=True)
    expected = [s < warmup or pick[s] >= 0 for s in range(steps)]
    assert [o[0] for o in out] == expected
    assert 0 < sum(expected[warmup:]) < steps - warmup     # both kinds of step happened
    # after local steps the replicas differ (each rank saw its own rows)
    last_local = max(s for s in range(steps) if not expected[s])
    everyone = comm.allgather(out[last_local][2])
    assert not all(np.array_equal(everyone[0], e) for e in everyone)


@pytest.mark.mpi(min_size=2)
def test_grads_mode_realigns_the_momentum_with_the_replicas(comm):
    """Grads mode: the synchronized step after local steps averages the parameters and the optimizer
    state, which drifted with them; the synchronized steps after it keep the replicas identical
    (with only the parameters averaged, each rank's own momentum took them apart again)."""
    steps = 10
    X, y = _problem(steps, comm.size, seed=3)
    votes = [True, True, False, False, False, True, True, True, True, True]
    gate = SelSync(delta=math.inf, window=3, warmup=2, mode="grads", average_on_flush=False)
    out, _ = _train(comm, gate, X, y, steps, votes=votes, check_identical=True, momentum=0.9)
    assert [o[0] for o in out] == votes
    assert [gate.trace[s][4] for s in range(steps)] == votes


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["grads", "params"])
def test_metric_drives_sync_and_replicas_match(comm, mode):
    steps = 30
    X, y = _problem(steps, comm.size, seed=5, noise=3.0)
    gate = SelSync(delta=0.05, window=4, mode=mode)
    out, _ = _train(comm, gate, X, y, steps, check_identical=True)
    # the decision equals "any rank's significance >= delta" (every rank's trace, all-gathered)
    sig = np.array([t[3] for t in gate.trace])
    table = comm.allgather(sig)
    want = (np.asarray(table) >= 0.05).any(axis=0)
    for s, (synced, _, _) in enumerate(out):
        assert synced == (s < 4 or bool(want[s])), s
    assert [t[4] for t in gate.trace] == [o[0] for o in out]
    assert np.isfinite(sig).all() and sig[0] == 0.0


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["grads", "params"])
def test_a_norm_handed_over_first_decides_as_the_buckets_do(comm, mode):
    """``observe_norm`` before ``bucket_ready`` (the JAX binding's order): the same decisions and
    parameters as the gate measuring its buckets; the buckets are read only where
    ``step_reads_gradients()`` says (a synchronized step in grads mode), never on local steps."""
    steps = 30
    X, y = _problem(steps, comm.size, seed=5, noise=3.0)
    runs = []
    for norm_first in (False, True):
        gate = SelSync(delta=0.3, window=4, mode=mode)
        out, _ = _train(comm, gate, X, y, steps, check_identical=True, norm_first=norm_first)
        runs.append(out)
        assert [t[4] for t in gate.trace] == [o[0] for o in out]
    assert [o[0] for o in runs[1]] == [o[0] for o in runs[0]]
    assert True in [o[0] for o in runs[0][4:]] and False in [o[0] for o in runs[0]]
    for (_, calls_a, wa), (_, calls_b, wb) in zip(*runs):
        np.testing.assert_allclose(wb, wa, rtol=1e-12, atol=1e-14)
        assert calls_b == calls_a
    gate = SelSync(delta=0.3, window=4, mode=mode)
    with pytest.raises(RuntimeError, match="before setup"):
        gate.observe_norm(1.0)


@pytest.mark.mpi(min_size=1)
def test_state_round_trips(comm):
    steps, cut = 20, 9
    X, y = _problem(steps, comm.size, seed=9, noise=2.0)

    def make():
        return SelSync(delta=0.04, window=5, mode="params")

    a = make()
    full, _ = _train(comm, a, X, y, steps)
    # first part, then a fresh gate from the state (json round trip), then the rest
    b = make()
    first, m = _train(comm, b, X[:cut], y[:cut], cut)
    state = json.loads(json.dumps(b.state_dict()))
    c = make()
    c.load_state_dict(state)
    assert c.state_dict() == state
    assert c.meter.value == b.meter.value and c.meter.count == cut and c.steps == cut
    c.setup(comm, m.buckets, m.params, m.grads, broadcast=False)
    rank = comm.rank
    for s in range(cut, steps):
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        m.set_grad(_grad(m.w(), X[s, rows], y[s, rows]))
        c.before_update()
        for p, g in zip(m.params, m.grads):
            p -= LR * g
        c.after_update()
        c.flush()
    assert [t[4] for t in c.trace] == [o[0] for o in full]
    np.testing.assert_allclose([t[3] for t in c.trace], [t[3] for t in a.trace], rtol=1e-9)
    assert c.stats["syncs"] == a.stats["syncs"] and c.stats["local_steps"] == a.stats["local_steps"]
    with pytest.raises(ValueError):
        SelSync(mode="grads").load_state_dict(state)
    # settings of the checkpoint win, as torch's lr does, but not silently (a resume with a new delta
    # trained at the old one unawares); so do its bucket caps (the strategy's, untuned)
    for other, says in [(SelSync(delta=0.5, window=5, mode="params"), "replace this gate's delta=0.5"),
                        (SelSync(delta=0.04, window=5, mode="params", inner=AllReduce(cap_mb=2)),
                         "bucket caps")]:
        with pytest.warns(UserWarning, match=says):
            other.load_state_dict(state)
        assert other.delta == 0.04 and other.inner.cap_bytes == c.inner.cap_bytes


@pytest.mark.mpi(min_size=1)
def test_state_of_another_rank_warns(comm):
    """The meter's EWMA is the saving rank's: a state loaded on another rank (or world) says so,
    whether loaded before setup or after; a rank's own state loads silently."""
    steps = 6
    X, y = _problem(steps, comm.size, seed=9, noise=2.0)
    a = SelSync(delta=0.04, window=5, mode="params")
    _, m = _train(comm, a, X, y, steps)
    own = a.state_dict()
    assert (own["rank"], own["world_size"]) == (comm.rank, comm.size)
    other = dict(own, rank=(comm.rank + 1) % (comm.size + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SelSync(delta=0.04, window=5, mode="params").load_state_dict(own)    # before setup: checked there
        b = SelSync(delta=0.04, window=5, mode="params")
        b.load_state_dict(own)
        b.setup(comm, m.buckets, m.params, m.grads, broadcast=False)
        b.load_state_dict(own)
    c = SelSync(delta=0.04, window=5, mode="params")
    c.load_state_dict(other)
    with pytest.warns(UserWarning, match=f"saved by rank {other['rank']} of {comm.size} .*significance EWMA"):
        c.setup(comm, m.buckets, m.params, m.grads, broadcast=False)
    with pytest.warns(UserWarning, match=f"of {comm.size + 1} loaded on rank {comm.rank}"):
        b.load_state_dict(dict(own, world_size=comm.size + 1))
    assert b.meter.value == a.meter.value


@pytest.mark.mpi(min_size=1)
def test_consensus_in_timeline(comm, tmp_path_factory):
    from mpi4py import MPI

    base = tmp_path_factory.mktemp("tl") if comm.rank == 0 else None
    base = comm.mpi_comm.bcast(str(base) if base else None, root=0)
    c2 = commlib.init(comm=MPI.COMM_WORLD, timeline=f"{base}/tl.rank{{rank}}.json", timeout=60)
    try:
        steps = 6
        X, y = _problem(steps, c2.size)
        gate = SelSync(delta=math.inf, window=2)
        _train(c2, gate, X, y, steps)
        path = c2.tracer.write()
    finally:
        c2.close()
    events = json.load(open(path))["traceEvents"]
    gates = [e for e in events if e.get("args", {}).get("op") == "selsync"]
    assert len(gates) == steps and [e["args"]["sync"] for e in gates] == [True, True] + [False] * 4
    flags = [e for e in events if e.get("args", {}).get("tag") == "selsync.flag" and e["cat"] == "running"]
    # params mode: the warm-up's 2 steps exchange the flag too (an overflow on any rank must be every
    # rank's), only the 4 after it are consensus calls
    assert len(flags) == (steps if c2.size > 1 else 0)
    assert gate.stats["consensus_calls"] == (steps - 2 if c2.size > 1 else 0)
    assert gate.stats["consensus_s"] >= 0
    assert gate.stats["overflow_checks"] == (2 if c2.size > 1 else 0)


def test_meter_defined_from_first_step_and_matches_reference():
    m = SignificanceMeter(window=25)
    norms = [1.0, 0.0, 3.0, 2.5, 2.0, 2.2, 9.0]
    beta = 1 - 2 / 26
    prev = None
    for i, x in enumerate(norms, 1):
        sig = m.update(x)
        ewma = sum((1 - beta) * beta ** (i - j) * norms[j - 1] for j in range(1, i + 1)) / (1 - beta ** i)
        assert m.value == pytest.approx(ewma, rel=1e-12)
        assert sig == (0.0 if prev is None else pytest.approx(abs(ewma - prev) / prev, rel=1e-9))
        prev = ewma
    z = SignificanceMeter(3)
    assert z.update(0.0) == 0.0 and z.update(0.0) == 0.0 and z.update(1.0) == math.inf


def test_l2_norm_dtypes():
    import ml_dtypes

    x = np.array([3.0, 4.0, 12.0])
    for dt in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        assert l2_norm([x[:2].astype(dt), x[2:].astype(dt)]) == pytest.approx(13.0)
    z = np.array([3 + 4j, 12j])                     # |z|: 5 and 12 (the sum of z*z would be -151 + 24j)
    for dt in (np.complex64, np.complex128):
        assert l2_norm([z[:1].astype(dt), z[1:].astype(dt)]) == pytest.approx(13.0)
    big = np.full(1000, 300.0, np.float16)          # the sum of squares overflows float16
    assert l2_norm([big]) == pytest.approx(300.0 * math.sqrt(1000), rel=1e-6)
    if HAVE_TORCH:
        import torch
        assert l2_norm([torch.tensor([3.0, 4.0], dtype=torch.bfloat16)]) == pytest.approx(5.0)


def _gate(case: str, last: bool) -> SelSync:
    """A gate whose setting ``case`` differs on the last rank (``last``)."""
    variants = {
        "warmup": lambda: SelSync(delta=0.3, window=3, warmup=6 if last else 2, mode="grads"),
        "warmup_params": lambda: SelSync(delta=0.3, window=3, warmup=6 if last else 2, mode="params"),
        "sync_optimizer_state": lambda: SelSync(delta=0.3, window=3, sync_optimizer_state=last),
        "average_on_flush": lambda: SelSync(delta=100.0, window=3, average_on_flush=not last),
        "overlap": lambda: SelSync(delta=0.3, window=3, overlap=not last),
        "delta_ulp": lambda: SelSync(delta=0.3 + 1e-9 * last, window=3, mode="grads"),
    }
    return variants[case]()


GATE_SETTINGS = ["warmup", "warmup_params", "sync_optimizer_state", "average_on_flush", "overlap",
                 "delta_ulp"]


@pytest.mark.parametrize("case", GATE_SETTINGS)
def test_repr_shows_every_setting_deterministically(case):
    a, b, again = _gate(case, False), _gate(case, True), _gate(case, False)
    assert repr(a) != repr(b), repr(a)
    assert repr(a) == repr(again) and " at 0x" not in repr(a), repr(a)
    # trace_len is this rank's bookkeeping: it may differ (a long trace kept on one rank only)
    assert repr(SelSync(trace_len=0)) == repr(SelSync(trace_len=10))


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("case", GATE_SETTINGS)
def test_settings_that_differ_on_the_last_rank_raise_at_wrap_on_every_rank(comm, case):
    """A different ``warmup`` made MPICH abort on an assertion (one rank in the flag's all-reduce, the
    other averaging), ``sync_optimizer_state`` / ``average_on_flush`` mismatched collectives or left
    replicas apart silently: refused when the optimizer is wrapped, on every rank."""
    import torch

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.errors import ValidationError

    model = torch.nn.Linear(8, 16)
    gate = _gate(case, comm.rank == comm.size - 1)
    before = comm.seq
    with pytest.raises(ValidationError, match="differs across ranks"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, strategy=gate,
                             comm=comm)
    assert comm.seq == before + 1       # only the agreement check ran: no collective was left half-called
    assert float(comm.allreduce(np.ones(1))[0]) == comm.size
    # a trace of another length on one rank is fine
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=comm,
                               strategy=SelSync(delta=0.3, window=3, trace_len=10 + comm.rank))
    opt.close()


def test_bad_arguments_fail_at_construction_naming_the_argument():
    """Each was accepted (window=True, trace_len=-1, switches of any type) or failed with a message that
    named no argument (delta='x': "could not convert string to float", window=inf: OverflowError)."""
    cases = [
        (lambda: SelSync(delta="x"), TypeError, r"SelSync\(delta='x'\): expected a number >= 0"),
        (lambda: SelSync(delta=None), TypeError, r"SelSync\(delta=None\): expected a number >= 0"),
        (lambda: SelSync(delta=math.nan), ValueError, r"SelSync\(delta=nan\): expected a number >= 0"),
        (lambda: SelSync(delta=-0.1), ValueError, r"delta=-0.1\): expected a number >= 0"),
        (lambda: SelSync(window=True), TypeError, r"SelSync\(window=True\): expected an integer >= 1"),
        (lambda: SelSync(window=1.5), TypeError, r"SelSync\(window=1.5\): expected an integer >= 1"),
        (lambda: SelSync(window=math.inf), TypeError, r"SelSync\(window=inf\): expected an integer >= 1"),
        (lambda: SelSync(window=0), ValueError, r"SelSync\(window=0\): expected an integer >= 1"),
        (lambda: SelSync(warmup=math.inf), TypeError, r"SelSync\(warmup=inf\): expected an integer >= 0"),
        (lambda: SelSync(warmup=math.nan), TypeError, r"SelSync\(warmup=nan\): expected an integer >= 0"),
        (lambda: SelSync(warmup=1.5), TypeError, r"SelSync\(warmup=1.5\): expected an integer >= 0"),
        (lambda: SelSync(warmup=-1), ValueError, r"SelSync\(warmup=-1\): expected an integer >= 0"),
        (lambda: SelSync(trace_len=-1), ValueError, r"SelSync\(trace_len=-1\): expected an integer >= 0"),
        (lambda: SelSync(trace_len=2.5), TypeError, r"SelSync\(trace_len=2.5\): expected an integer >= 0"),
        (lambda: SelSync(mode=None), TypeError, r"SelSync\(mode=None\): expected one of \('params'"),
        (lambda: SelSync(sync_optimizer_state="yes"), TypeError,
         r"SelSync\(sync_optimizer_state='yes'\): expected True or False"),
        (lambda: SelSync(overlap=None), TypeError, r"SelSync\(overlap=None\): expected True or False"),
        (lambda: SelSync(average_on_flush=1), TypeError, r"average_on_flush=1\): expected True or False"),
    ]
    for make, kind, message in cases:
        with pytest.raises(kind, match=message):
            make()
    gate = SelSync(delta=np.float32(0.5), window=np.int64(4), warmup=np.int32(2), overlap=np.bool_(False))
    assert (gate.delta, gate.meter.window, gate.warmup, gate.overlap) == (0.5, 4, 2, False)
    assert SelSync(delta=math.inf, warmup=0).warmup == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        SelSync(mode="weights")
    with pytest.raises(ValueError, match="delta"):
        SelSync(delta=-1)
    with pytest.raises(ValueError, match="window"):
        SelSync(window=0)
    with pytest.raises(TypeError, match=r"SelSync\(inner=...\): expected a commlib.collectives Strategy"):
        SelSync(inner="allreduce")
    with pytest.raises(TypeError, match=r"got ExDyna \(a gradient selector goes in .*SparseAllReduce"):
        SelSync(inner=ExDyna(density=0.1))      # a selector given where its strategy belongs
    with pytest.raises(TypeError, match=r"SyncSwitch\(bsp=...\): expected .* got ExDyna"):
        SyncSwitch(bsp=ExDyna(density=0.1))
    with pytest.raises(ValueError):
        SelSync(inner=SelSync())
    with pytest.raises(ValueError, match=r"SelSync\(inner=syncswitch\): .* writes the parameters itself"):
        SelSync(inner=SyncSwitch(bsp=DeAR()))   # its update changes with its phase: not a gradient average
    with pytest.raises(ValueError, match="SyncSwitch cannot wrap another SyncSwitch"):
        SyncSwitch(bsp=SyncSwitch())
    with pytest.raises(ValueError, match=r"SyncSwitch\(bsp=selsync\): .* writes the parameters itself"):
        SyncSwitch(bsp=SelSync(delta=1e30))     # its 'BSP' steps were local: the replicas drifted
    for wrap in (lambda s: SelSync(inner=s), lambda s: SyncSwitch(bsp=s)):    # its tuner never fed
        with pytest.raises(ValueError, match=r"\(tune=...\)\): the cap of a wrapped strategy is not tuned"):
            wrap(AllReduce(tune=True))
    with pytest.raises(ValueError, match=r"mode='params'\): the parameters are averaged whole"):
        SelSync(inner=SparseAllReduce(selector=ExDyna(0.1)))     # params mode would never run it
    SelSync(inner=SparseAllReduce(selector=ExDyna(0.1)), mode="grads")
    with pytest.raises(RuntimeError):
        SelSync().decide(want=True)
