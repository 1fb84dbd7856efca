"""Array views: numpy, cupy, torch, jax and any DLPack array as flat buffers.

commlib never imports a framework.  A framework array is reached through
DLPack (``__dlpack__``) or the array interfaces, and a result is handed back
through the framework module the caller already imported (``sys.modules``).

A :class:`View` holds a flat, contiguous, zero-copy alias of the caller's
memory (``data``) in a *storage* dtype that numpy and cupy both have:
bfloat16 travels as ``uint16`` storage with ``dtype == "bfloat16"``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .errors import ValidationError
from .host_results import HOST_RESULTS

#: The dtypes every operation accepts, by name.
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "complex64", "complex128")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: summed and averaged (MPI's complex types; NCCL: as pairs of reals), not ordered: no max or min
COMPLEX_DTYPES = ("complex64", "complex128")
#: what ``avg`` takes, and gradients may be: floating and complex
INEXACT_DTYPES = FLOAT_DTYPES + COMPLEX_DTYPES

_STORAGE = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
}
_NUMPY_LOGICAL = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
#: the storage dtypes' names, for device arrays' views (numpy's ``dtype.name`` is a Python
#: property: 4.8 us for two reads in a blocking NCCL call's profile on the H200's host)
_STORAGE_NAMES = {k: v.name for k, v in _STORAGE.items()}


#: numpy dtype -> commlib name, for the fast path
_NP_NAMES = {np.dtype(ml_dtypes.bfloat16): "bfloat16",
             **{v: k for k, v in _STORAGE.items() if k != "bfloat16"}}


#: torch dtype -> its name (dtype_name's answer, kept: a dict lookup instead of 1 us of strings)
_TORCH_NAMES: dict[Any, str] = {}


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy/cupy dtype that holds ``dtype`` (``uint16`` for bfloat16)."""
    return _STORAGE[dtype]


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype for arithmetic on ``dtype`` (ml_dtypes for bfloat16)."""
    return _NUMPY_LOGICAL.get(dtype, _STORAGE[dtype])


def dtype_name(dtype: Any) -> str:
    """Normalize a numpy/torch/jax/cupy dtype (or its name) to a commlib dtype name.

    Example:
        >>> dtype_name(np.float32), dtype_name("torch.bfloat16")
        ('float32', 'bfloat16')
    """
    if isinstance(dtype, np.dtype) and dtype in _NP_NAMES:      # numpy's and jax's: a lookup, not strings
        return _NP_NAMES[dtype]
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = {"half": "float16", "float": "float32", "double": "float64",
            "int": "int32", "long": "int64"}.get(name, name)
    if name not in DTYPES:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    return name


def mark_written(x: Any) -> None:
    """``x`` is about to be written by an operation (in place, or as ``out``): a torch tensor's
    version counter moves, as a torch in-place operation moves it, so that autograd refuses a
    backward through a graph that saved it (it used the overwritten values silently).

    Example:
        >>> mark_written(t)             # t._version + 1
    """
    if type(x) is not np.ndarray and type(x).__module__.split(".")[0] == "torch":
        sys.modules["torch"].autograd.graph.increment_version(x)


def _kind(x: Any) -> str:
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod in ("cupy", "torch", "jax", "jaxlib"):
        return "jax" if mod == "jaxlib" else mod
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    return "unknown"


@dataclass(slots=True)
class View:
    """A flat alias of an array's memory plus what is needed to hand results back.

    Example:
        >>> v = as_view(np.arange(6, dtype=np.float32).reshape(2, 3), "x")
        >>> v.dtype, v.count, v.device, v.shape
        ('float32', 6, 'cpu', (2, 3))
    """

    data: Any            # 1-D numpy or cupy array in storage dtype, aliasing the caller's memory
    dtype: str
    shape: tuple
    device: str          # "cpu" or "cuda"
    device_id: int
    kind: str            # numpy, cupy, torch, jax, dlpack
    original: Any
    writable: bool
    count: int           # elements of data

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def xp(self) -> Any:
        """The array module of ``data``: numpy or cupy."""
        if self.device == "cpu":
            return np
        import cupy
        return cupy

    def empty(self, count: int) -> Any:
        """A flat storage array of ``count`` elements on the same device that nothing else holds
        (host: from :data:`HOST_RESULTS`)."""
        if self.device == "cpu":
            return HOST_RESULTS.empty((count,), storage_dtype(self.dtype))
        import cupy
        with cupy.cuda.Device(self.device_id):
            return cupy.empty(count, dtype=storage_dtype(self.dtype))

    def wrap(self, data: Any, shape: tuple) -> Any:
        """Hand storage ``data`` back as an array of the caller's kind and dtype."""
        data = data.reshape(shape)
        if self.kind in ("numpy", "dlpack"):
            return data.view(numpy_dtype(self.dtype)) if self.device == "cpu" else data
        if self.kind == "cupy":
            return data
        if self.kind == "torch":
            torch = sys.modules["torch"]
            if self.dtype == "bfloat16":
                t = torch.from_dlpack(data.view(np.int16) if self.device == "cpu"
                                      else data.view("int16"))
                return t.view(torch.bfloat16)
            return torch.from_dlpack(data)
        if self.kind == "jax":
            if self.device == "cpu":
                return jax_result(data.view(numpy_dtype(self.dtype)))
            jax = sys.modules["jax"]
            result = jax.numpy.from_dlpack(data)
            if self.dtype == "bfloat16":    # cupy holds it as uint16 storage
                result = jax.lax.bitcast_convert_type(result, jax.numpy.bfloat16)
            return result
        raise ValidationError(f"cannot hand back an array of kind {self.kind}")


def _dtype_error(name: str, dt: str) -> ValidationError:
    return ValidationError(f"{name}: dtype {dt} is not supported; use one of {', '.join(DTYPES)}")


def _contiguity_error(name: str, kind: str) -> ValidationError:
    hint = {"numpy": "np.ascontiguousarray(x)", "cupy": "cupy.ascontiguousarray(x)",
            "torch": "x.contiguous()"}.get(kind, "a contiguous copy")
    return ValidationError(f"{name}: array is not contiguous in row-major (C) order (a transpose, a slice, "
                           f"Fortran order), which a result written in place needs; pass {hint}")


def _read_copy(x: Any, copy: Callable[[Any], Any], read_only: bool,
               refusal: Callable[[], ValidationError]) -> Any:
    """``copy(x)``: ``x`` in the form the operation needs (contiguous, resolved, this machine's byte
    order) where it only reads ``x``; as ``out`` or in place, where the copy would take the result and
    ``x`` never see it, ``refusal()`` (the ValidationError that says why) is raised."""
    if not read_only:
        raise refusal()
    return copy(x)


def host_pair(x: Any, out: Any) -> str | None:
    """The dtype name when ``x`` is a plain C-contiguous numpy array of a dtype that MPI
    handles natively (bfloat16 excluded) and ``out`` is ``None`` or a writable C-contiguous
    numpy array of the same dtype; else ``None``.

    Decides, in a few attribute reads, whether a blocking call may take the host path
    (:meth:`~commlib.runner.Runner.call_host`); anything else goes through :func:`as_view`.

    Example:
        >>> host_pair(np.ones(4, np.float32), np.empty(4, np.float32))
        'float32'
    """
    if type(x) is not np.ndarray:
        return None
    dt = _NP_NAMES.get(x.dtype)
    flags = x.flags
    if dt is None or dt == "bfloat16" or not (flags.c_contiguous and flags.aligned):
        return None
    if out is None:
        return dt
    if type(out) is not np.ndarray or out.dtype is not x.dtype:
        return None
    return dt if out.flags.carray else None     # (C-contiguous, aligned and writeable)


#: the torch dtypes the host path takes (all of DTYPES but bfloat16), made at the first torch call
_TORCH_HOST: frozenset = frozenset()
#: the classes of concrete jax arrays (not tracers), recorded as :func:`as_view` meets them
_JAX_ARRAYS: set[type] = set()


def _plain_cpu_tensor(t: Any, tensor_type: type) -> Any:
    """numpy's alias of ``t`` when it is a plain (not a subclass), contiguous, stored-as-read CPU
    tensor of a dtype the host path takes (bfloat16 excluded, as in :func:`host_pair`); else None."""
    if type(t) is not tensor_type or not t.is_cpu or t.dtype not in _TORCH_HOST or not t.is_contiguous():
        return None
    try:
        return (t.detach() if t.requires_grad else t).numpy()
    except RuntimeError:        # a lazy conj or neg bit (numpy() refuses them: asking first cost 0.5 us
        return None             # a call), or no storage to alias (functorch): the general path


def host_alias(x: Any, out: Any) -> tuple[np.ndarray, np.ndarray | None, Callable[[np.ndarray], Any]] | None:
    """numpy aliases of ``x`` and ``out`` (the same memory) and the function that hands a new result
    back as ``x``'s kind, when ``x`` is a plain contiguous CPU torch tensor of a dtype MPI handles
    natively and ``out`` is ``None`` or one of the same dtype, or a jax array on one CPU device
    (``out`` ``None``: jax arrays are never outputs); else ``None``.

    A blocking call on them then takes the numpy arrays' path (:func:`host_pair`,
    :meth:`~commlib.runner.Runner.call_host`) instead of two :func:`as_view` and the general
    path: 7-9 us less per torch call, 20-30 us per jax one
    (``benchmarks/results/collectives-torch-2ranks.md``, ``jax-collectives.md``).
    :func:`host_alias_result` hands the result back.

    Example:
        >>> xn, on, back = host_alias(torch.ones(4), None)   # (array([1., 1., 1., 1.]), None, ...)
    """
    global _TORCH_HOST
    torch = sys.modules.get("torch")
    if torch is not None:
        if not _TORCH_HOST:
            _TORCH_HOST = frozenset(getattr(torch, name) for name in DTYPES if name != "bfloat16")
        tensor = torch.Tensor
        xn = _plain_cpu_tensor(x, tensor)
        if xn is not None:
            if out is None:
                return xn, None, torch.from_numpy
            bump = torch.autograd.graph.increment_version     # mark_written's, for a known tensor
            if out is x:            # in place: one alias, which the backend knows as in place at once
                bump(x)
                return xn, xn, torch.from_numpy
            on = _plain_cpu_tensor(out, tensor)
            if on is None or out.dtype is not x.dtype:
                return None
            bump(out)
            return xn, on, torch.from_numpy
    if out is None and type(x) in _JAX_ARRAYS and not x.is_deleted():   # deleted: the general path says so
        devices = x.devices()
        if len(devices) == 1 and next(iter(devices)).platform == "cpu" and x.dtype in _NP_NAMES:
            xn = np.asarray(x)      # read-only, the same memory
            if xn.flags.c_contiguous:
                return xn, None, jax_result
    return None


#: host results from this many bytes reach jax without a copy (``jax.device_put`` aliases them)
_JAX_ALIAS_BYTES = 64 << 10


def jax_result(data: np.ndarray) -> Any:
    """A new host result (numpy, nothing else writes it) as a jax array on the CPU: from 64 KiB
    through ``jax.device_put``, which takes memory on a 64-byte boundary as it is (about 30 us
    whatever the size; the array holds ``data``'s memory, so the pool of results never hands it
    out again while it lives), else a copy (``jnp.asarray``: 18 us at 4 KiB, 0.2 ms at 1 MiB and
    1 ms at 4 MiB on this machine).  Not ``jax.dlpack.from_dlpack``: a 64-bit array it converted
    (x64 off) aborted the process at exit, 7 times in 12 (jax 0.10.2).

    Example:
        >>> jax_result(np.ones(1 << 16, np.float32))       # the same memory
    """
    jax = sys.modules["jax"]
    return jax.device_put(data) if data.nbytes >= _JAX_ALIAS_BYTES else jax.numpy.asarray(data)


def host_alias_result(result: np.ndarray, out: Any, back: Callable[[np.ndarray], Any]) -> Any:
    """What a call on the aliases of :func:`host_alias` returns: ``out`` itself when the
    caller gave one, else ``back(result)`` (a torch tensor of the same memory, a jax array)."""
    return out if out is not None else back(result)


def is_tracer(x: Any) -> bool:
    """``x`` is an abstract jax value (inside ``jax.jit``, ``grad`` or ``vmap``), not an array.

    Asks the jax the caller already imported (``sys.modules``): the core imports no framework."""
    for module in ("jax.core", "jax._src.core"):     # the public name first; newer jax: only the second
        tracer = getattr(sys.modules.get(module), "Tracer", None)
        if tracer is not None:
            return isinstance(x, tracer)
    return False


def as_view(x: Any, name: str, read_only: bool = False) -> View:
    """Alias ``x`` as a :class:`View` without copying, or raise :class:`ValidationError`.

    Accepts numpy and cupy arrays, torch tensors (CPU or CUDA, ``requires_grad``
    is ignored: the data is used), jax arrays (read-only: never an output) and
    any object with ``__dlpack__``.  ``read_only``: the operation only reads
    ``x`` (not in place), so a non-contiguous one (a transpose, a column slice)
    is read through a contiguous copy instead of refused.
    """
    if type(x) is np.ndarray:  # fast path: the common case costs a few attribute reads
        dt = _NP_NAMES.get(x.dtype)
        flags = x.flags
        if dt is not None and flags.c_contiguous and flags.aligned:
            flat = x if x.ndim == 1 else x.reshape(-1)
            if dt == "bfloat16":
                flat = flat.view(np.uint16)
            return View(flat, dt, x.shape, "cpu", -1, "numpy", x, x.flags.writeable, x.size)
    kind = _kind(x)
    writable = True
    device, device_id = "cpu", -1
    dt = None
    if kind == "numpy":
        if isinstance(x, np.ma.MaskedArray):     # its data alone would be reduced, the mask ignored
            raise ValidationError(f"{name}: a masked array: pass x.filled(value) (or x.data) to say what "
                                  "its masked elements hold")
        arr = np.asarray(x)     # a subclass (np.memmap, np.matrix) as the plain ndarray of its memory
        arr = arr if arr.flags.c_contiguous else _read_copy(
            arr, np.ascontiguousarray, read_only, lambda: _contiguity_error(name, kind))
        if not arr.flags.aligned:       # (np.frombuffer at an odd offset) MPI maps no such datatype
            arr = _read_copy(arr, np.copy, read_only, lambda: ValidationError(
                f"{name}: its memory is not aligned to its dtype ({arr.dtype}; np.frombuffer at an "
                "offset that is not a multiple of the itemsize?): pass an aligned copy (x.copy())"))
        if not arr.dtype.isnative:      # the other byte order: MPI would read its bytes as this machine's
            order = arr.dtype.str
            arr = _read_copy(arr, lambda a: a.astype(a.dtype.newbyteorder("=")), read_only,
                             lambda: ValidationError(f"{name}: dtype {order} is not in this machine's byte "
                                                     "order; pass x.astype(x.dtype.newbyteorder('='))"))
        writable = bool(arr.flags.writeable)
    elif kind == "cupy":
        arr = x if x.flags.c_contiguous else _read_copy(
            x, sys.modules["cupy"].ascontiguousarray, read_only, lambda: _contiguity_error(name, kind))
        device, device_id = "cuda", int(arr.device.id)
    elif kind == "torch":
        t = x.detach() if x.requires_grad else x        # the data: numpy() refuses a tensor that needs grad
        if not t.is_contiguous():
            t = _read_copy(t, lambda t: t.contiguous(), read_only, lambda: _contiguity_error(name, kind))
        if t.is_conj() or t.is_neg():       # a lazy conjugate (x.conj()): DLPack takes only what is stored
            t = _read_copy(t, lambda t: t.resolve_conj().resolve_neg(), read_only, lambda: ValidationError(
                f"{name}: a lazy conjugate or negation (x.conj(), -x of a conjugate) cannot receive a "
                "result: pass a plain tensor (x.resolve_conj() is a copy)"))
        dt = _TORCH_NAMES.get(t.dtype) or _TORCH_NAMES.setdefault(t.dtype, dtype_name(t.dtype))
        if dt not in DTYPES:        # before numpy meets it (float8, complex32: a TypeError there)
            raise _dtype_error(name, dt)
        is_bf16 = dt == "bfloat16"
        if is_bf16:
            t = t.view(sys.modules["torch"].int16)
        where = t.device
        if where.type == "cuda":
            import cupy
            arr = cupy.from_dlpack(t)
            device, device_id = "cuda", int(where.index or 0)
        elif where.type == "cpu":
            arr = t.numpy()         # shares the memory, as DLPack does, 2 us sooner
        else:
            raise ValidationError(f"{name}: torch device {where} is not supported (cpu, cuda)")
        if is_bf16:
            arr = arr.view(np.uint16) if device == "cpu" else arr.view("uint16")
    elif kind == "jax":
        if is_tracer(x):
            raise ValidationError(
                f"{name}: a traced jax array (inside jax.jit, grad or vmap): the communicator's calls take "
                "concrete arrays; inside jax.jit use commlib.bindings.jax's allreduce, allgather and "
                "broadcast (or average_gradients for a gradient pytree)")
        devs = list(x.devices()) if hasattr(x, "devices") else []
        platform = devs[0].platform if devs else "cpu"
        if devs:
            _JAX_ARRAYS.add(type(x))        # a concrete array's class: host_alias knows it now
        if platform == "cpu":
            arr = np.asarray(x)
        elif platform == "gpu":
            import cupy
            arr = cupy.from_dlpack(x)
            device, device_id = "cuda", int(devs[0].id)
        else:
            raise ValidationError(f"{name}: jax platform {platform} is not supported")
        writable = False
    elif kind == "dlpack":
        arr = np.from_dlpack(x)
    else:
        raise ValidationError(
            f"{name}: expected a numpy, cupy, torch or jax array (or any DLPack array), "
            f"got {type(x).__name__}")
    if dt is None:
        dt = _NP_NAMES.get(arr.dtype) or dtype_name(arr.dtype)     # the lookup: str(dtype) costs 3 us
    if dt not in DTYPES:
        raise _dtype_error(name, dt)
    shape = tuple(int(s) for s in arr.shape)
    if device == "cpu":
        flat = arr.reshape(-1).view(storage_dtype(dt))
    else:
        flat = arr.reshape(-1).view(_STORAGE_NAMES[dt])
    return View(flat, dt, shape, device, device_id, kind, x, writable, int(flat.size))
