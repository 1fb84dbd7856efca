"""Selection kernels, written once for numpy and cupy (``xp``).

On the host the threshold scan runs in cache-sized chunks (abs, compare and
``flatnonzero`` on 64 Ki elements at a time), which is about 1.4x faster
than whole-array passes and needs no partition-sized scratch buffer.

On the GPU (float32 and float64) the scan is one kernel that reads the
partition once: for histogram threshold rules it bins each candidate on the
rule's log2 grid (each warp stages its candidates in shared memory so that all
its lanes bin them) and counts the bins in shared memory, and it keeps
(compacts) only the candidates of the bins near the predicted boundary
(``store_from``), each block with one global atomic add per round of 4096
elements (``block_reserve`` in the source; :func:`scan_binned`).  The only host
synchronisation is one small copy (the count and the histogram), which the
exchange needs anyway.  The take (:func:`take_scan`) is then one kernel over
the kept candidates, sized by the histogram: everything above the boundary bin,
and the boundary bin's largest by fine buckets and a radix select in its last
block, no sort and no read-back.  The candidates come in no particular order
(the exchange needs none).  Other dtypes take whole-array cupy operations.
:func:`queue_scan` and :func:`queue_take` are the two kernels alone.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, NamedTuple

import numpy as np

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
        if seg.dtype.char in _GPU_TYPES:
            pos, mag, _, _ = _gpu_scan(xp, seg, floor, 0.0, 0, 0)
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
    falls below them); ``work``: on the GPU, the take's device counters (zeroed by the scan,
    and again by each take).
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
    if xp is not np and seg.dtype.char in _GPU_TYPES:
        store_from = min(max(int(store_from), 0), max(points - 1, 0))
        pos, mags, hist, work = _gpu_scan(xp, seg, floor, resolution, points, length, store_from)
        return Scan(pos, mags, None, hist, seg, floor, resolution, points, store_from, work)
    pos, mags = threshold_scan(xp, seg, floor)
    bins = log2_bins(xp, mags, floor, resolution, points)
    return Scan(pos, mags, bins, bin_counts(xp, bins, length), seg, floor, resolution, points, 0)


def take_scan(xp: Any, scan: Scan, j: int, take: int) -> Any:
    """Positions (relative to the scanned ``seg``) of the candidates of ``scan`` in bins above
    ``j`` plus the ``take`` largest of bin ``j`` (:func:`take_above`'s rule).

    On the GPU one kernel does it from the kept candidates, sized by the
    histogram, no read-back (bins recomputed; bin ``j``'s candidates staged and
    counted in fine buckets of their magnitudes, and the last block to finish
    radix-selects the crossing bucket's); when ``j`` lies below the bins the
    scan kept, the partition is scanned again from bin ``j`` first.  The result
    comes in no particular order there (equal magnitudes at the cut: any of them).

    Example:
        >>> s = scan_binned(np, np.array([1.0, 5.0, 2.0, 3.0]), 1.0, 1, 3, 3)
        >>> take_scan(np, s, 1, 1)
        array([1, 3])
    """
    if scan.bins is None:
        return _gpu_take(xp, scan, int(j), int(take))
    return take_above(xp, scan.pos, scan.mags, scan.bins, j, take)


# ------------------------------------------------------------------ the GPU kernels
#: the GPU kernels' dtypes, by numpy type character (float32, float64): their CUDA type
_GPU_TYPES = {"f": "float", "d": "double"}
#: elements per thread per round of the scan (PER_LANE in the source)
_PER_LANE = 16
#: threads per block of the scan (``block_reserve`` keeps a word per warp: at most 32 warps)
_THREADS = 256
#: threads per block of the take (its last block's radix select runs on one block)
_TAKE_THREADS = 1024
#: the take's fine buckets of the boundary bin (FINE in the source)
_FINE = 2048
#: the take's device counters (``heads`` in the source: 4 and the boundary bin's fine histogram
#: of FINE buckets), allocated and zeroed with the scan's
_TAKE_COUNTERS = 4 + _FINE
_GPU_SOURCE = (f"#define PER_LANE {_PER_LANE}    // elements per thread per round (bits of `want`)\n"
               f"#define WARPS {_THREADS // 32}         // warps per block of the scan\n"
               f"#define TAKE_THREADS {_TAKE_THREADS}  // threads per block of the take\n"
               f"#define FINE {_FINE}          // the take's buckets of the boundary bin\n") + r"""
#define FULL 0xffffffffu

// Each thread of a block has `want` elements to write: reserve room for the whole block's
// with ONE global atomic on `counter` (an atomic per warp on one address serialises at the L2:
// 780 K of them took 0.6 ms on an H200 for 25 M elements) and return this thread's first slot;
// a thread's elements take consecutive slots.  Every thread of the block must call it (it
// synchronises the block); `wsum` holds one word per warp.
__device__ __forceinline__ unsigned long long block_reserve(unsigned int want,
                                                            unsigned long long* counter,
                                                            unsigned int* wsum,
                                                            unsigned long long* base)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    unsigned int incl = want;                  // inclusive prefix sum over the warp's lanes
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        unsigned int y = __shfl_up_sync(FULL, incl, d);
        if (lane >= d) incl += y;
    }
    if (lane == 31) wsum[wid] = incl;          // the warp's total
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int run = 0;
        for (int w = 0; w < nwarps; ++w) { unsigned int c = wsum[w]; wsum[w] = run; run += c; }
        *base = run ? atomicAdd(counter, (unsigned long long)run) : 0ull;
    }
    __syncthreads();
    unsigned long long first = *base + wsum[wid] + (incl - want);
    __syncthreads();                           // wsum and base are reused by the next call
    return first;
}

// This lane's slot among its warp's lanes that `want`, after one atomic add (by the first of
// them) on a counter; every lane of the warp must call it.
__device__ __forceinline__ unsigned int warp_append(bool want, unsigned int* counter)
{
    const unsigned int mask = __ballot_sync(FULL, want);
    if (!mask) return 0u;
    const int lane = threadIdx.x & 31, leader = __ffs(mask) - 1;
    unsigned int base = 0u;
    if (lane == leader) base = atomicAdd(counter, (unsigned int)__popc(mask));
    base = __shfl_sync(FULL, base, leader);
    return base + __popc(mask & ((1u << lane) - 1u));
}

// The grid bin of magnitude a: floor(log2(a / floor) * resolution) clipped to [0, points)
// (float32 arithmetic, as the host's log2_bins; the scan and the take compute it alike).
__device__ __forceinline__ int grid_bin(float a, float floor_f, float resolution, int points)
{
    float q = floorf(log2f(a / floor_f) * resolution);
    return q < 0.0f ? 0 : (q > (float)(points - 1) ? points - 1 : (int)q);
}

// A magnitude's bits as an unsigned key: non-negative floats order as their keys.
template<typename T> struct Key;
template<> struct Key<float> {
    typedef unsigned int U;
    __device__ static U of(float v) { return __float_as_uint(v); }
};
template<> struct Key<double> {
    typedef unsigned long long U;
    __device__ static U of(double v) { return (U)__double_as_longlong(v); }
};

template<typename T>
__global__ void scan_select(const T* __restrict__ x, long long n, T floor_v, float floor_f,
                            float resolution, int points, int store_from, long long cap,
                            long long* __restrict__ pos, T* __restrict__ mag,
                            unsigned long long* __restrict__ head)
{
    // head[0]: candidates kept (bins >= store_from); head[1 + j]: candidates in bin j (points > 0)
    extern __shared__ unsigned int hist[];     // points counters, then one per warp
    __shared__ unsigned long long base;
    // each warp's candidates of a round, staged so that all its lanes bin them (a candidate is
    // a few in a hundred elements: binned where found, a warp would run with one lane in 32)
    __shared__ T st_val[WARPS][32 * PER_LANE];
    __shared__ unsigned short st_off[WARPS][32 * PER_LANE];
    unsigned int* wsum = hist + points;
    for (int j = threadIdx.x; j < points; j += blockDim.x) hist[j] = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const unsigned int below = (1u << lane) - 1u;
    T* sv = st_val[wid];
    unsigned short* so = st_off[wid];
    // a round: each warp takes PER_LANE x 32 consecutive elements (as many coalesced loads in
    // flight, and one block_reserve per 4096 elements); the block's rounds are uniform, so every
    // thread reaches block_reserve's barriers
    const long long tile = (long long)blockDim.x * PER_LANE, stride = (long long)gridDim.x * tile;
    const long long mine0 = (long long)wid * (32 * PER_LANE) + lane;   // this lane's first in a tile
    // the next round's elements are loaded before this round's are processed (the loads stay in
    // flight through the staging and the block's barriers: without it the scan ran at a quarter
    // of the memory's bandwidth)
    T nx[PER_LANE];
    {
        const long long first = (long long)blockIdx.x * tile;
        const bool full = first + tile <= n;   // (a tile inside the array: no bounds per element)
        #pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            const long long i = first + mine0 + k * 32;
            nx[k] = full || i < n ? x[i] : T(0);
        }
    }
    for (long long start = (long long)blockIdx.x * tile; start < n; start += stride) {
        const long long w0 = start + (long long)wid * (32 * PER_LANE);
        const bool full = start + tile <= n;
        T a[PER_LANE];
        #pragma unroll
        for (int k = 0; k < PER_LANE; ++k) a[k] = nx[k];
        if (start + stride < n) {
            const bool next_full = start + stride + tile <= n;
            #pragma unroll
            for (int k = 0; k < PER_LANE; ++k) {
                const long long i = start + stride + mine0 + k * 32;
                nx[k] = next_full || i < n ? x[i] : T(0);
            }
        }
        unsigned int want = 0;
        #pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            a[k] = a[k] < T(0) ? -a[k] : a[k];
            if ((full || w0 + k * 32 + lane < n) && a[k] >= floor_v) want |= 1u << k;
        }
        // stage the warp's candidates: this lane's from its offset among the warp's
        const unsigned int mine = __popc(want);
        unsigned int incl = mine;
        #pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            unsigned int y = __shfl_up_sync(FULL, incl, d);
            if (lane >= d) incl += y;
        }
        const unsigned int total = __shfl_sync(FULL, incl, 31);
        unsigned int at = incl - mine;
        #pragma unroll
        for (int k = 0; k < PER_LANE; ++k)
            if ((want >> k) & 1u) { sv[at] = a[k]; so[at] = (unsigned short)(k * 32 + lane); ++at; }
        __syncwarp();
        // bin them with every lane, and compact the kept ones (bins >= store_from) in place
        unsigned int kept = 0;
        for (unsigned int s0 = 0; s0 < total; s0 += 32) {
            const unsigned int s = s0 + lane;
            bool keep = false;
            T v = T(0);
            unsigned short o = 0;
            if (s < total) {
                v = sv[s];
                o = so[s];
                keep = true;
                if (points > 0) {
                    int b = grid_bin((float)v, floor_f, resolution, points);
                    atomicAdd(&hist[b], 1u);
                    keep = b >= store_from;
                }
            }
            __syncwarp();                      // every lane has read before any writes
            const unsigned int m = __ballot_sync(FULL, keep);
            if (keep) { unsigned int d = kept + __popc(m & below); sv[d] = v; so[d] = o; }
            kept += __popc(m);
            __syncwarp();
        }
        if (!__syncthreads_or(kept != 0u)) continue;     // nothing kept in the block's tile
        unsigned long long first = block_reserve(lane == 0 ? kept : 0u, head, wsum, &base);
        first = __shfl_sync(FULL, first, 0);   // the warp's first slot
        for (unsigned int s = lane; s < kept; s += 32) {
            if (first + s < (unsigned long long)cap) {
                pos[first + s] = w0 + so[s];
                mag[first + s] = sv[s];
            }
        }
        __syncwarp();                          // the stage is refilled next round
    }
    __syncthreads();
    for (int j = threadIdx.x; j < points; j += blockDim.x)
        if (hist[j]) atomicAdd(&head[1 + j], (unsigned long long)hist[j]);
}

// The need-th largest offset (key - lo, lo at most the smallest) among the members of a set of
// N keys, by a radix select, 8 bits a round from the span's top bits down (a last round may
// overlap the one before: the digits of the offsets that match the prefix agree with it there).
// Returns it, and in `ties` how many of the members equal to it are taken.  The whole block
// calls it (it synchronises the block).
template<typename U, typename KeyAt, typename Member>
__device__ unsigned long long radix_select(long long N, KeyAt key_at, Member member,
                                           unsigned long long lo, unsigned long long span,
                                           long long need, unsigned int* digits,
                                           unsigned int* s_digit, long long* s_need, long long* ties)
{
    const int bits = span ? 64 - __clzll((long long)span) : 0;
    unsigned long long prefix = 0ull, mask = 0ull;   // high digits of the need-th largest offset
    for (int r = 0; r < (bits + 7) / 8; ++r) {
        const int shift = max(bits - 8 * (r + 1), 0);
        for (int d = threadIdx.x; d < 256; d += blockDim.x) digits[d] = 0u;
        if (threadIdx.x == 0) { *s_digit = 0u; *s_need = 0; }
        __syncthreads();
        for (long long i = threadIdx.x; i < N; i += blockDim.x) {
            const U key = key_at(i);
            if (!member(key)) continue;
            const unsigned long long off = (unsigned long long)key - lo;
            if ((off & mask) == prefix) atomicAdd(&digits[(unsigned int)(off >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) {                // warp 0: the digit holding the need-th from the top
            const int ln = threadIdx.x;
            unsigned int c[8], sum = 0u;
            #pragma unroll
            for (int e = 0; e < 8; ++e) { c[e] = digits[255 - 8 * ln - e]; sum += c[e]; }
            unsigned int inc = sum;            // this lane's digits and every higher lane's
            #pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                unsigned int y = __shfl_up_sync(FULL, inc, d);
                if (ln >= d) inc += y;
            }
            long long run = (long long)(inc - sum);
            if (run < need && need <= (long long)inc) {
                for (int e = 0; e < 8; ++e) {
                    if (run + c[e] >= need) { *s_digit = 255u - 8u * ln - e; *s_need = need - run; break; }
                    run += c[e];
                }
            }
        }
        __syncthreads();
        prefix |= (unsigned long long)*s_digit << shift;
        mask |= 255ull << shift;
        need = *s_need;
        __syncthreads();                       // digits, s_digit and s_need are reset next round
    }
    *ties = need;
    return prefix;
}

// The take, over the m kept candidates (all of bin j and above among them).  Every block writes
// the positions of those above bin j to out[0, n_above) (and bin j's too when all of it is
// taken), and, when only `take` of bin j's n_at are, stages bin j's (position, key) and counts
// them in FINE buckets of the key (monotonic: (key - fine_base) >> fine_shift, clipped; the
// host spreads the bin's key range over them).  The last block to finish finds the bucket
// where the count from the top reaches `take`, writes the stage's members of the buckets above
// it, and the exact largest of that bucket's members (a few in a thousand of the stage, kept in
// shared memory) by a radix select, to out[n_above, n_above + take).
// heads: [0] above written, [1] staged, [2] blocks done, [3] unused, [4, 4 + FINE) the fine
// histogram; zero at the start (the scan's), and the last block zeroes them again.
#define LIST_CAP 2048
template<typename T>
__global__ void __launch_bounds__(TAKE_THREADS)
take_boundary(const long long* __restrict__ pos, const T* __restrict__ mag, long long m,
              float floor_f, float resolution, int points, int j, long long take, long long n_at,
              long long n_above, unsigned long long fine_base, int fine_shift,
              long long* __restrict__ out, long long* __restrict__ at_buf,
              unsigned long long* __restrict__ heads)
{
    typedef typename Key<T>::U U;
    long long* const at_pos = at_buf;          // the stage: n_at positions, then n_at keys
    U* const at_key = reinterpret_cast<U*>(at_buf + n_at);
    __shared__ unsigned int fine[FINE];
    __shared__ U s_lkey[LIST_CAP];             // the last block: the crossing bucket's members
    __shared__ unsigned int s_lidx[LIST_CAP];
    __shared__ unsigned int wsum[32], digits[256];
    __shared__ unsigned long long base, s_lo_inv, s_hi;
    __shared__ unsigned int s_last, s_digit, s_kept, s_listed, s_kept2, s_ties;
    __shared__ long long s_need;
    const bool all_at = take >= n_at, select = take > 0 && !all_at;
    const long long up_cap = n_above + (all_at ? n_at : 0);
    auto bucket = [&](U key) -> unsigned int {
        const unsigned long long d = (unsigned long long)key < fine_base
            ? 0ull : ((unsigned long long)key - fine_base) >> fine_shift;
        return d > FINE - 1 ? FINE - 1 : (unsigned int)d;
    };
    for (int d = threadIdx.x; d < FINE; d += blockDim.x) fine[d] = 0u;
    if (threadIdx.x == 0) {
        s_lo_inv = 0ull; s_hi = 0ull; s_kept = 0u; s_listed = 0u; s_kept2 = 0u; s_ties = 0u;
    }
    __syncthreads();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long start = (long long)blockIdx.x * blockDim.x; start < m; start += stride) {
        const long long i = start + threadIdx.x;
        bool up = false, at = false;
        U key = 0;
        if (i < m) {
            const T a = mag[i];
            const int b = grid_bin((float)a, floor_f, resolution, points);
            up = b > j || (b == j && all_at);
            at = b == j && select;
            key = Key<T>::of(a);
        }
        if (!__syncthreads_or(up || at)) continue;
        const unsigned long long s_up = block_reserve(up, &heads[0], wsum, &base);
        const unsigned long long s_at = block_reserve(at, &heads[1], wsum, &base);
        if (up && s_up < (unsigned long long)up_cap) out[s_up] = pos[i];
        if (at && s_at < (unsigned long long)n_at) {
            at_pos[s_at] = pos[i];
            at_key[s_at] = key;
            atomicAdd(&fine[bucket(key)], 1u);
        }
    }
    __syncthreads();
    if (select)
        for (int d = threadIdx.x; d < FINE; d += blockDim.x)
            if (fine[d]) atomicAdd(&heads[4 + d], (unsigned long long)fine[d]);
    __threadfence();                           // this block's writes, before it counts as done
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&heads[2], 1ull) == (unsigned long long)(gridDim.x - 1);
    __syncthreads();
    if (!s_last) return;
    if (!select) {                             // the last block leaves the counters zeroed for the
        if (threadIdx.x < 3) heads[threadIdx.x] = 0ull;        // next take on this scan
        return;
    }
    __threadfence();
    // the last block: every block's stage and counts are written
    const long long staged = min((long long)*(volatile unsigned long long*)&heads[1], n_at);
    for (int d = threadIdx.x; d < FINE; d += blockDim.x)
        fine[d] = (unsigned int)*(volatile unsigned long long*)&heads[4 + d];
    if (threadIdx.x == 0) { s_digit = 0u; s_need = 0; }
    __syncthreads();
    if (threadIdx.x < 32) {                    // warp 0: the bucket holding the take-th from the top
        const int ln = threadIdx.x, per = FINE / 32;
        unsigned int sum = 0u;
        for (int e = 0; e < per; ++e) sum += fine[FINE - 1 - per * ln - e];
        unsigned int inc = sum;
        #pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            unsigned int y = __shfl_up_sync(FULL, inc, d);
            if (ln >= d) inc += y;
        }
        long long run = (long long)(inc - sum);
        if (run < take && take <= (long long)inc) {
            for (int e = 0; e < per; ++e) {
                const unsigned int c = fine[FINE - 1 - per * ln - e];
                if (run + c >= take) { s_digit = FINE - 1 - per * ln - e; s_need = take - run; break; }
                run += c;
            }
        }
    }
    __syncthreads();
    const unsigned int cut = s_digit;          // the crossing bucket
    const long long need = s_need;             // how many of its members are taken
    const bool whole = need >= (long long)fine[cut];
    // one pass over the stage (4 keys a thread in flight): the buckets above the cut go out; the
    // cut's members are listed
    for (long long s0 = 0; s0 < staged; s0 += 4 * (long long)blockDim.x) {
        U k4[4];
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const long long s = s0 + e * (long long)blockDim.x + threadIdx.x;
            k4[e] = s < staged ? __ldcg(&at_key[s]) : U(0);
        }
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const long long s = s0 + e * (long long)blockDim.x + threadIdx.x;
            bool keep = false, member = false;
            if (s < staged) {
                const unsigned int d = bucket(k4[e]);
                keep = d > cut || (d == cut && whole);
                member = d == cut && !whole;
            }
            const unsigned int slot = warp_append(keep, &s_kept);
            const unsigned int lslot = warp_append(member, &s_listed);
            if (keep && (long long)slot < take) out[n_above + slot] = __ldcg(&at_pos[s]);
            if (member) {
                if (lslot < LIST_CAP) { s_lkey[lslot] = k4[e]; s_lidx[lslot] = (unsigned int)s; }
                atomicMax(&s_hi, (unsigned long long)k4[e]);
                atomicMax(&s_lo_inv, ~(unsigned long long)k4[e]);
            }
        }
    }
    __syncthreads();
    if (!whole) {
        // the need largest of the cut's members: from the list (or the stage, when they overflow it)
        const bool listed = s_listed <= LIST_CAP;
        const long long N = listed ? (long long)s_listed : staged;
        auto key_at = [&](long long i) -> U { return listed ? s_lkey[i] : __ldcg(&at_key[i]); };
        auto is_member = [&](U key) -> bool { return listed || bucket(key) == cut; };
        const unsigned long long lo = ~s_lo_inv;
        long long ties = 0;
        const unsigned long long kth = radix_select<U>(N, key_at, is_member, lo, s_hi - lo, need,
                                                       digits, &s_digit, &s_need, &ties);
        const long long first = n_above + take - need, larger = need - ties;
        for (long long i0 = 0; i0 < N; i0 += blockDim.x) {
            const long long i = i0 + threadIdx.x;
            bool keep = false, tie = false;
            if (i < N) {
                const U key = key_at(i);
                if (is_member(key)) {
                    const unsigned long long off = (unsigned long long)key - lo;
                    keep = off > kth;
                    tie = off == kth;
                }
            }
            const unsigned int slot = warp_append(keep, &s_kept2);
            const unsigned int tslot = warp_append(tie, &s_ties);
            const long long at = listed ? (long long)s_lidx[i < N ? i : 0] : i;
            if (keep && (long long)slot < larger) out[first + slot] = __ldcg(&at_pos[at]);
            if (tie && (long long)tslot < ties) out[first + larger + tslot] = __ldcg(&at_pos[at]);
        }
    }
    __syncthreads();                           // every thread has read the counters
    if (threadIdx.x < 3) heads[threadIdx.x] = 0ull;
    for (int d = threadIdx.x; d < FINE; d += blockDim.x) heads[4 + d] = 0ull;
}
"""
#: by device: the compiled module and the device's multiprocessor count
_GPU_MODULES: dict[int, tuple[Any, int]] = {}
#: by (device, kernel, dtype): the kernel and the device's multiprocessor count
_GPU_KERNELS: dict[tuple[int, str, str], tuple[Any, int]] = {}
#: capacity of the candidate buffers, by partition size (grown when a scan keeps more)
_GPU_CAPACITY: dict[int, int] = {}
#: each thread's page-locked buffer for the scan's counts (:func:`_pinned_counts`)
_PINNED = threading.local()
#: shared memory a block may take without opting in (the scan's stage and histogram)
_SHARED_LIMIT = 48 << 10


def _gpu_kernel(xp: Any, name: str, dtype: str) -> tuple[Any, int]:
    """Kernel ``name`` (``scan_select``, ``take_boundary``) for ``dtype`` (a type character of
    :data:`_GPU_TYPES`) on the current device, and
    the device's multiprocessor count (compiled once per device, looked up once per kernel)."""
    dev = xp.cuda.runtime.getDevice()
    entry = _GPU_KERNELS.get((dev, name, dtype))
    if entry is None:
        module = _GPU_MODULES.get(dev)
        if module is None:
            names = [f"{k}<{t}>" for k in ("scan_select", "take_boundary") for t in _GPU_TYPES.values()]
            mod = xp.RawModule(code=_GPU_SOURCE, options=("-std=c++14",), name_expressions=names)
            sms = int(xp.cuda.Device(dev).attributes["MultiProcessorCount"])
            module = _GPU_MODULES[dev] = (mod, sms)
        entry = (module[0].get_function(f"{name}<{_GPU_TYPES[dtype]}>"), module[1])
        _GPU_KERNELS[(dev, name, dtype)] = entry
    return entry


def _grid(sms: int, n: int, per_block: int) -> tuple[int]:
    """Blocks for ``n`` elements, ``per_block`` a block each round: at most 8 per multiprocessor."""
    return (max(1, min(sms * 8, -(-n // per_block))),)


def _on_device(xp: Any, a: Any) -> Any:
    """A context on the device of cupy array ``a``: none to enter when it is the current one."""
    dev = a.data.device_id
    return contextlib.nullcontext() if dev == xp.cuda.runtime.getDevice() else xp.cuda.Device(dev)


def _pinned_counts(length: int) -> np.ndarray:
    """This thread's page-locked host buffer for a scan's counts (the copy is then one DMA)."""
    buf = getattr(_PINNED, "counts", None)
    if buf is None or buf.size < length:
        import cupyx

        buf = _PINNED.counts = cupyx.empty_pinned(max(length, 512), np.uint64)
    return buf[:length]


def queue_scan(xp: Any, seg: Any, floor: float, resolution: float, points: int, store_from: int,
               cap: int) -> tuple[Any, Any, Any]:
    """Queue the GPU scan kernel on the current stream (nothing waits) over contiguous ``seg``:
    room for ``cap`` candidates in ``(positions, magnitudes)``, and ``head``: [0] the candidates
    of bins ``>= store_from`` (all of them were kept if it is ``<= cap``), [1 + j] those of bin
    ``j``, then the take's counters (zero).  :func:`scan_binned` is the whole scan; this is its
    kernel alone, for benchmarks and profiles.

    Example:
        >>> pos, mag, head = queue_scan(cupy, seg, 0.5, 32, 33, 16, 1 << 16)
    """
    kernel, sms = _gpu_kernel(xp, "scan_select", seg.dtype.char)
    n = int(seg.size)
    pos = xp.empty(cap, xp.int64)
    mag = xp.empty(cap, seg.dtype)
    head = xp.zeros(1 + points + _TAKE_COUNTERS, xp.uint64)
    kernel(_grid(sms, n, _THREADS * _PER_LANE), (_THREADS,),
           (seg, np.int64(n), seg.dtype.type(floor), np.float32(floor), np.float32(resolution),
            np.int32(points), np.int32(store_from), np.int64(cap), pos, mag, head),
           shared_mem=4 * (points + _THREADS // 32))
    return pos, mag, head


def queue_take(xp: Any, pos: Any, mags: Any, floor: float, resolution: float, points: int, j: int,
               take: int, n_at: int, n_above: int, work: Any) -> Any:
    """Queue the GPU take kernel on the current stream (nothing waits): of the candidates
    ``(pos, mags)`` (all of bin ``j`` and above among them), the positions of the ``n_above``
    above bin ``j`` and the ``take`` largest of bin ``j``'s ``n_at``, in a new array.  ``work``:
    the take's zeroed counters (:func:`queue_scan`'s ``head`` past the histogram; the kernel
    leaves them zeroed).  :func:`take_scan` is the whole take; this is its kernel alone.

    Example:
        >>> out = queue_take(cupy, pos, mag, 0.5, 32, 33, 17, 90, 300, 24_910, head[34:])
    """
    out = xp.empty(n_above + take, xp.int64)
    if n_above + take == 0:
        return out
    kernel, sms = _gpu_kernel(xp, "take_boundary", mags.dtype.char)
    stage = xp.empty(2 * n_at if 0 < take < n_at else 1, xp.int64)   # positions, then keys
    m = int(pos.size)
    base, shift = _fine_buckets(mags.dtype, floor, resolution, points, j)
    kernel(_grid(sms, m, _TAKE_THREADS), (_TAKE_THREADS,),
           (pos, mags, np.int64(m), np.float32(floor), np.float32(resolution), np.int32(points),
            np.int32(j), np.int64(take), np.int64(n_at), np.int64(n_above), np.uint64(base),
            np.int32(shift), out, stage, work))
    return out


def _fine_buckets(dtype: np.dtype, floor: float, resolution: float, points: int, j: int) -> tuple[int, int]:
    """The take's fine buckets of grid bin ``j``: ``(key - base) >> shift`` spreads the keys (the
    magnitudes' bits) of the bin's range over ``_FINE`` buckets (the top bin's range reaches the
    format's largest value: coarser)."""
    top = floor * 2.0 ** ((j + 1) / resolution) if j < points - 1 else math.inf
    edges = np.array([floor * 2.0 ** (j / resolution), min(top, float(np.finfo(dtype).max))], dtype)
    lo, hi = (int(v) for v in edges.view(np.uint32 if dtype.itemsize == 4 else np.uint64))
    return lo, max(0, (hi - lo).bit_length() - (_FINE.bit_length() - 1))


def _gpu_scan(xp: Any, seg: Any, floor: float, resolution: float, points: int, length: int,
              store_from: int = 0) -> tuple[Any, Any, Any, Any]:
    """The one-pass GPU scan (see module docs): positions and magnitudes of the candidates of
    bins ``>= store_from``, the host histogram of every candidate, length ``length`` (``None``
    when 0), and the take's zeroed counters (zeroed with the scan's: one fill, not two)."""
    n = int(seg.size)
    seg = xp.ascontiguousarray(seg)
    if 4 * (points + _THREADS // 32) + (seg.itemsize + 2) * _THREADS * _PER_LANE > _SHARED_LIMIT:
        raise ValueError(f"a threshold grid of {points} points does not fit the GPU scan's shared "
                         f"memory ({_SHARED_LIMIT} bytes a block): use a coarser resolution or a "
                         f"narrower max_width")
    counts = _pinned_counts(1 + points + _TAKE_COUNTERS)
    with _on_device(xp, seg):
        cap = _GPU_CAPACITY.get(n, max(1024, n // 256))
        while True:
            pos, mag, head = queue_scan(xp, seg, floor, resolution, points, store_from, cap)
            head.get(out=counts)                    # the one host synchronisation
            found = int(counts[0])
            if found <= cap:
                break
            cap = _GPU_CAPACITY[n] = 2 * found      # more candidates than room: grow and rescan
    hist = None
    if length:
        hist = np.zeros(length, np.int64)
        hist[:points] = counts[1:1 + points]
    return pos[:found], mag[:found], hist, head[1 + points:]


def _gpu_take(xp: Any, scan: Scan, j: int, take: int) -> Any:
    """:func:`take_scan` on the GPU: one kernel over the kept candidates (a second scan first
    when bin ``j`` lies below the kept bins)."""
    hist = scan.hist
    n_at = int(hist[j])
    take = min(max(take, 0), n_at)
    n_above = int(hist[j + 1:scan.points].sum())
    pos, mags = scan.pos, scan.mags
    with _on_device(xp, scan.seg):
        if j < scan.stored_from and n_above + take:     # the boundary fell below the kept bins
            pos, mags, _, _ = _gpu_scan(xp, scan.seg, scan.floor, scan.resolution, scan.points, 0, j)
        return queue_take(xp, pos, mags, scan.floor, scan.resolution, scan.points, j, take, n_at,
                          n_above, scan.work)


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
