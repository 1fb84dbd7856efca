"""Sync-Switch: switches in both directions keep replicas identical and lose nothing; policies; state."""

from __future__ import annotations

import time

import numpy as np
import pytest

from commlib.collectives import AllReduce, DeAR
from commlib.collectives.buckets import TensorSpec, plan_buckets
from commlib.collectives.policies import (
    OfflinePolicy,
    SchedulePolicy,
    StragglerPolicy,
    find_bsp_fraction,
    judge,
)
from commlib.collectives.syncswitch import SyncSwitch


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
