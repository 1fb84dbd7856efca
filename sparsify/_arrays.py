"""Array plumbing shared by the selectors: one code path for numpy (host) and cupy (GPU).

``xp`` is the array module of the data (numpy or cupy), found from the array
itself; cupy is imported only when a cupy array is seen.  Framework arrays
(torch, jax, anything with DLPack) are reached through
:func:`commlib.arrays.as_view`, never by importing the framework.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from commlib.arrays import as_view, numpy_dtype

#: dtypes a selector accepts for the accumulated gradient it selects from
ACC_DTYPES = ("float16", "float32", "float64")
#: dtypes a sparse strategy accepts for gradient buckets
GRAD_DTYPES = ("float16", "bfloat16", "float32", "float64")


def array_module(a: Any) -> Any:
    """``numpy`` or ``cupy``, whichever ``a`` belongs to (numpy for anything else)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def module_by_device(device: str) -> Any:
    """The array module for ``device`` (``"cpu"`` or ``"cuda"``)."""
    if device == "cpu":
        return np
    import cupy
    return cupy


def is_array_of(a: Any, xp: Any) -> bool:
    """True when ``a`` is an ndarray of module ``xp`` (numpy or cupy)."""
    return isinstance(a, xp.ndarray) and array_module(a) is xp


def to_host(a: Any) -> np.ndarray:
    """``a`` as a numpy array (a device-to-host copy for cupy)."""
    if isinstance(a, np.ndarray):
        return a
    return a.get()


def index_dtype(numel: int) -> np.dtype:
    """int32 indices below 2**31 elements, int64 beyond (halves the index traffic of most models).

    Example:
        >>> index_dtype(10), index_dtype(1 << 31)
        (dtype('int32'), dtype('int64'))
    """
    return np.dtype(np.int32) if numel <= np.iinfo(np.int32).max else np.dtype(np.int64)


def acc_dtype_for(grad_dtype: str) -> np.dtype:
    """The dtype of the residual (error-feedback memory) for gradients of ``grad_dtype``:
    float32 for 16-bit gradients (small residuals must not round away), else the same."""
    return np.dtype(np.float64) if grad_dtype == "float64" else np.dtype(np.float32)


def flat_view(x: Any, name: str) -> tuple[Any, str, Any]:
    """A flat zero-copy alias of ``x`` (numpy/cupy storage), its commlib dtype name and xp."""
    v = as_view(x, name)
    return v.data, v.dtype, v.xp


def read_as(xp: Any, data: Any, dtype: str, out_dtype: np.dtype) -> Any:
    """Storage ``data`` of commlib dtype ``dtype`` as an ``out_dtype`` array (a copy for bfloat16)."""
    if dtype == "bfloat16":
        if xp is np:
            return data.view(numpy_dtype("bfloat16")).astype(out_dtype)
        wide = data.astype(xp.uint32) << 16
        return wide.view(xp.float32).astype(out_dtype, copy=False)
    return data if data.dtype == out_dtype else data.astype(out_dtype)


def write_as(xp: Any, values: Any, dtype: str) -> Any:
    """``values`` (float) converted to the storage of commlib dtype ``dtype`` (round to nearest even)."""
    if dtype == "bfloat16":
        if xp is np:
            return values.astype(numpy_dtype("bfloat16")).view(np.uint16)
        bits = values.astype(xp.float32).view(xp.uint32)
        rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) >> 16
        nan = values != values
        return xp.where(nan, xp.uint32(0x7FC0), rounded).astype(xp.uint16)
    return values.astype(numpy_dtype(dtype), copy=False)


def all_finite(xp: Any, x: Any) -> bool:
    """Whether flat floating ``x`` holds no inf or NaN, in one reduction: 32- and 64-bit arrays by
    their sum (non-finite when an element is, or when finite elements sum past the format's
    range, ~3e38 in float32: an overflow too), 16-bit ones element by element (their sums
    overflow at 65504).

    Example:
        >>> all_finite(np, np.array([1.0, np.inf], np.float32))
        False
    """
    if x.dtype.itemsize >= 4:
        return bool(xp.isfinite(x.sum()))
    return bool(xp.isfinite(x).all())
