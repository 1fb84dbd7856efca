"""Single-process properties of the array views and chunking (hypothesis)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import commlib
from commlib.arrays import as_view, dtype_name


@given(n=st.integers(0, 10_000), size=st.integers(1, 64))
def test_split_counts_matches_numpy_array_split(n, size):
    counts = commlib.split_counts(n, size)
    assert sum(counts) == n and len(counts) == size
    assert counts == [len(c) for c in np.array_split(np.arange(n), size)]
    assert max(counts) - min(counts) <= 1


@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
       dtype=st.sampled_from(["float16", "float32", "float64", "int32", "int64", "bfloat16"]))
def test_view_aliases_memory_and_round_trips(shape, dtype):
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = np.arange(int(np.prod(shape)), dtype=np.float64).astype(npdt).reshape(shape)
    v = as_view(x, "x")
    assert (v.dtype, v.shape, v.count, v.device) == (dtype, tuple(shape), x.size, "cpu")
    assert v.data.size == 0 or np.shares_memory(v.data, x)
    back = v.wrap(v.data, v.shape)
    assert back.dtype == x.dtype and back.shape == x.shape
    np.testing.assert_array_equal(back.astype(np.float64), x.astype(np.float64))


def test_dtype_names_across_frameworks():
    assert dtype_name("torch.float32") == "float32"
    assert dtype_name("torch.half") == "float16"
    assert dtype_name(np.int64) == "int64"
    assert dtype_name(ml_dtypes.bfloat16) == "bfloat16"


def test_rejects_what_it_cannot_alias():
    column = np.arange(9.0).reshape(3, 3)[:, 1]
    with pytest.raises(commlib.ValidationError, match="not contiguous"):
        as_view(column, "x")
    copied = as_view(column, "x", read_only=True)        # an input only read: a contiguous copy
    assert copied.shape == (3,) and list(copied.data) == [1.0, 4.0, 7.0]
    with pytest.raises(commlib.ValidationError, match="uint8 is not supported"):
        as_view(np.ones(3, np.uint8), "x")
    ro = np.ones(3)
    ro.flags.writeable = False
    assert not as_view(ro, "x").writable



def test_host_results_are_reused_only_when_no_caller_holds_them():
    """``HostResults``: a result is handed out again only after every reference to it is gone (a
    view, a reshape, a memoryview or a DLPack capsule made from it holds it); below 64 KiB, new
    arrays."""
    from commlib.host_results import HostResults

    pool = HostResults()
    shape = (1 << 16,)                                      # 256 KiB of float32: pooled
    holders = {"view": lambda r: r[10:20], "reshape": lambda r: r.reshape(256, 256),
               "memoryview": memoryview, "dlpack capsule": lambda r: r.__dlpack__()}
    for name, hold in holders.items():
        r = pool.empty(shape, np.float32)
        r[:] = 1.0
        ptr, kept = r.ctypes.data, hold(r)
        del r
        other = pool.empty(shape, np.float32)
        assert other.ctypes.data != ptr, name               # held: not handed out again
        other[:] = 2.0
        if name != "dlpack capsule":
            assert (np.asarray(kept) == 1.0).all(), name
        del kept, other
    r = pool.empty(shape, np.float32)
    ptr = r.ctypes.data
    del r
    assert pool.empty(shape, np.float32).ctypes.data == ptr   # dropped: the same memory again
    assert pool.empty(shape, np.float64).dtype == np.float64
    assert pool.empty((256, 256), np.float32).shape == (256, 256)
    small = [pool.empty((16,), np.float32) for _ in range(3)]
    assert len({s.ctypes.data for s in small}) == 3


def test_host_results_make_room_for_new_shapes():
    """Shapes that vary (``allgatherv``'s results, a metric of the batch's length) filled the pool's
    256 MiB with buffers of shapes that never came back, pinned for good, and every new shape went
    unpooled; a new shape now takes the room of idle buffers of the least recently used shapes,
    never of a buffer a caller holds."""
    from commlib.host_results import HostResults

    pool = HostResults()
    pool.TOTAL_BYTES = 4 << 20                  # small: the shapes below (64 KiB to 2.4 MiB) overflow it
    held = pool.empty((1 << 16,), np.float32)   # the oldest shape, still held
    held[:] = 7.0
    for n in range(1, 40):                      # 39 other shapes, each used once
        pool.empty((1 << 16, n), np.int8)
    assert pool._bytes <= pool.TOTAL_BYTES
    assert len(pool._kept) <= 16 and ((1 << 16,), np.dtype(np.float32)) in pool._kept
    assert (held == 7.0).all()
    again = pool.empty((1 << 16, 39), np.int8)  # the latest shape is still pooled: the same memory
    ptr = again.ctypes.data
    del again
    assert pool.empty((1 << 16, 39), np.int8).ctypes.data == ptr
    assert pool.empty((1 << 16,), np.float32).ctypes.data != held.ctypes.data
