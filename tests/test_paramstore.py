"""The one-sided parameter store: nothing lost under concurrent pushes, SSP bounds, board, errors."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import commlib
from commlib.collectives.paramstore import ParamStore


def _pushes(seed: int, rank: int, numel: int, dtype: str) -> list[np.ndarray]:
    """Rank ``rank``'s pushes for example ``seed``: small integers (exact in float32 sums; complex:
    in both parts)."""
    rng = np.random.default_rng([seed, rank, 7])
    part = 1j if np.dtype(dtype).kind == "c" else 0
    return [(rng.integers(-4, 5, numel) + part * rng.integers(-4, 5, numel)).astype(dtype)
            for _ in range(int(rng.integers(0, 6)))]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", ["sharded", "server"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64"])
@settings(max_examples=4, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**16), numel=st.integers(0, 40))
def test_asp_nothing_lost(comm, layout, dtype, seed, numel):
    # derandomize: every rank draws the same examples, so the collective calls line up
    init = np.arange(numel, dtype=dtype)
    store = ParamStore(comm, numel, dtype, init=init, layout=layout, server=comm.size - 1)
    try:
        store.activate()
        out = np.empty(numel, dtype)
        for d in _pushes(seed, comm.rank, numel, dtype):
            store.push(d)
            store.pull(out)                      # interleaved reads do not disturb the sums
        store.barrier()
        got = store.pull()
        wide = np.complex128 if np.dtype(dtype).kind == "c" else np.float64
        expected = init.astype(wide) + sum(
            (sum(_pushes(seed, r, numel, dtype), np.zeros(numel, wide)) for r in range(comm.size)),
            np.zeros(numel, wide))
        np.testing.assert_array_equal(got.astype(wide), expected)
    finally:
        store.close()


@pytest.mark.mpi(min_size=1)
def test_push_pull_scale_and_load(comm):
    n = 101
    store = ParamStore(comm, n, np.float64, init=np.ones(n))
    try:
        out = np.empty(n)
        store.push_pull(np.full(n, 2.0), out, scale=0.5)      # this rank's own push is visible
        assert (out >= 2.0).all()
        store.barrier()
        np.testing.assert_array_equal(store.pull(), np.full(n, 1.0 + comm.size))
        store.load(np.arange(n, dtype=np.float64))
        np.testing.assert_array_equal(store.pull(), np.arange(n))
    finally:
        store.close()


@pytest.mark.mpi(min_size=1)
def test_bad_input_raises_everywhere(comm):
    with pytest.raises(commlib.ValidationError, match="holds float32, float64, complex64, complex128"):
        ParamStore(comm, 10, "int32")
    # one rank's bad init is reported on every rank, before any window exists
    init = np.zeros(10 if comm.rank else 9, np.float32)
    with pytest.raises(commlib.ValidationError, match="rank 0: init: 9 elements"):
        ParamStore(comm, 10, "float32", init=init)
    for timeout in (-1.0, float("nan")):     # accepted before: -1 waited forever, NaN never timed out
        with pytest.raises(commlib.ValidationError, match="timeout .*expected seconds >= 0"):
            ParamStore(comm, 10, "float32", timeout=timeout)
    store = ParamStore(comm, 10, "float32")
    try:
        with pytest.raises(commlib.ValidationError, match="dtype float64"):
            store.push(np.zeros(10))
        with pytest.raises(commlib.ValidationError, match="staleness"):
            store.wait_bounded(-1)
    finally:
        store.close()


@pytest.mark.mpi(min_size=2)
def test_ssp_bound_holds_with_a_slow_rank(comm):
    s, steps, slow = 1, 8, comm.size - 1
    store = ParamStore(comm, 8, "float32", timeout=60)
    try:
        store.activate()
        worst = 0
        for _ in range(steps):
            if comm.rank == slow:
                time.sleep(0.02)
            store.push(np.ones(8, np.float32))
            store.tick()
            store.wait_bounded(s)
            c = store.clocks()
            worst = max(worst, int(c[comm.rank] - c.min()))
        assert worst <= s
        fast_waited = store.stats["ssp_wait_s"]
        store.barrier()
        np.testing.assert_array_equal(store.pull(), np.full(8, steps * comm.size))
        assert store.clocks().tolist() == [steps] * comm.size
        if comm.rank != slow:
            assert fast_waited > 0.02     # the fast ranks were held back
    finally:
        store.close()


@pytest.mark.mpi(min_size=2)
def test_ssp_timeout_names_the_slowest(comm):
    store = ParamStore(comm, 4, "float32")
    try:
        if comm.rank == 0:
            store.tick(3)
            with pytest.raises(commlib.CommTimeoutError, match=r"ranks \[1"):
                store.wait_bounded(1, timeout=0.2)
        store.barrier()
    finally:
        store.close()


@pytest.mark.mpi(min_size=1)
def test_board_and_command(comm):
    store = ParamStore(comm, 4, "float32")
    try:
        store.publish([comm.rank * 1.5, 2.0])
        store.barrier()
        table = store.read_board()
        assert table[:, 0].tolist() == [r * 1.5 for r in range(comm.size)]
        if comm.rank == 0:
            store.post_command(3.0)
        store.barrier()
        assert store.read_command() == 3.0
    finally:
        store.close()


@pytest.mark.mpi(min_size=1)
def test_closing_the_communicator_closes_its_stores(comm):
    own = comm.split(0)            # a communicator of its own, closed here
    early = ParamStore(own, 8, "float32")
    late = ParamStore(own, 8, "float64", init=np.arange(8.0))
    early.close()                  # closed by hand first: not closed twice
    own.close()                    # closes late, then itself (what the exit hook calls)
    with pytest.raises(commlib.ValidationError, match="closed"):
        late.pull(np.empty(8))
    late.close()                   # a no-op now
    with pytest.raises(commlib.CommAbortedError, match="closed"):
        own.close_with(early)


@pytest.mark.mpi(min_size=1)
def test_stores_closed_by_their_owner_leave_the_communicator(comm):
    """A store made and closed again and again (a Sync-Switch wrapped afresh for each phase of a
    job) stayed in its communicator's list of what to close until the communicator closed: 1.3 KB
    each, for good."""
    own = comm.split(0)
    try:
        for _ in range(20):
            ParamStore(own, 8, "float32").close()
        kept = ParamStore(own, 8, "float32")
        assert own._resources == [kept]
    finally:
        own.close()
