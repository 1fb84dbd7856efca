"""Collectives on JAX arrays inside ``jax.jit`` and under ``jax.grad`` (mpi4jax's calls, on commlib).

Outside any transformation these are the communicator's own calls (``comm.allreduce(x)`` takes
and returns jax arrays).  On a traced value (inside ``jax.jit``, ``jax.grad``) each is an ordered
host call (:mod:`commlib.bindings.jax_host`: an XLA FFI call on XLA's own buffers on the CPU
backend, else ``io_callback``): the compiled step runs it in program order, once per call, on a
communicator of its own (``comm.split(0)``, made collectively the first time a call is traced: trace on every
rank, from the thread that drives ``comm``), so that it never interleaves with eager calls on
``comm`` that JAX's asynchronous dispatch lets run beside the step.

Reverse-mode derivatives are those of the sum of every rank's objective (mpi4jax's all-reduce
passes the cotangent through instead: ``size`` times less for a loss every rank computes): the
cotangent of an ``allreduce`` with ``"sum"`` (``"avg"``) is the same all-reduce of the ranks'
cotangents; of an ``allgather``, this rank's row of their sum; of a ``broadcast``, their sum on
the root and zeros elsewhere.  ``"max"`` and ``"min"`` are not differentiable (``TypeError``
when differentiated).  Not under ``vmap``, ``pmap`` or ``shard_map``.

Example (under ``mpiexec -n 4``):

    >>> from commlib.bindings.jax import allreduce
    >>> @jax.jit
    ... def eval_step(params, x, y):
    ...     return allreduce(loss(params, x, y), "avg")     # the mean over ranks, inside jit
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import jax
import jax.numpy as jnp
import numpy as np

import commlib
from commlib.arrays import DTYPES, dtype_name, is_tracer
from commlib.bindings.jax_host import host_call
from commlib.errors import ValidationError
from commlib.ops import check_reduce_op

_JIT_COMMS: WeakKeyDictionary = WeakKeyDictionary()      # comm -> the communicator of its traced calls


def allreduce(x: Any, op: str = "sum", comm: commlib.Communicator | None = None) -> jax.Array:
    """Reduce ``x`` over the ranks with ``op`` (``"sum"``, ``"avg"``, ``"max"``, ``"min"``); every
    rank gets the result.  Eager, inside ``jax.jit`` and differentiable (``"sum"``, ``"avg"``).

    Example:
        >>> mean_loss = allreduce(loss, "avg")      # inside a jitted step too
    """
    comm = _checked("allreduce", x, comm, lambda _: check_reduce_op(op, dtype_name(x.dtype), "allreduce"))
    if not is_tracer(x):        # a concrete value is never differentiated: the call itself
        return _eager(comm.allreduce(x, op), x.shape)

    @jax.custom_vjp
    def run(v: Any) -> Any:
        return _call(comm, v, v.shape, lambda c, a, out: c.allreduce(a, op, out=out))

    def backward(_: Any, ct: Any) -> tuple[Any]:
        if op not in ("sum", "avg"):
            raise TypeError(f"allreduce(op={op!r}) is not differentiable (only 'sum' and 'avg' are)")
        return (_call(comm, ct, ct.shape, lambda c, a, out: c.allreduce(a, op, out=out)),)

    run.defvjp(lambda v: (run(v), None), backward)
    return run(x)


def allgather(x: Any, comm: commlib.Communicator | None = None) -> jax.Array:
    """Every rank's ``x``, stacked: shape ``(size, *x.shape)``, row ``r`` from rank ``r``.  Eager,
    inside ``jax.jit`` and differentiable.

    Example:
        >>> table = allgather(jnp.array([n_correct, n_seen]))     # (size, 2)
    """
    comm = _checked("allgather", x, comm)
    if not is_tracer(x):
        return _eager(comm.allgather(x), (comm.size, *x.shape))
    rank = comm.rank

    @jax.custom_vjp
    def run(v: Any) -> Any:
        return _call(comm, v, (comm.size, *v.shape), lambda c, a, out: c.allgather(a, out=out))

    def backward(_: Any, ct: Any) -> tuple[Any]:
        return (_call(comm, ct, ct.shape, lambda c, a, out: c.allreduce(a, "sum", out=out))[rank],)

    run.defvjp(lambda v: (run(v), None), backward)
    return run(x)


def broadcast(x: Any, root: int = 0, comm: commlib.Communicator | None = None) -> jax.Array:
    """Rank ``root``'s ``x`` on every rank (the others' ``x`` gives the shape and dtype).  Eager,
    inside ``jax.jit`` and differentiable.

    Example:
        >>> params = jax.tree.map(lambda p: broadcast(p, 0), params)
    """
    def check_root(c: commlib.Communicator) -> None:
        if (isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer))
                or not 0 <= root < c.size):
            raise ValidationError(f"broadcast: root {root!r}: expected an int in [0, {c.size})")

    comm = _checked("broadcast", x, comm, check_root)
    root = int(root)        # numpy's integers too, as the communicator's broadcast takes them
    if not is_tracer(x):
        return _eager(comm.broadcast(x, root), x.shape)
    mine = comm.rank == root

    @jax.custom_vjp
    def run(v: Any) -> Any:
        return _call(comm, v, v.shape, lambda c, a, out: c.broadcast(a, root, out=out))

    def backward(_: Any, ct: Any) -> tuple[Any]:
        summed = _call(comm, ct, ct.shape, lambda c, a, out: c.allreduce(a, "sum", out=out))
        return (summed if mine else jnp.zeros_like(summed),)

    run.defvjp(lambda v: (run(v), None), backward)
    return run(x)


def _checked(name: str, x: Any, comm: commlib.Communicator | None,
             check: Callable[[commlib.Communicator], None] = lambda _: None) -> commlib.Communicator:
    """The communicator, once ``x`` is an array of a dtype commlib carries and ``check(comm)`` (the
    operation's own arguments) passes.  Else this rank refuses the call on the communicator the
    call would run on (the one of traced calls for a traced ``x``), so that peers whose inputs
    were valid raise too instead of pairing their call with this rank's next (a bad ``op`` on
    one rank; on every rank, each raises it alike, while tracing)."""
    comm = commlib.as_communicator(comm, name)
    try:
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise ValidationError(f"{name}: expected a jax or numpy array, got {type(x).__name__}")
        if dtype_name(x.dtype) not in DTYPES:
            raise ValidationError(f"{name}: dtype {x.dtype} is not carried (expected one of "
                                  f"{', '.join(DTYPES)})")
        check(comm)
    except ValidationError as err:
        (_side(comm) if is_tracer(x) else comm).refuse(name, err)
    return comm


def _eager(result: Any, shape: tuple[int, ...]) -> jax.Array:
    """A concrete call's result as a jax array of ``shape`` (the communicator gives numpy for numpy)."""
    if not isinstance(result, jax.Array):
        result = jnp.asarray(result)
    return result if result.shape == shape else result.reshape(shape)


def _call(comm: commlib.Communicator, x: Any, shape: tuple[int, ...],
          host: Callable[[commlib.Communicator, Any, np.ndarray | None], Any]) -> Any:
    """``host(comm, x, out)`` on concrete values (``out`` None: a new array); on a traced one, an
    ordered host call (:func:`~commlib.bindings.jax_host.host_call`) on the communicator of traced
    calls, reading ``x`` from and writing into XLA's own buffers."""
    if not is_tracer(x):
        return _eager(host(comm, x, None), shape)      # (a backward pass's cotangent, outside jit)
    side = _side(comm)

    def run(a: np.ndarray, out: np.ndarray) -> None:
        host(side, a.reshape(-1) if a.ndim == 0 else a, out.reshape(-1) if out.ndim == 0 else out)

    return host_call(run, jax.ShapeDtypeStruct(shape, x.dtype), x, into=True)


def _side(comm: commlib.Communicator) -> commlib.Communicator:
    """The communicator of ``comm``'s traced calls, split from it at the first call traced (every
    rank, at the same point of the same program)."""
    side = _JIT_COMMS.get(comm)
    if side is None:
        side = _JIT_COMMS[comm] = comm.split(0)
    return side
