"""ExDyna's selection on the GPU: the scan and the take as CUDA kernels (``gpu_select.cu``).

The scan (:func:`gpu_scan`, float32 and float64) is one kernel that reads the
partition once: for histogram threshold rules it bins each candidate on the
rule's log2 grid (the hardware's approximate log2 where no bin edge lies within
its error, the exact rule's arithmetic where one does: ``grid_bin`` in the
source; each warp stages its candidates in shared memory so that all its lanes
bin them) and counts the bins in shared memory, and it keeps (compacts) only
the candidates of the bins near the predicted boundary (``store_from``): each
warp keeps them in shared memory across rounds and a block writes its warps'
out together, with one global atomic add, when one of them is half full and at
the end (``block_reserve`` in the source).  The only host synchronisation is
one small copy (the count and the histogram), which the exchange needs anyway.
The take (:func:`gpu_take`) is then two kernels over the kept candidates, sized
by the histogram: ``take_boundary`` writes everything above the boundary bin
and stages the boundary bin's candidates, counted in fine buckets of their
magnitudes; ``take_cut`` writes the buckets above the crossing one, over many
blocks, and its last block ranks the crossing bucket's few members by counting
(a radix select where there are more than :data:`_RANK_CAP`): no sort and no
read-back.  The candidates come in no particular order (the exchange needs
none).  :func:`queue_scan` and :func:`queue_take` are the kernels alone.  Their
counters need no memset: :func:`_scratch`.  :mod:`sparsify.kernels` holds the
rules (the host's, which these reproduce) and sends float32/float64 device
arrays here.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from commlib.device import current_device

if TYPE_CHECKING:
    from .kernels import Scan

#: the GPU kernels' dtypes, by numpy type character (float32, float64): their CUDA type
GPU_TYPES = {"f": "float", "d": "double"}
#: float32 elements per thread per round of the scan (PER_LANE in the source: 64 bytes a round,
#: so float64's are half as many)
_PER_LANE = 16
#: the scan's staged slots keep the round below this (OFF_BITS in the source: 32 - 9 bits)
_MAX_ROUNDS = 1 << 23
#: threads per block of the scan (``block_reserve`` keeps a word per warp: at most 32 warps)
_THREADS = 256
#: threads per block of the take's kernels (take_cut's last block's select runs on one block)
_TAKE_THREADS = 1024
#: the take's fine buckets of the boundary bin (FINE in the source)
_FINE = 2048
#: the take's crossing bucket ranks at most this many members by counting (RANK_CAP in the
#: source; more are radix-selected)
_RANK_CAP = 256
#: the take's device counters (``heads`` in the source: 8, TAKE_FINE_AT, and the boundary bin's
#: fine histogram of FINE buckets), in the scratch after the scan's (:func:`_scratch`)
_TAKE_COUNTERS = 8 + _FINE
#: by itemsize: the float format and the unsigned integer of its bits (:func:`_key`)
_KEY_FORMATS = {4: (struct.Struct("<f"), struct.Struct("<I")), 8: (struct.Struct("<d"), struct.Struct("<Q"))}
#: by itemsize: the float format's largest finite value
_LARGEST = {4: float(np.finfo(np.float32).max), 8: float(np.finfo(np.float64).max)}
#: the kernels of the CUDA source and their parameters' types (:class:`_Launch`'s codes; ``T``:
#: the kernel's dtype)
_KERNELS = {"scan_select": "PqTffiiqPPPP", "take_boundary": "PPqffiiqqqQiPPP", "take_cut": "PqqqQiPP"}
#: a kernel parameter's ctypes type by code (``P``: a device pointer)
_CTYPES = {"P": ctypes.c_void_p, "q": ctypes.c_int64, "Q": ctypes.c_uint64, "i": ctypes.c_int32,
           "f": ctypes.c_float, "d": ctypes.c_double}
#: the kernels' CUDA source (shipped beside this module)
_CUDA_FILE = Path(__file__).with_name("gpu_select.cu")
#: by device: the compiled module and the device's multiprocessor count
_GPU_MODULES: dict[int, tuple[Any, int]] = {}
#: by (device, kernel, dtype): the kernel's launch and the device's multiprocessor count
_GPU_KERNELS: dict[tuple[int, str, str], tuple[_Launch, int]] = {}
#: capacity of the candidate buffers, by partition size (grown when a scan keeps more)
_GPU_CAPACITY: dict[int, int] = {}
#: each thread's page-locked buffer for the scan's counts (:func:`_pinned_counts`)
_PINNED = threading.local()
#: each thread's device scratch by (device, stream, points) and take stages by (device, stream)
#: (:func:`_scratch`, :func:`_stage`)
_SCRATCH = threading.local()
#: scratches a thread keeps (a thread that cycles through more streams makes new ones)
_SCRATCH_KEPT = 16
#: shared memory a block may take without opting in (the scan's stage and histogram)
_SHARED_LIMIT = 48 << 10


def gpu_source() -> str:
    """The kernels' CUDA source: ``gpu_select.cu`` after the defines of this module's constants.

    Example:
        >>> "scan_select" in gpu_source()
        True
    """
    return (f"#define PER_LANE {_PER_LANE}    // elements per thread per round (bits of `want`)\n"
            f"#define WARPS {_THREADS // 32}         // warps per block of the scan\n"
            f"#define TAKE_THREADS {_TAKE_THREADS}  // threads per block of the take\n"
            f"#define FINE {_FINE}          // the take's buckets of the boundary bin\n"
            f"#define RANK_CAP {_RANK_CAP}      // the cut's members ranked by counting\n"
            + _CUDA_FILE.read_text())


class _Launch:
    """One compiled kernel, launched through the driver (``cuLaunchKernel``) from parameter slots
    made once: a launch sets the slots' values and passes their addresses.  cupy's own launch
    converts each argument anew (the H200 host's cProfile put the scan's launch at 28 us and the
    take's two at 33).  ``codes``: the parameters' types (:data:`_CTYPES`); array arguments are
    given as device addresses (``a.data.ptr``).  The driver copies the values at the launch, so the
    slots serve the next one at once; a lock keeps two threads' values apart."""

    def __init__(self, function_ptr: int, codes: str):
        self._fn = function_ptr
        self._slots = tuple(_CTYPES[c]() for c in codes)
        self._params = (ctypes.c_void_p * len(codes))(*(ctypes.addressof(v) for v in self._slots))
        self._params_at = ctypes.addressof(self._params)
        self._lock = threading.Lock()

    def __call__(self, xp: Any, blocks: int, threads: int, args: tuple, shared_mem: int = 0) -> None:
        """Queue the kernel on the current stream with ``args`` (one per parameter, in order)."""
        stream = xp.cuda.get_current_stream().ptr
        with self._lock:
            for slot, value in zip(self._slots, args, strict=True):
                slot.value = value
            xp.cuda.driver.launchKernel(self._fn, blocks, 1, 1, threads, 1, 1, shared_mem, stream,
                                        self._params_at, 0)


def _gpu_kernel(xp: Any, name: str, dtype: str) -> tuple[_Launch, int]:
    """Kernel ``name`` (one of :data:`_KERNELS`) for ``dtype`` (a type character of
    :data:`GPU_TYPES`) on the current device, and
    the device's multiprocessor count (compiled once per device, looked up once per kernel)."""
    dev = current_device()
    entry = _GPU_KERNELS.get((dev, name, dtype))
    if entry is None:
        module = _GPU_MODULES.get(dev)
        if module is None:
            names = [f"{k}<{t}>" for k in _KERNELS for t in GPU_TYPES.values()]
            mod = xp.RawModule(code=gpu_source(), options=("-std=c++14",), name_expressions=names)
            sms = int(xp.cuda.Device(dev).attributes["MultiProcessorCount"])
            module = _GPU_MODULES[dev] = (mod, sms)
        function = module[0].get_function(f"{name}<{GPU_TYPES[dtype]}>").kernel
        entry = (_Launch(function.ptr, _KERNELS[name].replace("T", dtype)), module[1])
        _GPU_KERNELS[(dev, name, dtype)] = entry
    return entry


def _grid(sms: int, n: int, per_block: int) -> int:
    """Blocks for ``n`` elements, ``per_block`` a block each round: at most 8 per multiprocessor."""
    return max(1, min(sms * 8, -(-n // per_block)))


def _on_device(xp: Any, a: Any) -> Any:
    """A context on the device of cupy array ``a``: none to enter when it is the current one."""
    dev = a.data.device_id
    return contextlib.nullcontext() if dev == current_device() else xp.cuda.Device(dev)


def _pinned_counts(length: int) -> np.ndarray:
    """This thread's page-locked host buffer for a scan's counts (the copy is then one DMA)."""
    buf = getattr(_PINNED, "counts", None)
    if buf is None or buf.size < length:
        import cupyx

        buf = _PINNED.counts = cupyx.empty_pinned(max(length, 512), np.uint64)
    return buf[:length]


def _scratch(xp: Any, points: int) -> tuple[Any, Any, Any]:
    """This thread's device scratch for a scan of ``points`` bins and its takes, on the current
    device and stream, as three views of one buffer: the scan's counters (``2 + points``), the
    take's (:data:`_TAKE_COUNTERS`), then the scan's counts out (``1 + points``).  The counters
    are zeroed once, when the scratch is made, and each kernel's last block leaves its own zeroed
    again (no memset before each scan: it was 2 us of the H200's 63); a scratch is one stream's,
    so that kernels on two streams never share counters."""
    cache = getattr(_SCRATCH, "by_key", None)
    if cache is None:
        cache = _SCRATCH.by_key = {}
    key = (current_device(), xp.cuda.get_current_stream().ptr, points)
    views = cache.get(key)
    if views is None:
        if len(cache) >= _SCRATCH_KEPT:
            cache.clear()
        buf = xp.zeros(2 + points + _TAKE_COUNTERS + 1 + points, xp.uint64)
        views = cache[key] = (buf[:2 + points], buf[2 + points:2 + points + _TAKE_COUNTERS],
                              buf[2 + points + _TAKE_COUNTERS:])
    return views


def _stage(xp: Any, numel: int) -> Any:
    """This thread's staging buffer for the take on the current device and stream: at least
    ``numel`` int64, grown when a take needs more.  One serves every take of a stream: a take's
    kernels run after the previous take's on that stream."""
    cache = getattr(_SCRATCH, "stages", None)
    if cache is None:
        cache = _SCRATCH.stages = {}
    key = (current_device(), xp.cuda.get_current_stream().ptr)
    buf = cache.get(key)
    if buf is None or buf.size < numel:
        if buf is None and len(cache) >= _SCRATCH_KEPT:
            cache.clear()
        buf = cache[key] = xp.empty(max(numel, 2 * buf.size if buf is not None else 0), xp.int64)
    return buf


def queue_scan(xp: Any, seg: Any, floor: float, resolution: float, points: int, store_from: int,
               cap: int) -> tuple[Any, Any, Any, Any]:
    """Queue the GPU scan kernel on the current stream (nothing waits) over contiguous ``seg``:
    room for ``cap`` candidates in ``(positions, magnitudes)``; ``counts``: [0] the candidates
    of bins ``>= store_from`` (all of them were kept if it is ``<= cap``), [1 + j] those of bin
    ``j``; and ``work``: the take's counters (zero; :func:`queue_take`'s).
    :func:`~sparsify.kernels.scan_binned` is the whole scan; this is its kernel alone, for
    benchmarks and profiles.

    Example:
        >>> pos, mag, counts, work = queue_scan(cupy, seg, 0.5, 32, 33, 16, 1 << 16)
    """
    per_block = _THREADS * _PER_LANE * 4 // seg.itemsize        # elements a block reads a round
    hist_words = points + _THREADS // 32
    if 4 * hist_words + (seg.itemsize + 4) * per_block > _SHARED_LIMIT:
        raise ValueError(f"a threshold grid of {points} points does not fit the GPU scan's shared "
                         f"memory ({_SHARED_LIMIT} bytes a block): use a coarser resolution or a "
                         f"narrower max_width")
    kernel, sms = _gpu_kernel(xp, "scan_select", seg.dtype.char)
    n = int(seg.size)
    grid = _grid(sms, n, per_block)
    if n > _MAX_ROUNDS * grid * per_block:
        raise ValueError(f"{n} elements are more than the GPU scan's {_MAX_ROUNDS} rounds of "
                         f"{grid} blocks cover")
    pos = xp.empty(cap, xp.int64)
    mag = xp.empty(cap, seg.dtype)
    head, work, counts = _scratch(xp, points)
    kernel(xp, grid, _THREADS,
           (seg.data.ptr, n, floor, floor, resolution, points, store_from, cap, pos.data.ptr,
            mag.data.ptr, head.data.ptr, counts.data.ptr), shared_mem=4 * hist_words)
    return pos, mag, counts, work


def queue_take(xp: Any, pos: Any, mags: Any, floor: float, resolution: float, points: int, j: int,
               take: int, n_at: int, n_above: int, work: Any) -> Any:
    """Queue the GPU take's kernels on the current stream (nothing waits): of the candidates
    ``(pos, mags)`` (all of bin ``j`` and above among them), the positions of the ``n_above``
    above bin ``j`` and the ``take`` largest of bin ``j``'s ``n_at``, in a new array.  ``work``:
    the take's zeroed counters (:func:`queue_scan`'s; the kernels leave them zeroed).
    :func:`~sparsify.kernels.take_scan` is the whole take; these are its kernels alone.

    Example:
        >>> out = queue_take(cupy, pos, mag, 0.5, 32, 33, 17, 90, 300, 24_910, work)
    """
    out = xp.empty(n_above + take, xp.int64)
    if n_above + take == 0:
        return out
    kernel, sms = _gpu_kernel(xp, "take_boundary", mags.dtype.char)
    select = 0 < take < n_at
    # the stage: bin j's positions and keys, then the cut's members' (take_cut's list)
    stage = _stage(xp, 4 * n_at if select else 1)
    m = int(pos.size)
    base, shift = _fine_buckets(mags.dtype, floor, resolution, points, j)
    kernel(xp, _grid(sms, m, _TAKE_THREADS), _TAKE_THREADS,
           (pos.data.ptr, mags.data.ptr, m, floor, resolution, points, j, take, n_at, n_above, base,
            shift, out.data.ptr, stage.data.ptr, work.data.ptr))
    if select:
        cut, _ = _gpu_kernel(xp, "take_cut", mags.dtype.char)
        cut(xp, _grid(sms, n_at, _TAKE_THREADS), _TAKE_THREADS,
            (stage.data.ptr, n_at, take, n_above, base, shift, out.data.ptr, work.data.ptr))
    return out


def _fine_buckets(dtype: np.dtype, floor: float, resolution: float, points: int, j: int) -> tuple[int, int]:
    """The take's fine buckets of grid bin ``j``: ``(key - base) >> shift`` spreads the keys (the
    magnitudes' bits) of the bin's range over ``_FINE`` buckets (the top bin's range reaches the
    format's largest value: coarser)."""
    largest = _LARGEST[dtype.itemsize]
    top = floor * 2.0 ** ((j + 1) / resolution) if j < points - 1 else largest
    lo, hi = (_key(min(v, largest), dtype.itemsize) for v in (floor * 2.0 ** (j / resolution), top))
    return lo, max(0, (hi - lo).bit_length() - (_FINE.bit_length() - 1))


def _key(value: float, itemsize: int) -> int:
    """The bits of ``value`` rounded to the float format of ``itemsize`` bytes, as an unsigned
    integer (the kernels' ``Key``; struct, not numpy: a few scalars per take)."""
    fmt, key = _KEY_FORMATS[itemsize]
    return key.unpack(fmt.pack(value))[0]


def gpu_scan(xp: Any, seg: Any, floor: float, resolution: float, points: int, length: int,
             store_from: int = 0) -> tuple[Any, Any, Any, Any]:
    """The one-pass GPU scan (see module docs) of float32/float64 ``seg``: positions
    and magnitudes of the candidates of bins ``>= store_from``, the host histogram of every
    candidate, length ``length`` (``None`` when 0), and the take's zeroed counters.

    Example:
        >>> pos, mags, hist, work = gpu_scan(cupy, seg, 0.5, 32, 33, 41, 14)
    """
    n = int(seg.size)
    if not seg.flags.c_contiguous:
        seg = xp.ascontiguousarray(seg)
    counts = _pinned_counts(1 + points)
    with _on_device(xp, seg):
        cap = _GPU_CAPACITY.get(n, max(1024, n // 256))
        while True:
            pos, mag, on_device, work = queue_scan(xp, seg, floor, resolution, points, store_from, cap)
            on_device.get(out=counts)               # the one host synchronisation
            found = int(counts[0])
            if found <= cap:
                break
            cap = _GPU_CAPACITY[n] = 2 * found      # more candidates than room: grow and rescan
    hist = None
    if length:
        hist = np.zeros(length, np.int64)
        hist[:points] = counts[1:1 + points]
    return pos[:found], mag[:found], hist, work


def gpu_take(xp: Any, scan: Scan, j: int, take: int) -> Any:
    """:func:`~sparsify.kernels.take_scan` on the GPU: two kernels over the kept candidates (a
    second scan first when bin ``j`` lies below the kept bins).

    Example:
        >>> kept = gpu_take(cupy, scan_binned(cupy, seg, 0.5, 32, 33, 41, 14), 16, 120)
    """
    hist = scan.hist
    n_at = int(hist[j])
    take = min(max(take, 0), n_at)
    n_above = int(hist[j + 1:scan.points].sum())
    pos, mags = scan.pos, scan.mags
    with _on_device(xp, scan.seg):
        if not scan.kept(j) and n_above + take:         # the boundary fell below the kept bins
            pos, mags, _, _ = gpu_scan(xp, scan.seg, scan.floor, scan.resolution, scan.points, 0, j)
        return queue_take(xp, pos, mags, scan.floor, scan.resolution, scan.points, j, take, n_at,
                          n_above, scan.work)
