"""Selection kernels, written once for numpy and cupy (``xp``).

On the host the threshold scan runs in cache-sized chunks (abs, compare and
``flatnonzero`` on 64 Ki elements at a time), which is about 1.4x faster
than whole-array passes and needs no partition-sized scratch buffer.

On the GPU (float32 and float64 cupy arrays) the scan and the take are CUDA
kernels (:mod:`sparsify.gpu_select`); other dtypes take whole-array cupy
operations.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .gpu_select import GPU_TYPES, gpu_scan, gpu_take

#: elements per host chunk
HOST_CHUNK = 1 << 16


def threshold_scan(xp: Any, seg: Any, floor: float, chunk: int = HOST_CHUNK) -> tuple[Any, Any]:
    """Positions (int64, relative to ``seg``) and magnitudes of the elements with ``|seg| >= floor``.

    Example:
        >>> threshold_scan(np, np.array([0.5, -2.0, 1.0, 3.0]), 1.0)
        (array([1, 2, 3]), array([2., 1., 3.]))
    """
    f = seg.dtype.type(floor)
    if xp is not np:
        if seg.dtype.char in GPU_TYPES:
            pos, mag, _, _ = gpu_scan(xp, seg, floor, 0.0, 0, 0)
            return pos, mag
        mag = xp.abs(seg)
        pos = xp.flatnonzero(mag >= f)
        return pos, mag[pos]
    m = int(seg.size)
    if m <= chunk:
        mag = np.abs(seg)
        pos = np.flatnonzero(mag >= f)
        return pos, mag[pos]
    buf = np.empty(chunk, dtype=seg.dtype)
    mask = np.empty(chunk, dtype=bool)
    positions, mags = [], []
    for s in range(0, m, chunk):
        c = min(chunk, m - s)
        b = np.abs(seg[s:s + c], out=buf[:c])
        mk = np.greater_equal(b, f, out=mask[:c])
        nz = np.flatnonzero(mk)
        if nz.size:
            mags.append(b[nz])
            nz += s
            positions.append(nz)
    if not positions:
        return np.zeros(0, np.int64), np.zeros(0, seg.dtype)
    return np.concatenate(positions), np.concatenate(mags)


def log2_bins(xp: Any, mags: Any, floor: float, resolution: float, points: int) -> Any:
    """Bin of each magnitude on the log2 grid ``floor * 2 ** (j / resolution)``, j in ``[0, points)``
    (float32 arithmetic; the GPU scan computes the same in CUDA).

    Example:
        >>> log2_bins(np, np.array([1.0, 2.0, 3.9, 100.0], np.float32), 1.0, 1, 3)
        array([0, 1, 1, 2])
    """
    if mags.size == 0:
        return xp.zeros(0, dtype=xp.int64)
    pos = xp.log2(mags.astype(xp.float32, copy=False) / xp.float32(floor)) * xp.float32(resolution)
    return xp.clip(xp.floor(pos), 0, points - 1).astype(xp.int64)


def bin_counts(xp: Any, bins: Any, length: int) -> Any:
    """Counts of each bin in ``[0, length)`` (int64).

    Example:
        >>> bin_counts(np, np.array([0, 2, 2]), 4)
        array([1, 0, 2, 0])
    """
    if bins.size == 0:
        return xp.zeros(length, dtype=xp.int64)
    return xp.bincount(bins, minlength=length)[:length].astype(xp.int64, copy=False)


class Scan(NamedTuple):
    """A partition's scan (:func:`scan_binned`): the candidates ``|seg| >= floor`` and their grid.

    ``pos``/``mags``: the candidates kept (positions relative to ``seg``, in no
    particular order on the GPU); ``bins``: each one's grid bin (host; ``None`` on
    the GPU, where the take recomputes it); ``hist``: the histogram of every
    candidate (a host array); ``stored_from``: the lowest bin whose candidates
    were kept (0 on the host; on the GPU the scan keeps the bins near the
    predicted boundary only, and :func:`take_scan` scans again when the boundary
    falls below them); ``work``: on the GPU, the take's device counters (zero: each take
    leaves them zeroed).
    """

    pos: Any
    mags: Any
    bins: Any
    hist: Any
    seg: Any
    floor: float
    resolution: float
    points: int
    stored_from: int
    work: Any = None

    def kept(self, j: int) -> bool:
        """Whether the scan kept the candidates of bin ``j`` (else the take scans again)."""
        return j >= self.stored_from


def scan_binned(xp: Any, seg: Any, floor: float, resolution: float, points: int, length: int,
                store_from: int = 0) -> Scan:
    """:func:`threshold_scan` plus each candidate's :func:`log2_bins` bin and the :func:`bin_counts`
    histogram (length ``length``): one pass over ``seg`` on the GPU.

    ``store_from``: on the GPU (float32, float64), keep only the candidates of bins
    ``>= store_from`` (the histogram still counts all of them): where the boundary
    is expected near the top of the window, this keeps a few times k candidates
    instead of the window's tens of times k.  The host keeps every candidate.

    Example:
        >>> s = scan_binned(np, np.array([1.0, 0.1, 2.0]), 1.0, 1, 3, 4)
        >>> s.pos, s.bins, s.hist
        (array([0, 2]), array([0, 1]), array([1, 1, 0, 0]))
    """
    if xp is not np and seg.dtype.char in GPU_TYPES:
        store_from = min(max(int(store_from), 0), max(points - 1, 0))
        pos, mags, hist, work = gpu_scan(xp, seg, floor, resolution, points, length, store_from)
        return Scan(pos, mags, None, hist, seg, floor, resolution, points, store_from, work)
    pos, mags = threshold_scan(xp, seg, floor)
    bins = log2_bins(xp, mags, floor, resolution, points)
    return Scan(pos, mags, bins, bin_counts(xp, bins, length), seg, floor, resolution, points, 0)


def take_scan(xp: Any, scan: Scan, j: int, take: int) -> Any:
    """Positions (relative to the scanned ``seg``) of the candidates of ``scan`` in bins above
    ``j`` plus the ``take`` largest of bin ``j`` (:func:`take_above`'s rule).

    On the GPU two kernels do it from the kept candidates, sized by the
    histogram, no read-back (bins recomputed; bin ``j``'s candidates staged and
    counted in fine buckets of their magnitudes, the buckets above the crossing
    one written, and the crossing bucket's members ranked); when ``j`` lies below the bins the
    scan kept, the partition is scanned again from bin ``j`` first.  The result
    comes in no particular order there (equal magnitudes at the cut: any of them).

    Example:
        >>> s = scan_binned(np, np.array([1.0, 5.0, 2.0, 3.0]), 1.0, 1, 3, 3)
        >>> take_scan(np, s, 1, 1)
        array([1, 3])
    """
    if scan.bins is None:
        return gpu_take(xp, scan, int(j), int(take))
    return take_above(xp, scan.pos, scan.mags, scan.bins, j, take)


def take_above(xp: Any, pos: Any, mags: Any, bins: Any, j: int, take: int) -> Any:
    """``pos`` of the candidates in bins above ``j`` plus the ``take`` largest of bin ``j``
    (in the candidates' order).

    Example:
        >>> take_above(np, np.arange(4), np.array([1.0, 5.0, 2.0, 3.0]), np.array([0, 2, 1, 1]), 1, 1)
        array([1, 3])
    """
    above = bins > j
    if take > 0:
        at = xp.flatnonzero(bins == j)
        if take < at.size:
            at = at[xp.argpartition(mags[at], at.size - take)[at.size - take:]]
        above[at] = True
    return pos[above]


def top_k(xp: Any, acc: Any, k: int, idx_dtype: Any) -> Any:
    """Indices of the ``k`` largest ``|acc|`` (exact, unordered): ``argpartition``."""
    n = int(acc.size)
    k = min(max(int(k), 0), n)
    if k == 0:
        return xp.zeros(0, dtype=idx_dtype)
    part = xp.argpartition(xp.abs(acc), n - k)
    return part[n - k:].astype(idx_dtype, copy=False)
