"""Ordered host calls inside ``jax.jit``: commlib's collectives on XLA's own buffers, as mpi4jax's.

:func:`host_call` is ``io_callback(fn, results, *args, ordered=True)`` for the binding's collectives:
``fn`` runs on the host once per execution, in program order with every other such call (one
ordered effect threads them all, so a compiled step's collectives run in the same order on every
rank, after the calls of the step dispatched before it).  On the CPU backend it is an XLA FFI
custom call whose handler, a ``ctypes`` function, hands ``fn`` numpy views of XLA's operand
buffers and (``into=True``) of its result buffers: no copy of either and none of
``io_callback``'s per-call machinery (an all-gather of 8 MiB inside ``jax.jit`` wrote 16 MiB into
a host array that XLA then copied).  Where the FFI is not there (another backend, a JAX without
its typed FFI or the internals this relies on) it is ``io_callback`` itself, with the same
semantics: :data:`MECHANISM` says which.

An exception raised by ``fn`` fails the execution: JAX raises its runtime error carrying the
exception's type and message.

Example:
    >>> from commlib.bindings.jax_host import host_call
    >>> def total(x, out):                     # numpy views; write the result into out
    ...     comm.allreduce(x, "sum", out=out)
    >>> y = jax.jit(lambda v: host_call(total, jax.ShapeDtypeStruct(v.shape, v.dtype), v, into=True))(x)
"""

from __future__ import annotations

import ctypes as C
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

_TARGET = "commlib_host_call"
_METADATA = 1           # XLA_FFI_Extension_Metadata
_EXECUTE = 3            # XLA_FFI_ExecutionStage_EXECUTE
_INTERNAL = 13          # XLA_FFI_Error_Code_INTERNAL


class _Ext(C.Structure):
    pass


_Ext._fields_ = [("struct_size", C.c_size_t), ("type", C.c_int), ("next", C.POINTER(_Ext))]


class _Version(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("ext", C.c_void_p), ("major", C.c_int), ("minor", C.c_int)]


class _Metadata(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("api_version", _Version), ("traits", C.c_uint32),
                ("state_type_id", C.c_int64)]


class _MetadataExt(C.Structure):
    _fields_ = [("base", _Ext), ("metadata", C.POINTER(_Metadata))]


class _Buffer(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("ext", C.c_void_p), ("dtype", C.c_int), ("data", C.c_void_p),
                ("rank", C.c_int64), ("dims", C.POINTER(C.c_int64))]


class _List(C.Structure):      # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [("struct_size", C.c_size_t), ("ext", C.c_void_p), ("size", C.c_int64),
                ("types", C.POINTER(C.c_int)), ("items", C.POINTER(C.POINTER(_Buffer)))]


class _Scalar(C.Structure):
    _fields_ = [("dtype", C.c_int), ("value", C.POINTER(C.c_int64))]


class _Attrs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("ext", C.c_void_p), ("size", C.c_int64),
                ("types", C.POINTER(C.c_int)), ("names", C.c_void_p),
                ("items", C.POINTER(C.POINTER(_Scalar)))]


class _Frame(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("ext", C.POINTER(_Ext)), ("api", C.c_void_p),
                ("ctx", C.c_void_p), ("stage", C.c_int), ("args", _List), ("rets", _List), ("attrs", _Attrs),
                ("future", C.c_void_p)]


class _ErrorArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("ext", C.c_void_p), ("message", C.c_char_p), ("errc", C.c_int)]


_ERROR_CREATE = C.CFUNCTYPE(C.c_void_p, C.POINTER(_ErrorArgs))


class _Api(C.Structure):       # the head of XLA_FFI_Api, up to XLA_FFI_Error_Create
    _fields_ = [("struct_size", C.c_size_t), ("ext", C.c_void_p), ("api_version", _Version),
                ("internal", C.c_void_p), ("error_create", _ERROR_CREATE)]


_KEYS = itertools.count(1)      # next() on it is one C call: atomic under the GIL


class _Call:
    """One traced call: ``fn`` and the shapes and dtypes of its operands and results."""

    __slots__ = ("fn", "ins", "outs", "into", "key", "__weakref__")

    def __init__(self, fn: Callable[..., Any], ins: Sequence[tuple[tuple[int, ...], np.dtype]],
                 outs: Sequence[tuple[tuple[int, ...], np.dtype]], into: bool):
        self.fn, self.into = fn, into
        self.key = next(_KEYS)
        self.ins, self.outs = [_Slot(s, d, False) for s, d in ins], [_Slot(s, d, True) for s, d in outs]

    def __call__(self, *_: Any) -> None:
        """(Callable: the executable holds the call among its host callbacks, which XLA does not call.)"""

    def run(self, args: list[np.ndarray], rets: list[np.ndarray]) -> None:
        """``fn`` on the operands' views (a list); its results (or, ``into``, it) written into ``rets``."""
        if self.into:
            self.fn(args, rets)
            return
        got = jax.tree_util.tree_leaves(self.fn(args))
        if len(got) != len(rets):
            raise ValueError(f"host_call: the function returned {len(got)} arrays, expected {len(rets)}")
        for dst, src in zip(rets, got):
            src = np.asarray(src)
            if src.shape != dst.shape:
                raise ValueError(f"host_call: the function returned shape {list(src.shape)}, expected "
                                 f"{list(dst.shape)}")
            np.copyto(dst, src, casting="same_kind")


class _Slot:
    """An operand or result of a call: a numpy view of the buffer XLA passes at ``address``."""

    __slots__ = ("shape", "dtype", "raw", "writeable")

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, writeable: bool):
        self.shape, self.dtype, self.writeable = shape, dtype, writeable
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.raw = C.c_char * nbytes if nbytes else None

    def view(self, address: int) -> np.ndarray:
        if self.raw is None:
            a = np.empty(self.shape, self.dtype)
        else:
            a = np.frombuffer(self.raw.from_address(address), self.dtype).reshape(self.shape)
        if not self.writeable:
            a.flags.writeable = False
        return a


#: the traced calls by key, the handler's way to them; held (strongly) by the jaxpr that binds one and by
#: the executable compiled from it (as a host callback), so that an entry goes when both are gone
_CALLS: weakref.WeakValueDictionary[int, _Call] = weakref.WeakValueDictionary()


def _handle(frame: Any) -> int | None:
    f = frame.contents
    try:
        if f.ext and f.ext.contents.type == _METADATA:      # XLA asks which FFI version this handler speaks
            md = C.cast(f.ext, C.POINTER(_MetadataExt)).contents.metadata.contents
            md.api_version.struct_size = C.sizeof(_Version)
            md.api_version.major, md.api_version.minor = 0, 1
            md.traits = 0
            return None
        if f.stage != _EXECUTE:
            return None
        call = _CALLS[f.attrs.items[0].contents.value.contents.value]
        # operand and result 0: the ordered effect's token
        args, rets = f.args.items, f.rets.items
        call.run([slot.view(args[i].contents.data) for i, slot in enumerate(call.ins, 1)],
                 [slot.view(rets[i].contents.data) for i, slot in enumerate(call.outs, 1)])
        return None
    except BaseException as e:  # noqa: BLE001 - handed to XLA, which fails the execution with it
        message = f"commlib host call: {type(e).__name__}: {e}".encode(errors="replace")
        api = C.cast(f.api, C.POINTER(_Api)).contents
        return api.error_create(C.byref(_ErrorArgs(C.sizeof(_ErrorArgs), None, message, _INTERNAL)))


_HANDLER = C.CFUNCTYPE(C.c_void_p, C.POINTER(_Frame))(_handle)


def _setup() -> tuple[Any, str]:
    """The primitive, or None and why the FFI path is not taken."""
    try:
        import dataclasses

        from jax._src import core, dispatch, effects
        from jax._src.interpreters import mlir

        class CommEffect(effects.Effect):
            """commlib's host calls: one ordered effect, so that they run in program order."""

            def __str__(self) -> str:
                return "commlib.CommEffect"

        effect = CommEffect()
        for kinds in ("lowerable_effects", "ordered_effects", "control_flow_allowed_effects",
                      "custom_derivatives_allowed_effects", "remat_allowed_effects"):
            getattr(effects, kinds).add_type(CommEffect)
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(_HANDLER), platform="cpu", api_version=1)

        prim = core.Primitive("commlib_host_call")
        prim.multiple_results = True

        def abstract(*args: Any, call: _Call) -> tuple[list, set]:
            return [core.ShapedArray(s.shape, s.dtype) for s in call.outs], {effect}

        prim.def_effectful_abstract_eval(abstract)
        prim.def_impl(lambda *args, **params: dispatch.apply_primitive(prim, *args, **params))
        ffi_rule = jax.ffi.ffi_lowering(_TARGET, has_side_effect=True)

        def lower(ctx: Any, *args: Any, call: _Call) -> Any:
            token = ctx.tokens_in.get(effect)
            # the call, a host callback of the executable: kept alive as long as it is, and XLA:CPU then
            # runs the executable on the dispatching thread, as it runs io_callback's, so that the host
            # state a call changes (a strategy's residuals, its timings) is there when the function returns
            ctx.module_context.add_host_callback(call)
            ctx2 = dataclasses.replace(ctx, avals_in=[core.abstract_token, *ctx.avals_in],
                                       avals_out=[core.abstract_token, *ctx.avals_out])
            token_out, *results = ffi_rule(ctx2, token, *args, cid=np.int64(call.key))
            ctx.set_tokens_out(mlir.TokenSet({effect: token_out}))
            return results

        mlir.register_lowering(prim, lower, platform="cpu")
        from jax._src.interpreters import batching

        def refuse_batching(*_: Any, **__: Any) -> Any:
            raise NotImplementedError(
                "commlib's collectives inside jax.jit are one host call per call, not one per batch "
                "element: call them outside jax.vmap (on the whole batched array: the ranks' arrays "
                "are reduced elementwise), not under vmap, pmap or shard_map")

        batching.primitive_batchers[prim] = refuse_batching    # (JAX's own message named no one)
        return prim, "ffi"
    except Exception as e:  # noqa: BLE001 - another JAX: io_callback then
        return None, f"io_callback ({type(e).__name__}: {e})"


_PRIM, MECHANISM = _setup()
#: ``"ffi"`` where :func:`host_call` is the FFI custom call on the CPU backend, else ``"io_callback
#: (why)"``


def host_call(fn: Callable[..., Any], results: Any, *args: Any, into: bool = False) -> Any:
    """``fn(*args)`` on the host, in program order, inside ``jax.jit``: ``io_callback(fn, results,
    *args, ordered=True)`` on XLA's own buffers.

    ``args`` and ``results`` are pytrees (``results`` of ``jax.ShapeDtypeStruct``); ``fn`` gets
    ``args`` with numpy arrays for leaves (read-only views, valid during the call) and returns
    ``results``' structure (numpy arrays or scalars), or with ``into=True`` gets after them the
    results' leaves, numpy views of XLA's result buffers, to write, and returns nothing.

    Example:
        >>> y = host_call(lambda x, out: comm.allreduce(x, out=out), jax.ShapeDtypeStruct(x.shape, x.dtype),
        ...               x, into=True)
    """
    tree_util = jax.tree_util
    leaves, args_tree = tree_util.tree_flatten(args)
    specs, results_tree = tree_util.tree_flatten(results)
    outs = tuple((tuple(r.shape), np.dtype(r.dtype)) for r in specs)

    def host(arrays: Sequence[np.ndarray], rets: Sequence[np.ndarray] = ()) -> Any:
        return fn(*tree_util.tree_unflatten(args_tree, arrays), *rets)

    if _PRIM is None or jax.default_backend() != "cpu":
        from jax.experimental import io_callback

        def run(*arrays: Any) -> list[np.ndarray]:      # (io_callback may pass jax arrays)
            rets = [np.empty(s, d) for s, d in outs]
            _Call(host, (), (), into).run([np.asarray(a) for a in arrays], rets)
            return rets

        got = io_callback(run, specs, *leaves, ordered=True)
    else:
        call = _Call(host, [(tuple(a.shape), np.dtype(a.dtype)) for a in leaves], outs, into)
        _CALLS[call.key] = call
        got = _PRIM.bind(*leaves, call=call)
    return tree_util.tree_unflatten(results_tree, list(got))
