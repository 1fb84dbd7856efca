"""The process's pool of host arrays for results of calls made without ``out``
(:data:`HOST_RESULTS`), reused once no caller holds one."""

from __future__ import annotations

import math
import sys
import threading
from collections import OrderedDict
from typing import Any

import numpy as np


class HostResults:
    """Host arrays for the results of calls made without ``out``, reused once the caller holds
    no reference to one (its reference count says so; a view, a torch tensor or a DLPack
    capsule made from it holds one).

    A fresh result of 1 MiB or more meets MPI's own temporaries and glibc's trimming of the
    heap: about 180 page faults a call, an all-reduce of 1 MiB at 450 us instead of 150 (raw
    mpi4py writing into a fresh array per call pays the same).  Arrays under 64 KiB are plain
    ``np.empty`` (numpy keeps those cheap); larger ones start on a 64-byte boundary (jax takes
    them without a copy); those over 64 MiB are not kept; at most 4 are kept per shape and
    dtype, 256 MiB in all: a new shape takes the room of idle buffers of the shapes least
    recently asked for (shapes that vary, as ``allgatherv``'s, no longer pin the whole pool
    with shapes that never come back).  Off where reference counts are not exact (a
    free-threaded Python).

    Example:
        >>> r = HOST_RESULTS.empty((1 << 18,), np.float32)   # reused after ``del r``
    """

    MIN_BYTES, MAX_BYTES, PER_KEY, TOTAL_BYTES = 64 << 10, 64 << 20, 4, 256 << 20
    _IDLE = 3           # the pool's pair, the loop's name, getrefcount's argument
    _OWNER_IDLE = 4     # the same and the buffer's base (numpy's views of the buffer hold the owner)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: per (shape, dtype): (the buffer handed out, the array owning its memory)
        self._kept: OrderedDict[tuple, list[tuple[np.ndarray, np.ndarray]]] = OrderedDict()
        self._bytes = 0
        self._on = getattr(sys, "_is_gil_enabled", lambda: True)()

    def like(self, x: np.ndarray) -> np.ndarray:
        """An array of ``x``'s shape and dtype (``x`` C-contiguous) that no caller holds."""
        if x.nbytes < self.MIN_BYTES:
            return np.empty_like(x)
        return self.empty(x.shape, x.dtype)

    def empty(self, shape: tuple, dtype: Any) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` that no caller holds."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES:
            return np.empty(shape, dtype)
        if not (self._on and nbytes <= self.MAX_BYTES):
            return _aligned_empty(shape, dtype, nbytes)[0]
        key = (tuple(shape), dtype)
        with self._lock:
            kept = self._kept.get(key)
            if kept is None:
                kept = self._kept[key] = []
            else:
                self._kept.move_to_end(key)     # the most recently asked for last
                for buf, owner in kept:
                    if self._idle(buf, owner):
                        return buf
            if len(kept) < self.PER_KEY and (self._bytes + nbytes <= self.TOTAL_BYTES
                                             or self._evict(nbytes, key)):
                pair = _aligned_empty(shape, dtype, nbytes)
                kept.append(pair)
                self._bytes += nbytes
                return pair[0]
        return _aligned_empty(shape, dtype, nbytes)[0]

    def _idle(self, buf: np.ndarray, owner: np.ndarray) -> bool:
        """No caller holds ``buf`` (nor a view of it); called with a pair held by the pool and
        by the caller's loop names (``for buf, owner in kept``), hence the + 1."""
        return sys.getrefcount(buf) == self._IDLE + 1 and sys.getrefcount(owner) == self._OWNER_IDLE + 1

    def _evict(self, nbytes: int, asking: tuple) -> bool:
        """Drop idle buffers of the shapes least recently asked for (not ``asking``'s) until
        ``nbytes`` more fit (under the lock); whether they fit now."""
        for key in [k for k in self._kept if k != asking]:
            kept, busy = self._kept[key], []
            for buf, owner in kept:
                if self._idle(buf, owner):
                    self._bytes -= buf.nbytes
                else:
                    busy.append((buf, owner))
            if busy:
                kept[:] = busy
            else:
                del self._kept[key]
            if self._bytes + nbytes <= self.TOTAL_BYTES:
                return True
        return False


def _aligned_empty(shape: tuple, dtype: np.dtype, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.empty(shape, dtype)`` starting on a 64-byte boundary (``jax.device_put`` takes such
    memory as a jax array without a copy: :func:`jax_result`), and the array that owns its memory."""
    owner = np.empty(nbytes + 64, np.uint8)
    start = -owner.ctypes.data % 64
    return owner[start:start + nbytes].view(dtype).reshape(shape), owner


#: the process's pool of host results (one for every communicator)
HOST_RESULTS = HostResults()
