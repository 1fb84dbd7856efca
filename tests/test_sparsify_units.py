"""Single-process properties of sparsify's bookkeeping: partitions, threshold rules, dtype plumbing."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commlib.sparsify import (
    BlockPartitions,
    CountCurveThreshold,
    EqualPartitions,
    ExDyna,
    ReferenceThreshold,
    imbalance,
)
from commlib.sparsify._arrays import index_dtype, read_as, write_as
from commlib.sparsify.base import check_density
from commlib.sparsify.kernels import scan_binned, take_above, take_scan, threshold_scan, top_k
from commlib.sparsify.threshold import quantize, sample_tail, solve_initial

from conftest import HAVE_GPU, NO_GPU_REASON


# ---------------------------------------------------------------------- partitions
def test_block_layout_of_the_reference():
    p = BlockPartitions(25_000_000, 4)
    assert p.num_blocks == 1024 and p.block_size % 32 == 0
    assert p.block_size == (25_000_000 // 1024) // 32 * 32
    assert p.remainder == 25_000_000 - 1024 * p.block_size
    assert p.sizes() == [256, 256, 256, 256] and p.min_blocks == 64
    assert p.range(3)[1] == 25_000_000                      # the remainder joins the last partition
    p.check()
    q = BlockPartitions(10_000_000, 3)
    assert q.sizes() == [342, 341, 341]                      # the first 1024 % 3 get one more


@pytest.mark.parametrize("numel", [1, 2, 7, 31, 100, 1023, 1024, 1025, 32767, 32768, 40_000, 1 << 20])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_small_vectors_still_cover(numel, n):
    p = BlockPartitions(numel, n)
    p.check()
    assert p.num_blocks * p.block_size + p.remainder == numel
    assert p.num_blocks == min(1024, numel)
    if numel >= 1024 * 32:
        assert p.block_size % 32 == 0
    if p.num_blocks >= n:
        assert all(s >= 1 for s in p.sizes())               # nobody is left without work
    assert max(hi - lo for lo, hi in p.ranges()) <= p.largest()


def test_equal_partitions():
    assert EqualPartitions(10, 4).ranges() == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert EqualPartitions(3, 4).ranges() == [(0, 1), (1, 2), (2, 3), (3, 3)]


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 5_000_000), n=st.integers(1, 16),
       rounds=st.lists(st.lists(st.integers(0, 10_000), min_size=16, max_size=16), min_size=1, max_size=40))
def test_partitions_stay_a_cover_with_every_move(numel, n, rounds):
    p = BlockPartitions(numel, n)
    twin = BlockPartitions(numel, n)
    for counts in rounds:
        before = list(p.bounds)
        moves = p.rebalance(counts[:n])
        p.check()
        assert twin.rebalance(counts[:n]) == moves and twin.bounds == p.bounds   # deterministic
        assert sum(abs(a - b) for a, b in zip(before, p.bounds)) == moves        # one block per move


def test_rebalance_moves_toward_the_mean_and_respects_the_minimum():
    p = BlockPartitions(1 << 20, 2)
    assert p.rebalance([1200, 800]) == 1 and p.sizes() == [511, 513]
    assert p.rebalance([800, 1200]) == 1 and p.sizes() == [512, 512]
    assert p.rebalance([1000, 1040]) == 0                  # inside the band
    assert p.rebalance([0, 0]) == 0
    for _ in range(1000):
        p.rebalance([10_000, 1])
    assert p.sizes()[0] == p.min_blocks == 1024 // 8


def test_imbalance():
    assert imbalance([5, 5, 5, 5]) == 0.0
    assert imbalance([20, 10, 5, 5]) == 1.0
    assert imbalance([0, 0]) == 0.0


# ---------------------------------------------------------------------- threshold rules
def _drifting_gradients(numel, steps, seed=0):
    """Heavy-tailed gradients (Student t, 3 dof) whose scale decays and whose layers differ in scale."""
    rng = np.random.default_rng(seed)
    layer_scale = np.repeat(rng.lognormal(0, 1, 16), numel // 16 + 1)[:numel]
    for t in range(steps):
        g = rng.standard_t(3, numel) * layer_scale * math.exp(-t / 40) * (1 + 0.3 * math.sin(t / 3))
        yield g.astype(np.float32)


def _simulate(policy, numel=200_000, steps=80, density=0.01, seed=0):
    """One rank, error feedback, the policy driving selection: the density error per step."""
    k = round(density * numel)
    policy.start(k)
    residual = np.zeros(numel, np.float32)
    errors = []
    for g in _drifting_gradients(numel, steps, seed):
        residual += g
        if policy.needs_init:
            policy.threshold = solve_initial(sample_tail(np, residual, density)[None, :], density, k)
        floor, thr = policy.window()
        pos, mags = threshold_scan(np, residual, floor)
        if policy.record_len:
            bins = policy.bins(np, mags, floor)
            hist = policy.histogram(np, bins)
            j, take = policy.choose(k, hist[None, :])
            pos = take_above(np, pos, mags, bins, j, take[0])
            policy.update(k, pos.size, hist, j)
        else:
            policy.update(k, pos.size)
        residual[pos] = 0
        errors.append(pos.size / k - 1)
    return np.array(errors)


def test_count_curve_reaches_and_holds_the_band_on_drifting_gradients():
    err = _simulate(CountCurveThreshold())
    reach = int(np.nonzero(np.abs(err) <= 0.10)[0][0])
    assert reach <= 30
    assert np.median(np.abs(err[30:])) <= 0.05
    assert np.max(np.abs(err[1:])) <= 0.01               # exactly k whenever the window holds the solution


def test_reference_rule_is_slow_and_settles_off_target():
    err = _simulate(ReferenceThreshold(), steps=60)
    assert np.all(np.abs(err[:30]) > 0.10)               # what we beat: the band is not reached in 30 steps


def test_count_curve_recovers_from_a_jump_of_scale():
    c = CountCurveThreshold()
    k, numel = 1000, 100_000
    rng = np.random.default_rng(1)
    c.threshold = 1.0
    residual = np.zeros(numel, np.float32)
    errs = []
    for t in range(40):
        scale = 1.0 if t < 20 else 1000.0                # three decades in one step
        residual += (rng.laplace(size=numel) * scale).astype(np.float32)
        floor, _ = c.window()
        pos, mags = threshold_scan(np, residual, floor)
        bins = c.bins(np, mags, floor)
        hist = c.histogram(np, bins)
        j, take = c.choose(k, hist[None, :])
        pos = take_above(np, pos, mags, bins, j, take[0])
        c.update(k, pos.size, hist, j)
        residual[pos] = 0
        errs.append(pos.size / k - 1)
    assert all(abs(e) <= 0.1 for e in errs[28:])          # back in the band within 8 steps
    assert c.half <= 2 * c.base_half


def test_choose_splits_the_boundary_bin_exactly_and_deterministically():
    c = CountCurveThreshold(resolution=4, width=0.5)
    table = np.zeros((3, c.record_len), np.int64)
    table[:, :c.points] = [[5, 4, 3, 2, 1], [1, 1, 1, 1, 10], [0, 7, 0, 0, 0]]
    j, take = c.choose(16, table)
    above = table[:, j + 1:c.points].sum(axis=1)
    assert int(above.sum()) + sum(take) == 16
    assert all(0 <= t <= table[r, j] for r, t in enumerate(take))
    assert c.choose(16, table) == (j, take)
    assert c.choose(1000, table) == (0, [5, 1, 0])      # fewer candidates than k: all of them
    assert c.choose(0, table)[1] == [0, 0, 0]


def _choose_reference(points: int, k: int, table: np.ndarray) -> tuple[int, list[int]]:
    """choose()'s rule written with numpy's cumulative sum and search (its earlier form)."""
    h = np.asarray(table, dtype=np.int64)[:, :points]
    per_bin = h.sum(axis=0)
    top = np.cumsum(per_bin[::-1])
    if top[-1] <= k:
        return 0, h[:, 0].tolist()
    i = int(np.searchsorted(top, k))
    j = points - 1 - i
    need = k - (int(top[i - 1]) if i else 0)
    col, total = h[:, j].tolist(), int(per_bin[j])
    share = [c * need // total for c in col]
    rem = [c * need % total for c in col]
    for r in sorted(range(len(col)), key=lambda r: (-rem[r], r))[:need - sum(share)]:
        share[r] += 1
    return j, share


@settings(max_examples=200, deadline=None, database=None)
@given(ranks=st.integers(1, 5), data=st.data())
def test_choose_is_the_reference_rule(ranks, data):
    """The boundary bin and each rank's take equal the numpy formulation's on random tables."""
    c = CountCurveThreshold(resolution=4, width=1.0)
    counts = data.draw(st.lists(st.lists(st.integers(0, 50), min_size=c.points, max_size=c.points),
                                min_size=ranks, max_size=ranks))
    table = np.zeros((ranks, c.record_len), np.int64)
    table[:, :c.points] = counts
    total = int(table.sum())
    k = data.draw(st.integers(1 if total else 0, total + 3))
    assert c.choose(k, table) == _choose_reference(c.points, k, table)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fine_buckets_take_the_formats_bits(dtype):
    """The take's fine buckets of a bin start at the bits of its lower edge in the array's format
    and span its upper edge's (the format's largest value for the top bin) in FINE buckets."""
    from commlib.sparsify.gpu_select import _FINE, _fine_buckets

    bits = np.uint32 if dtype == np.float32 else np.uint64
    for floor in (1e-30, 3.7e-6, 0.5, 11.2, 1e20):
        for resolution, points in ((1, 9), (8, 33), (32, 33), (32, 129)):
            for j in (0, 1, points // 2, points - 2, points - 1):
                top = floor * 2.0 ** ((j + 1) / resolution) if j < points - 1 else math.inf
                edges = np.array([floor * 2.0 ** (j / resolution), min(top, float(np.finfo(dtype).max))],
                                 dtype)
                lo, hi = (int(v) for v in edges.view(bits))
                base, shift = _fine_buckets(np.dtype(dtype), floor, resolution, points, j)
                assert base == lo
                assert (hi - lo) >> shift < _FINE                  # the bin's keys fit the buckets
                assert shift == 0 or (hi - lo) >> (shift - 1) >= _FINE   # and no coarser than that


def test_gpu_launch_codes_are_the_kernels_parameters():
    """The driver launch packs each kernel's arguments by its codes (gpu_select._KERNELS): they
    must be the parameter types of the kernel in the CUDA source, in order (a wrong width would
    shift every later argument; this runs without a GPU)."""
    import re

    from commlib.sparsify.gpu_select import _KERNELS, gpu_source

    code_of = {"long long": "q", "unsigned long long": "Q", "int": "i", "float": "f", "T": "T"}
    source = gpu_source()
    for name, codes in _KERNELS.items():
        found = re.search(r"__global__ void(?: __launch_bounds__\([^)]*\))?\s+" + name + r"\(([^)]*)\)",
                          source)
        assert found, name
        params = [" ".join(p.replace("__restrict__", "").split()) for p in found.group(1).split(",")]
        types = [p.rsplit(" ", 1)[0].removeprefix("const ") for p in params]
        assert "".join("P" if t.endswith("*") else code_of[t] for t in types) == codes, (name, types)


def test_initial_estimate_from_samples():
    rng = np.random.default_rng(0)
    parts = [rng.laplace(scale=s, size=50_000).astype(np.float32) for s in (1.0, 2.0, 0.5, 4.0)]
    table = np.stack([sample_tail(np, p, 0.01) for p in parts])
    t = solve_initial(table, 0.01, 2000)
    count = sum(int((np.abs(p) >= t).sum()) for p in parts)
    assert 1600 <= count <= 2500
    assert solve_initial(np.stack([sample_tail(np, np.zeros(100, np.float32), 0.01)]), 0.01, 1) > 0


def test_quantize_is_idempotent_and_positive():
    for t in (1e-30, 1e-3, 0.7, 3.0, 1e12):
        q = quantize(t)
        assert quantize(q) == q and abs(math.log2(q / t)) <= 1 / 8192
    assert quantize(0.0) > 0 and quantize(float("nan")) > 0


# ---------------------------------------------------------------------- kernels and dtypes
def test_threshold_scan_chunked_equals_whole():
    x = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
    pos, mags = threshold_scan(np, x, 2.5, chunk=1000)
    ref = np.flatnonzero(np.abs(x) >= np.float32(2.5))
    np.testing.assert_array_equal(pos, ref)
    np.testing.assert_array_equal(mags, np.abs(x[ref]))
    assert threshold_scan(np, x, 1e9)[0].size == 0


@pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
# (1 << 23: two rounds of every block of an H200's grid)
@pytest.mark.parametrize("n", [0, 1, 127, 128 * 5 + 3, 1 << 20, 1 << 23])
@pytest.mark.parametrize("floor", [0.0, 2.5])      # 0: every element, past the first capacity
def test_gpu_scan_equals_the_host_scan(n, dtype, floor):
    """The one-pass GPU kernel finds the host's candidates, magnitudes and histogram (in its own
    order), and keeps exactly those of bins >= store_from."""
    import cupy

    x = np.random.default_rng([n, 3]).standard_normal(n).astype(dtype) * 2
    d = cupy.asarray(x)
    pos, mags = threshold_scan(cupy, d, floor)
    hp, hm = threshold_scan(np, x, floor)
    _assert_same_candidates(pos, mags, hp, hm, x.dtype)
    host = scan_binned(np, x, floor or 1e-3, 8, 33, 41)
    for store_from in (0, 9, 32):
        got = scan_binned(cupy, d, floor or 1e-3, 8, 33, 41, store_from)
        assert got.bins is None and got.stored_from == store_from
        np.testing.assert_array_equal(got.hist, host.hist)
        kept = host.bins >= store_from
        _assert_same_candidates(got.pos, got.mags, host.pos[kept], host.mags[kept], x.dtype)


@pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("dtype, offset", [("float32", 1), ("float32", 2), ("float32", 3), ("float64", 1)])
def test_gpu_scan_of_an_unaligned_view_equals_the_host_scan(dtype, offset):
    """A partition's view at an odd offset (not 16-byte aligned, nor its tail a whole round)
    gives the host's candidates and histogram, and its take the host's selection."""
    import cupy

    x = np.random.default_rng([offset, 4]).standard_normal((1 << 21) + 7).astype(dtype) * 2
    d = cupy.asarray(x)[offset:]
    assert d.data.ptr % 16
    host = scan_binned(np, x[offset:], 0.5, 8, 33, 33)
    got = scan_binned(cupy, d, 0.5, 8, 33, 33, 9)
    np.testing.assert_array_equal(got.hist, host.hist)
    kept = host.bins >= 9
    _assert_same_candidates(got.pos, got.mags, host.pos[kept], host.mags[kept], x.dtype)
    take = int(host.hist[12]) // 3
    np.testing.assert_array_equal(np.sort(cupy.asnumpy(take_scan(cupy, got, 12, take))),
                                  np.sort(take_scan(np, host, 12, take)))


def _assert_same_candidates(pos, mags, want_pos, want_mags, dtype):
    """The GPU's candidates (in its own order) are the host's."""
    import cupy

    pos, mags = cupy.asnumpy(pos), cupy.asnumpy(mags)
    order = np.argsort(pos)
    np.testing.assert_array_equal(pos[order], want_pos)
    np.testing.assert_array_equal(mags[order], want_mags)
    assert mags.dtype == dtype


@pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [0, 5, 128 * 5 + 3, 1 << 20])
def test_gpu_take_keeps_the_host_selection(n, dtype):
    """take_scan on the GPU (one block: radix select of the boundary bin) keeps the host's
    positions: every candidate above the boundary bin and the ``take`` largest in it, for a
    boundary at the bottom, middle and top of the grid, ``take`` of none, some and all, and a
    boundary below the bins the scan kept (a second scan)."""
    import cupy

    x = np.random.default_rng([n, 5]).standard_normal(n).astype(dtype) * 2
    d = cupy.asarray(x)
    host = scan_binned(np, x, 0.5, 8, 33, 33)
    for store_from in (0, 12):
        scan = scan_binned(cupy, d, 0.5, 8, 33, 33, store_from)
        for j in (0, 9, 12, 20, 32):
            n_at = int(host.hist[j])
            for take in sorted({0, 1, n_at // 3, n_at - 1, n_at} & set(range(n_at + 1))):
                got = cupy.asnumpy(take_scan(cupy, scan, j, take))
                want = take_scan(np, host, j, take)
                assert got.size == want.size == int(host.hist[j + 1:].sum()) + take
                np.testing.assert_array_equal(np.sort(got), np.sort(want))


@pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
def test_gpu_takes_on_two_streams_keep_their_own_counters():
    """The kernels' counters live in a scratch of the stream's (zeroed once, left zeroed by each
    kernel): two takes queued at once on two streams, and scans with no take between them, keep
    the host's selection."""
    import cupy

    x = np.random.default_rng(11).standard_normal(1 << 22).astype(np.float32)
    d = cupy.asarray(x)
    host = scan_binned(np, x, 0.5, 8, 33, 33)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    scans = []
    for stream in streams:
        with stream:
            scan_binned(cupy, d, 0.5, 8, 33, 33, 6)          # a scan whose take never comes
            scans.append(scan_binned(cupy, d, 0.5, 8, 33, 33, 6))
    for j in (9, 12):
        take = int(host.hist[j]) // 2
        got = []
        for stream, scan in zip(streams, scans):
            with stream:
                got.append(take_scan(cupy, scan, j, take))
        for stream in streams:
            stream.synchronize()
        want = np.sort(take_scan(np, host, j, take))
        for g in got:
            np.testing.assert_array_equal(np.sort(cupy.asnumpy(g)), want)


@pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
# the cut's members: a few tens (ranked by counting) and thousands (radix-selected)
@pytest.mark.parametrize("n", [5_003, 200_003])
def test_gpu_take_with_ties_at_the_cut(dtype, n):
    """Magnitudes on a coarse lattice: many equal at the cut.  The GPU take keeps exactly
    ``take`` of the boundary bin, every one at least as large as every one it leaves."""
    import cupy

    x = (np.random.default_rng(9).integers(-40, 41, n) * 0.125).astype(dtype)
    host = scan_binned(np, x, 0.5, 4, 17, 17)
    scan = scan_binned(cupy, cupy.asarray(x), 0.5, 4, 17, 17, 3)
    for j in (3, 8, 12):
        at = host.pos[host.bins == j]
        for take in (1, at.size // 2, at.size - 1):
            got = cupy.asnumpy(take_scan(cupy, scan, j, take))
            assert got.size == np.unique(got).size == int(host.hist[j + 1:].sum()) + take
            assert set(host.pos[host.bins > j].tolist()) <= set(got.tolist())
            taken = np.intersect1d(got, at)
            left = np.setdiff1d(at, got)
            assert taken.size == take
            assert np.abs(x[taken]).min() >= np.abs(x[left]).max()


def test_top_k_is_exact():
    x = np.random.default_rng(1).standard_normal(10_000)
    idx = top_k(np, x, 37, np.int32)
    assert idx.dtype == np.int32
    assert set(idx.tolist()) == set(np.argsort(-np.abs(x))[:37].tolist())
    assert top_k(np, x, 0, np.int32).size == 0 and top_k(np, x, 10**6, np.int32).size == 10_000


def test_index_dtype():
    assert index_dtype(1) == np.int32 and index_dtype(2**31 - 1) == np.int32
    assert index_dtype(2**31) == np.int64


def test_bfloat16_round_trip():
    v = np.array([1.0, -2.5, 3.140625, 1e-3, 0.0], np.float32)
    storage = write_as(np, v, "bfloat16")
    assert storage.dtype == np.uint16
    np.testing.assert_array_equal(storage.view(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(read_as(np, storage, "bfloat16", np.dtype(np.float32)),
                                  v.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan"), "x", None, True])
def test_density_out_of_range_raises(density):
    with pytest.raises(ValueError, match="density"):
        check_density(density)
    with pytest.raises(ValueError, match="density"):
        ExDyna(density=density)


@pytest.mark.parametrize("kwargs, error", [
    ({"rebalance": "no"}, TypeError), ({"rebalance": 0}, TypeError), ({"num_blocks": 2.7}, TypeError),
    ({"align": 3.5}, TypeError), ({"num_blocks": 0}, ValueError), ({"balance": 1.0}, ValueError),
    ({"balance": float("inf")}, ValueError), ({"threshold": float("inf")}, ValueError),
    ({"threshold": -1.0}, ValueError), ({"threshold": True}, ValueError)])
def test_exdyna_settings_out_of_range_raise(kwargs, error):
    """ExDyna's settings are refused, not converted: ``rebalance="no"`` turned rebalancing on,
    ``num_blocks=2.7`` became 2 blocks and ``threshold=inf`` never selected anything."""
    name = next(iter(kwargs))
    with pytest.raises(error, match=name if name != "threshold" else "value|threshold"):
        ExDyna(density=0.05, **kwargs)


def test_selector_config_and_clone():
    s = ExDyna(density=0.05, num_blocks=256, threshold="reference")
    c = s.clone()
    assert type(c) is ExDyna and c.config() == s.config() and c is not s
    assert repr(c) == repr(s)
    with pytest.raises(ValueError):
        ExDyna(threshold="bogus")
