"""Sync-Switch: switches in both directions keep replicas identical and lose nothing; policies; state."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from commlib.collectives import AllReduce, DeAR
from commlib.collectives.buckets import TensorSpec, plan_buckets
from commlib.collectives.policies import (
    OfflinePolicy,
    Policy,
    SchedulePolicy,
    StragglerPolicy,
    find_bsp_fraction,
    judge,
)
from commlib.collectives.syncswitch import SyncSwitch

from conftest import HAVE_TORCH


def _flat(comm, sizes=((0, 37, "float32", 4), (1, 23, "float64", 8))):
    specs = [TensorSpec(i, n, dt, item) for i, n, dt, item in sizes]
    buckets = plan_buckets(specs, comm.size, cap_bytes=1 << 20, first_cap_bytes=None)
    params = [np.zeros(b.padded, b.dtype) for b in buckets]
    grads = [np.zeros(b.padded, b.dtype) for b in buckets]
    return buckets, params, grads


def _grad(rank: int, step: int, n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng([rank, step, n])
    return rng.integers(-3, 4, n).astype(dtype)


def _same_everywhere(comm, arrays) -> bool:
    for a in arrays:
        table = comm.allgather(a)
        if not all(np.array_equal(table[0], t) for t in table):
            return False
    return True


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("bsp", ["allreduce", "dear"])
def test_switches_keep_replicas_identical_and_lose_nothing(comm, bsp):
    """BSP steps apply the average gradient (over DeAR: to this rank's shard, then all-gathered), the
    asynchronous phases every rank's pushes, and the replicas are identical again at every BSP step."""
    buckets, params, grads = _flat(comm)
    for b, p in enumerate(params):
        p[:] = 0.5 * (b + 1)
    sched = SchedulePolicy([(0, "bsp"), (3, "asp"), (7, "bsp"), (10, "ssp"), (14, "bsp")])
    ss = SyncSwitch(bsp=AllReduce() if bsp == "allreduce" else DeAR(), policy=sched, staleness=1)
    ss.setup(comm, buckets, params, grads, [np.zeros(b.shard_numel, b.dtype) for b in buckets])
    lr = 0.25                                  # powers of two: float sums stay exact
    pushed = [np.zeros(p.size) for p in params]
    at_switch = None
    try:
        for step in range(17):
            phase = ss.phase
            for g in grads:
                g[:] = _grad(comm.rank, step, g.size, g.dtype)
            if phase != "bsp" and at_switch is None:
                at_switch = [p.astype(np.float64) for p in params]
                pushed = [np.zeros(p.size) for p in params]
            if phase != "bsp":
                for b, g in enumerate(grads):
                    pushed[b] += -lr * g
            else:
                expect = [p - lr * np.mean(comm.allgather(g.astype(np.float64)), axis=0)
                          for p, g in zip(params, grads)]
            ss.step(lr)
            if phase == "bsp":
                if ss.phase == "bsp":       # (a switch flushed them: a flush now pulls others' pushes)
                    ss.flush()
                for b, p in enumerate(params):
                    np.testing.assert_allclose(p, expect[b], rtol=1e-6, atol=1e-7, err_msg=f"step {step}")
            if ss.phase == "bsp":
                assert _same_everywhere(comm, params), f"replicas differ after step {step}"
                if at_switch is not None:      # just back from an asynchronous phase
                    for b, p in enumerate(params):
                        total = comm.allreduce(pushed[b], "sum")
                        np.testing.assert_array_equal(p.astype(np.float64), at_switch[b] + total)
                    at_switch = None
        assert [(s["from"], s["to"]) for s in ss.switches] == [
            ("bsp", "asp"), ("asp", "bsp"), ("bsp", "ssp"), ("ssp", "bsp")]
        assert ss.stats["asp_steps"] == 4 and ss.stats["ssp_steps"] == 4
        assert ss.progress() == 17.0
    finally:
        ss.close()


@pytest.mark.mpi(min_size=1)
def test_offline_policy_switches_once_with_lr_scale(comm):
    buckets, params, grads = _flat(comm, ((0, 16, "float32", 4),))
    pol = OfflinePolicy(0.5, total_steps=6, lr_scale=0.5, momentum="reset")
    ss = SyncSwitch(policy=pol)
    seen = []
    ss.on_switch(lambda old, new, ch: seen.append((old, new, ch["lr_scale"], ch["momentum"])))
    momentum = np.ones(16, np.float32)
    ss.register_state_buffers([momentum])
    ss.setup(comm, buckets, params, grads)
    try:
        while ss.progress() < 6:
            grads[0][:] = 1.0
            ss.step(0.5)
        assert seen == [("bsp", "asp", 0.5, "reset")] and ss.lr_scale == 0.5
        assert not momentum.any()
    finally:
        ss.close()
    assert _same_everywhere(comm, params)
    # 3 BSP steps of -0.5, then ASP steps of -0.25 until progress reached 6 (each counts 1/size)
    expected = -1.5 - 0.25 * comm.size * 3
    assert params[0][0] >= expected - 0.25 * comm.size   # ranks may overshoot by one step each
    assert params[0][0] <= expected + 1e-6


@pytest.mark.mpi(min_size=1)
def test_offline_policy_of_bsp_fraction_one_stays_synchronous(comm):
    """``OfflinePolicy(1.0, N)`` is BSP throughout (find_bsp_fraction's baseline), past its N steps
    too: it switched to ASP after the last step (a store opened, the momentum reset)."""
    buckets, params, grads = _flat(comm, ((0, 16, "float32", 4),))
    ss = SyncSwitch(policy=OfflinePolicy(1.0, total_steps=3, momentum="reset"))
    seen = []
    ss.on_switch(lambda old, new, ch: seen.append((old, new)))
    momentum = np.ones(16, np.float32)
    ss.register_state_buffers([momentum])
    ss.setup(comm, buckets, params, grads)
    try:
        for _ in range(5):
            grads[0][:] = 1.0
            ss.step(0.5)
        assert seen == [] and ss.phase == "bsp" and not ss.stores and momentum.all()
    finally:
        ss.close()
    np.testing.assert_allclose(params[0][:16], -2.5)


@pytest.mark.mpi(min_size=2)
def test_an_asynchronous_checkpoint_loads_on_another_number_of_ranks(comm):
    """The README's state is "loadable on any number of ranks": a checkpoint taken in ASP held the
    store's buckets padded to the world size (37 elements as 38 at 2 ranks), and one process
    refused it ("38 elements but the store holds 37") after it had switched phase."""
    buckets, params, grads = _flat(comm)
    ss = SyncSwitch(policy=SchedulePolicy("asp"))
    ss.setup(comm, buckets, params, grads)
    try:
        for step in range(2):
            for b, g in enumerate(grads):
                g[:buckets[b].numel] = _grad(comm.rank, step, buckets[b].numel, g.dtype)
            ss.step(0.1)
        comm.barrier()
        state = ss.state_dict()
    finally:
        ss.close()
    assert [len(v) for v in state["store"]] == [b.numel for b in buckets]
    alone = comm.split(color=comm.rank)       # one process each
    try:
        buckets1, params1, grads1 = _flat(alone)
        other = SyncSwitch(policy=SchedulePolicy("asp"))
        other.setup(alone, buckets1, params1, grads1, broadcast=False)
        try:
            other.load_state_dict(state)
            assert other.phase == "asp"
            for saved, now in zip(state["store"], other.state_dict()["store"]):
                np.testing.assert_array_equal(now, saved)
            short = dict(state, store=[v[:-1] for v in state["store"]])
            with pytest.raises(ValueError, match="parameter store holds buckets of"):
                other.load_state_dict(short)
        finally:
            other.close()
    finally:
        alone.close()


@pytest.mark.mpi(min_size=1)
def test_state_round_trip(comm):
    buckets, params, grads = _flat(comm)
    pol = StragglerPolicy(theta=1.5, window_k=2, m_windows=1)
    ss = SyncSwitch(policy=pol, staleness=2)
    ss.setup(comm, buckets, params, grads)
    try:
        for _ in range(3):
            ss.step(0.1)
        ss.switch_to("ssp")
        ss.step(0.1)
        state = ss.state_dict()
        assert state["phase"] == "ssp" and state["clock"] == 1
        other = SyncSwitch(policy=StragglerPolicy(), staleness=0)
        other.setup(comm, buckets, params, grads, broadcast=False)
        try:
            other.load_state_dict(state)
            assert other.phase == "ssp"
            again = other.state_dict()
            for saved, now in zip(state.pop("store"), again.pop("store")):     # the store as saved
                np.testing.assert_array_equal(now, saved)
            assert again == state
        finally:
            other.close()
    finally:
        ss.close()
    pairs = [(OfflinePolicy(0.3, 100, 0.5, "ramp", 7), OfflinePolicy(1.0, 1)),
             (SchedulePolicy([(0, "asp"), (4, "bsp")]), SchedulePolicy("bsp"))]
    for pol, twin in pairs:
        twin.load_state_dict(pol.state_dict())
        assert twin.state_dict() == pol.state_dict()


def test_judge_and_offline_ramp():
    assert judge([1.0, 1.0, 1.0, 4.0], 1.5) == [3]
    assert judge([1.0, 4.0], 1.5) == [1]         # two ranks: median 2.5, 4 > 3.75
    assert judge([1.0, 1.2, 1.1], 1.5) == []
    pol = OfflinePolicy(0.5, 100, momentum="ramp", ramp_steps=10)
    assert [pol.momentum_scale(s) for s in (10, 50, 55, 60, 99)] == [1.0, 0.0, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="momentum"):
        OfflinePolicy(0.5, 10, momentum="maybe")


def test_find_bsp_fraction_binary_search():
    calls = []

    def run(p):
        calls.append(p)
        return 0.9 if p >= 0.2 else 0.8

    res = find_bsp_fraction(run, candidates=(0.5, 0.25, 0.125, 0.0625), tolerance=0.01)
    assert res.p == 0.25 and res.baseline == 0.9
    assert calls[0] == 1.0 and len(calls) <= 4
    assert find_bsp_fraction(lambda p: 1.0 if p == 1.0 else 0.0).p == 1.0


@pytest.mark.mpi(min_size=2)
def test_straggler_policy_flags_and_clears(comm):
    buckets, params, grads = _flat(comm, ((0, 8, "float32", 4),))
    pol = StragglerPolicy(theta=1.5, window_k=3, m_windows=2)
    ss = SyncSwitch(policy=pol)
    ss.setup(comm, buckets, params, grads)
    slow = comm.size - 1
    try:
        local = 0
        while ss.progress() < 80:
            straggling = comm.rank == slow and 6 <= local < 12
            time.sleep(0.04 if straggling else 0.005)
            grads[0][:] = 1.0
            ss.step(0.01)
            local += 1
        flagged = [r for r in pol.log if r.get("switch") == "bsp->asp"]
        cleared = [r for r in pol.log if r.get("switch") == "asp->bsp"]
        assert flagged and flagged[0]["stragglers"] == [slow]
        assert cleared, pol.log
        assert [s["to"] for s in ss.switches][:2] == ["asp", "bsp"]
    finally:
        ss.close()
    assert _same_everywhere(comm, params)


# ---------------------------------------------------------------- settings: checked early, agreed at wrap
def _ss(case: str, last: bool):
    """A Sync-Switch whose setting ``case`` differs on the last rank (``last``): each setting changes
    what the ranks call (window allocations at a switch, allgathers per window, SSP waits) or compute."""
    off = dict(bsp_fraction=0.5, total_steps=8)
    variants = {
        "total_steps": lambda: SyncSwitch(policy=OfflinePolicy(0.5, total_steps=12 if last else 8)),
        "bsp_fraction": lambda: SyncSwitch(policy=OfflinePolicy(0.25 if last else 0.5, total_steps=8)),
        "lr_scale": lambda: SyncSwitch(policy=OfflinePolicy(**off, lr_scale=1.0 if last else 0.5)),
        "lr_scale_ulp": lambda: SyncSwitch(policy=OfflinePolicy(**off, lr_scale=0.5 + 1e-12 * last)),
        "momentum": lambda: SyncSwitch(policy=OfflinePolicy(**off, momentum="ramp" if last else "keep")),
        "ramp_steps": lambda: SyncSwitch(policy=OfflinePolicy(**off, momentum="ramp", ramp_steps=3 + last)),
        "async_phase": lambda: SyncSwitch(policy=OfflinePolicy(**off, async_phase="ssp" if last else "asp")),
        "window_k": lambda: SyncSwitch(policy=StragglerPolicy(theta=1.5, window_k=3 if last else 2)),
        "m_windows": lambda: SyncSwitch(policy=StragglerPolicy(theta=1.5, m_windows=3 if last else 2)),
        "theta": lambda: SyncSwitch(policy=StragglerPolicy(theta=1.6 if last else 1.5)),
        "schedule": lambda: SyncSwitch(policy=SchedulePolicy([(0, "bsp"), (3 if last else 2, "asp")])),
        "schedule_lr_scale": lambda: SyncSwitch(policy=SchedulePolicy("asp", lr_scale=1.0 if last else 0.5)),
        "staleness": lambda: SyncSwitch(policy=OfflinePolicy(**off, async_phase="ssp"), staleness=3 * last),
        "layout": lambda: SyncSwitch(layout="server" if last else "sharded"),
        "progress": lambda: SyncSwitch(progress="thread" if last else "none"),
        "progress_interval_s": lambda: SyncSwitch(progress_interval_s=2e-3 if last else 1e-3),
        "ssp_timeout": lambda: SyncSwitch(ssp_timeout=30.0 if last else None),
    }
    return variants[case]()


SETTINGS = ["total_steps", "bsp_fraction", "lr_scale", "lr_scale_ulp", "momentum", "ramp_steps",
            "async_phase", "window_k", "m_windows", "theta", "schedule", "schedule_lr_scale", "staleness",
            "layout", "progress", "progress_interval_s", "ssp_timeout"]


@pytest.mark.parametrize("case", SETTINGS)
def test_repr_shows_every_setting_deterministically(case):
    """The repr (which the bindings compare over the ranks) tells the two apart, holds no object id and
    is the same text for the same settings (every process builds its own objects)."""
    a, b, again = _ss(case, False), _ss(case, True), _ss(case, False)
    assert repr(a) != repr(b), repr(a)
    assert repr(a) == repr(again) and " at 0x" not in repr(a), repr(a)


def test_repr_of_a_policy_subclass_holds_no_object_id():
    class Every(Policy):
        name = "every"

        def __init__(self, k: int):
            super().__init__()
            self.k = k

        def config(self):
            return {"k": self.k}

        def phase(self, step):
            return "asp" if step % self.k else "bsp"

    assert repr(SyncSwitch(policy=Every(3))) == repr(SyncSwitch(policy=Every(3)))
    assert "policy=Every(k=3)" in repr(SyncSwitch(policy=Every(3)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("case", SETTINGS)
def test_settings_that_differ_on_the_last_rank_raise_at_wrap_on_every_rank(comm, case):
    """A setting that differs on one rank hung at the first switch (``total_steps``, ``window_k``:
    window allocations, allgathers met by nobody, until the timeout) or trained apart silently
    (``lr_scale``): it is refused when the optimizer is wrapped, on every rank, before any other
    collective."""
    import torch

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.errors import ValidationError

    model = torch.nn.Linear(8, 16)
    ss = _ss(case, comm.rank == comm.size - 1)
    before = comm.seq
    t0 = time.perf_counter()
    with pytest.raises(ValidationError, match="differs across ranks"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, strategy=ss,
                             comm=comm)
    assert time.perf_counter() - t0 < 10
    assert comm.seq == before + 1       # only the agreement check ran: no collective was left half-called
    assert float(comm.allreduce(np.ones(1))[0]) == comm.size


def test_bad_settings_fail_at_construction():
    """Each was accepted and failed hours later (layout, progress: at the first switch out of BSP;
    policy="asp": at wrap), trained to NaN or uphill (lr_scale nan, -1), or was truncated silently."""
    cases = [
        (lambda: SyncSwitch(layout="x"), ValueError,
         r"SyncSwitch\(layout='x'\): expected one of \('sharded'"),
        (lambda: SyncSwitch(progress="x"), ValueError,
         r"SyncSwitch\(progress='x'\): expected one of \('auto'"),
        (lambda: SyncSwitch(policy="asp"), TypeError, r"policy='asp'\): expected a Policy .*SchedulePolicy"),
        (lambda: SyncSwitch(staleness=1.5), TypeError, r"staleness=1.5\): expected an integer >= 0"),
        (lambda: SyncSwitch(staleness=True), TypeError, r"staleness=True\): expected an integer >= 0"),
        (lambda: SyncSwitch(staleness=-1), ValueError, r"staleness=-1\): expected an integer >= 0"),
        (lambda: SyncSwitch(ssp_timeout=-1), ValueError, r"ssp_timeout=-1\): expected None or seconds >= 0"),
        (lambda: SyncSwitch(ssp_timeout=math.nan), ValueError, r"ssp_timeout=nan\)"),
        (lambda: SyncSwitch(ssp_timeout="5"), TypeError, r"ssp_timeout='5'\)"),
        (lambda: SyncSwitch(progress_interval_s=0), ValueError,
         r"progress_interval_s=0\): expected a finite"),
        (lambda: SyncSwitch(progress_interval_s=math.inf), ValueError, r"progress_interval_s=inf\)"),
        (lambda: SchedulePolicy([(0, "bsp"), (2, "asp")], lr_scale=math.nan), ValueError,
         r"SchedulePolicy\(lr_scale=nan\): expected a finite number > 0"),
        (lambda: SchedulePolicy("asp", lr_scale=-1.0), ValueError,
         r"lr_scale=-1.0\): expected a finite number > 0"),
        (lambda: SchedulePolicy("asp", lr_scale=math.inf), ValueError, r"lr_scale=inf\)"),
        (lambda: SchedulePolicy([(0, "bsp"), (-3, "asp")]), ValueError,
         r"entry \(-3, 'asp'\): expected .*>= 0"),
        (lambda: SchedulePolicy([(0, "bsp"), (2.5, "asp")]), TypeError, r"entry \(2.5, 'asp'\)"),
        (lambda: SchedulePolicy([(0, "bsp"), (0, "asp")]), ValueError, "a step given twice"),
        (lambda: SchedulePolicy("sync"), ValueError, r"schedule='sync'\).*phases in \('bsp', 'asp', 'ssp'\)"),
        (lambda: SchedulePolicy(5), TypeError, r"schedule=5\)"),
        (lambda: OfflinePolicy(0.5, 10, lr_scale=math.inf), ValueError, r"lr_scale=inf\): expected a finite"),
        (lambda: OfflinePolicy(0.5, 10, lr_scale=0), ValueError,
         r"lr_scale=0\): expected a finite number > 0"),
        (lambda: OfflinePolicy(0.5, 10.7), TypeError,
         r"OfflinePolicy\(total_steps=10.7\): expected an integer"),
        (lambda: OfflinePolicy(0.5, -1), ValueError, r"total_steps=-1\): expected an integer >= 0"),
        (lambda: OfflinePolicy(0.5, 10, ramp_steps=2.5), TypeError,
         r"ramp_steps=2.5\): expected an integer >= 1"),
        (lambda: OfflinePolicy(0.5, 10, ramp_steps=0), ValueError,
         r"ramp_steps=0\): expected an integer >= 1"),
        (lambda: OfflinePolicy(math.nan, 10), ValueError, r"bsp_fraction=nan\): expected a fraction in 0..1"),
        (lambda: OfflinePolicy("0.5", 10), TypeError, r"bsp_fraction='0.5'\)"),
        (lambda: OfflinePolicy(0.5, 10, async_phase="bsp"), ValueError, r"async_phase='bsp'\)"),
        (lambda: StragglerPolicy(window_k=2.5), TypeError,
         r"StragglerPolicy\(window_k=2.5\): expected an integer"),
        (lambda: StragglerPolicy(m_windows=0.5), TypeError, r"m_windows=0.5\): expected an integer >= 1"),
        (lambda: StragglerPolicy(window_k=0), ValueError, r"window_k=0\): expected an integer >= 1"),
        (lambda: StragglerPolicy(theta=math.inf), ValueError, r"theta=inf\): expected a finite number > 1"),
        (lambda: StragglerPolicy(theta=math.nan), ValueError, r"theta=nan\)"),
        (lambda: find_bsp_fraction(lambda p: 1.0, tolerance=math.nan), ValueError, r"tolerance=nan\)"),
    ]
    for make, kind, message in cases:
        with pytest.raises(kind, match=message):
            make()
    # what is accepted stays accepted (numpy integers and floats included)
    pol = OfflinePolicy(np.float64(0.5), np.int64(10), lr_scale=np.float32(0.5), ramp_steps=3)
    ss = SyncSwitch(policy=pol, staleness=np.int32(2), layout="server", progress="none", ssp_timeout=0)
    assert (ss.staleness, ss.policy.total_steps, ss.policy.lr_scale, ss.ssp_timeout) == (2, 10, 0.5, 0.0)
    assert type(ss.staleness) is int and type(ss.policy.total_steps) is int
    assert SchedulePolicy([(np.int64(3), "asp"), (0, "bsp")]).schedule == [(0, "bsp"), (3, "asp")]
