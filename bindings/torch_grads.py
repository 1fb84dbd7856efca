"""Gradients that a sharded strategy leaves in ``.grad``: norms read as the global gradient's.

After ``backward()`` under ``DeAR``, each rank's ``.grad`` holds the gradient averaged over
ranks only on its own shard of each bucket (the part its update reads); the rest is its own
pass, never sent.  Code written for one process or for DDP reads norms of ``.grad``: torch's
``clip_grad_norm_`` and ``get_total_norm`` (per tensor, then the norm of those), a logged
``p.grad.norm()``.  So that these read the norm one process computes on the whole batch, as
FSDP2's DTensor gradients do, each parameter's ``.grad`` is a :class:`ShardedGrad` (a plain
tensor to everything else) whose full norms are taken over the ranks' shards
(:class:`ShardNorms`): every parameter's 2-norm comes with the reduction, in the small
all-reduce that already agreed on non-finite gradients, and follows the in-place scalings
``.grad`` goes through next (GradScaler's unscale, clipping's multiply), so that reading it
never communicates.  A norm of another order, or one read after another change of ``.grad``,
is gathered when read: a call every rank makes (as with DTensor), outside the operations'
order, so that a read on some ranks only fails on every rank, naming it.  Any other read of
``.grad``'s values (a norm over some dimensions, a matrix norm, ``p.grad.sum()``,
``torch.isfinite(p.grad)``, ``print(p.grad)``, gradient centralization's mean) first makes
``.grad`` the whole average on every rank (``opt.synchronize()``: one all-gather, in a call
every rank makes likewise), then reads it as it is.  In-place writes that read no gradient
(``clip_grad_value_``'s clamp, ``g[mask] = 0``, ``g.add_(noise)``) stay elementwise on the
shards the update reads, and communicate nothing.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

import commlib

from .torch_params import METADATA

__all__ = ["ShardNorms", "ShardedGrad", "GradientClipping"]


class ShardNorms:
    """The global norms of the parameters' gradients, from this rank's shard parts.

    ``parts``: ``(parameter index, 1-D slice of a flat gradient on this rank's shard)``;
    ``flat_grads``: the buckets' flat gradients, whose version counters say when ``.grad``
    changed.  :meth:`settle` (after the reduction, on every rank) takes every parameter's 2-norm
    in one small all-reduce; the norms follow the in-place scalings ``.grad`` goes through next
    (GradScaler's unscale, clipping's multiply: :meth:`rescale`), so that reading them needs no
    communication.  A norm of another order, or after another change of ``.grad``, is taken
    when read, in a call every rank makes (``Communicator.allgather_object``).

    Example:
        >>> norms = ShardNorms(comm, n_params, parts, flat_grads)
        >>> largest = norms.settle()        # collective: after the reduce-scatter
        >>> norms.of(3, 2.0)                # the 2-norm of parameter 3's averaged gradient
    """

    def __init__(self, comm: commlib.Communicator, n_params: int,
                 parts: list[tuple[int, torch.Tensor]], flat_grads: list[torch.Tensor],
                 whole: Callable[[], None]) -> None:
        self.comm = comm
        self.n_params = n_params
        self.parts = parts
        self.flat_grads = flat_grads
        self._whole = whole
        #: set while ``.grad`` holds the average on the shards (see the training loop)
        self.active = False
        self._cached: dict[float, torch.Tensor] = {}    # order -> every parameter's norm (float64)
        self._versions: tuple[int, ...] = ()            # the flat gradients' versions they are of
        self._scalings: list[tuple[int, Any]] = []      # (parameter, factor) since, not yet applied

    def _now(self) -> tuple[int, ...]:
        return tuple(g._version for g in self.flat_grads)

    def current(self) -> bool:
        """Whether the norms held are those of ``.grad`` as it is."""
        return bool(self._cached) and self._versions == self._now()

    def settle(self) -> float:
        """After the reduction (collective): every parameter's 2-norm; returns the largest, which is
        not finite when some element of the averaged gradient is not (NaN where one is NaN, else
        inf, as one process's norm reads; then nothing is held)."""
        norms = self._over_ranks(2.0, in_order=True)
        largest = float(norms.max()) if len(norms) else 0.0
        finite = math.isfinite(largest)
        self._cached, self._versions = ({2.0: norms}, self._now()) if finite else ({}, ())
        self._scalings = []
        return largest

    def of(self, index: int, ord: float) -> torch.Tensor:
        """The ``ord``-norm of parameter ``index``'s averaged gradient (float64, 0-d); a collective
        unless held (see the class)."""
        if not self.current():
            self._cached, self._versions, self._scalings = {}, self._now(), []
        self._apply_scalings()
        if ord not in self._cached:
            self._cached[ord] = self._over_ranks(ord, in_order=False)
        return self._cached[ord][index]

    def read_values(self) -> None:
        """Code reads the values of ``.grad`` (not a norm of them): every rank agrees that it does,
        in a labeled call (a read on some ranks only fails on every rank, naming it), then ``whole``
        makes ``.grad`` the whole average everywhere (one all-gather) and the read is local."""
        self.comm.allgather_object(None, label=_VALUES)
        self._whole()

    def rescale(self, indices: list[int], factors: list[Any]) -> None:
        """Gradients ``indices`` were just multiplied in place by ``factors`` (numbers or
        one-element tensors); call only when :meth:`current` held before the multiplication.
        A norm scales by ``|factor|`` (an infinite or NaN factor too, as one process's norm
        does), applied when next read; the count of non-zero elements (order 0) is dropped."""
        self._cached.pop(0.0, None)
        self._scalings += zip(indices, factors)
        self._versions = self._now()

    def _apply_scalings(self) -> None:
        by_factor: dict[int, tuple[Any, list[int]]] = {}    # the same factor object: one op
        for i, f in self._scalings:
            by_factor.setdefault(id(f), (f, []))[1].append(i)
        self._scalings = []
        for norms in self._cached.values():
            for f, idx in by_factor.values():
                m = f.abs().to(norms.device) if isinstance(f, torch.Tensor) else abs(float(f))
                if len(set(idx)) == len(idx):
                    norms[torch.tensor(idx, device=norms.device)] *= m
                else:                       # a gradient scaled twice by it
                    for i in idx:
                        norms[i] *= m

    def _over_ranks(self, ord: float, in_order: bool) -> torch.Tensor:
        """Every parameter's ``ord``-norm from the ranks' shard parts.  ``in_order``: inside the
        step's reduction, an operation in the communicator's order; else a read, outside that
        order: a labeled call every rank must make, so that a read made on some ranks only (a
        norm logged on rank 0) fails on every rank, naming it, instead of meeting another
        collective inside MPI."""
        combine = {float("inf"): "max", float("-inf"): "min"}.get(ord, "sum")
        ufunc = {"max": np.maximum, "min": np.minimum, "sum": np.add}[combine]    # parts, then ranks
        local = np.full(self.n_params, float("inf") if combine == "min" else 0.0)
        if self.parts:
            parts = [g.abs() if g.is_complex() else g for _, g in self.parts]     # complex: |z|'s norm
            values = torch.stack(torch._foreach_norm(parts, ord, dtype=torch.float64))
            if combine == "sum" and ord != 0:
                values = values.pow(ord)
            ufunc.at(local, [i for i, _ in self.parts], values.cpu().numpy())    # one may span buckets
        if in_order:
            total = torch.from_numpy(self.comm.allreduce(local, combine, tag="gradnorm"))
        else:
            total = torch.from_numpy(ufunc.reduce(np.stack(self.comm.allgather_object(local, label=_READ))))
        if combine == "sum" and ord != 0:
            total = total.pow(1.0 / ord)
        return total.to(self.flat_grads[0].device)


_READ = "a norm of DeAR's sharded .grad (clip_grad_norm_, get_total_norm, .norm())"
_VALUES = "a read of DeAR's sharded .grad's values (p.grad.sum(), print(p.grad)...), which gathers them"
_NOT_HELD = object()    # a norm the shards' norms do not give
#: the dtype of a complex tensor's norm
_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}
_NORMS = {torch.linalg.vector_norm, torch.linalg.norm, torch.norm, torch.Tensor.norm, torch._foreach_norm}


class ShardedGrad(torch.Tensor):
    """A parameter's ``.grad`` under a sharded strategy: a full norm reads the norm of the gradient
    averaged over ranks, and any other read of its values first gathers the whole average (see
    the module).

    Example:
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)    # DeAR: the global norm
    """

    _norms: weakref.ref[ShardNorms]
    _index: int

    @staticmethod
    def of(view: torch.Tensor, norms: ShardNorms, index: int) -> ShardedGrad:
        """``view`` (parameter ``index``'s gradient in its bucket) as a ShardedGrad."""
        g = view.as_subclass(ShardedGrad)
        g._norms, g._index = weakref.ref(norms), index
        return g

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():      # what runs here sees plain tensors
            if func in _NORMS:
                out = _global_norm(func, args, kwargs)
                if out is not None and out is not _NOT_HELD:
                    return out
            elif func in _SCALINGS:
                scaled = _scalings(func, args, kwargs)
                held = {id(n): (n, n.current()) for n, _, _ in scaled}
                out = func(*args, **kwargs)
                for norms, current in held.values():
                    if current:
                        mine = [(i, f) for n, i, f in scaled if n is norms]
                        norms.rescale([i for i, _ in mine], [f for _, f in mine])
                return out
            norms = _reader(func, args, kwargs)
            if norms is not None:       # values of the shards and of this rank's own pass: the whole first
                norms.read_values()
            return func(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:      # saved as the plain tensor it is
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:     # a copied model's gradient is its own
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).clone()


_SCALINGS = {torch.Tensor.mul_, torch.Tensor.div_, torch._foreach_mul_, torch._foreach_div_,
             torch._amp_foreach_non_finite_check_and_unscale_}


def _scalings(func: Any, args: Any, kwargs: dict) -> list[tuple[ShardNorms, int, Any]]:
    """The live gradients that ``func`` multiplies in place by a scalar, with the factor: GradScaler's
    unscale, clipping's multiply (the norms held follow them); [] for any other change."""
    if func is torch._amp_foreach_non_finite_check_and_unscale_:
        tensors, factors = args[0], [args[2]] * len(args[0])
    elif kwargs.get("rounding_mode") is not None:
        return []
    else:
        other = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("scalar", kwargs.get("scalars")))
        tensors = args[0] if func in (torch._foreach_mul_, torch._foreach_div_) else [args[0]]
        factors = list(other) if isinstance(other, (list, tuple)) else [other] * len(tensors)
    out = []
    for t, f in zip(tensors, factors):
        norms = _live(t)
        scalar = (isinstance(f, numbers.Real) and not isinstance(f, bool)) or (
            isinstance(f, torch.Tensor) and f.numel() == 1)
        if norms is None:
            continue
        if not scalar:
            return []
        if func in (torch.Tensor.div_, torch._foreach_div_):
            f = 1.0 / f
        out.append((norms, t._index, f))
    return out


def _reader(func: Any, args: Any, kwargs: dict) -> ShardNorms | None:
    """The norms of a live gradient whose values ``func`` reads; None for metadata and for the
    gradients an in-place operation only writes (``clip_grad_value_``'s clamp, ``g[mask] = 0``, a
    ``mul_``: elementwise, right on the shards the update reads)."""
    if func in METADATA:
        return None
    name = getattr(func, "__name__", "")
    inplace = (name.endswith("_") and not name.endswith("__")) or func is torch.Tensor.__setitem__
    written = args[0] if inplace and args else ()
    written = {id(t) for t in written} if isinstance(written, (list, tuple)) else {id(written)}
    for t in tree_leaves((args, kwargs)):
        norms = _live(t) if id(t) not in written else None
        if norms is not None:
            return norms
    return None


def _live(t: Any) -> ShardNorms | None:
    """``t``'s norms while ``.grad`` is sharded (not a copy, nor read outside a sharded phase)."""
    if not isinstance(t, ShardedGrad):
        return None
    norms = t._norms()
    return norms if norms is not None and norms.active else None


def _order(ord: Any) -> float | None:
    if ord is None or ord == "fro":
        return 2.0
    if isinstance(ord, (int, float)) and not isinstance(ord, bool) and (ord >= 0 or ord == float("-inf")):
        return float(ord)
    return None


def _global_norm(func: Any, args: Any, kwargs: dict) -> Any:
    """The norm ``func(*args, **kwargs)`` of averaged gradients; None where it is not one of them;
    ``_NOT_HELD`` where it is one that the shards' norms do not give (over some dimensions, a matrix
    norm, a negative order): a read of the values."""
    if func is torch.linalg.vector_norm and not kwargs and len(args) <= 2:     # clip_grad_norm_'s
        t, norms, ord = args[0], _live(args[0]), _order(args[1] if len(args) > 1 else 2)
        if norms is not None and ord is not None:
            return norms.of(t._index, ord).to(device=t.device, dtype=_REAL.get(t.dtype, t.dtype))
    if func is torch._foreach_norm:     # plain tensors among them (another optimizer's): their own norm
        tensors, ord = args[0], (args[1] if len(args) > 1 else kwargs.get("ord", 2))
        live, dtype = [_live(t) for t in tensors], kwargs.get("dtype")
        if not any(live):
            return None
        if _order(ord) is None:
            return _NOT_HELD
        return [n.of(t._index, _order(ord)).to(device=t.device, dtype=dtype or _REAL.get(t.dtype, t.dtype))
                if n is not None
                else torch.linalg.vector_norm(t, ord, dtype=dtype) for n, t in zip(live, tensors)]
    names = ("input", "p" if func in (torch.norm, torch.Tensor.norm) else "ord", "dim", "keepdim")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    t = bound.get("input", bound.get("A", bound.get("x", bound.get("self"))))
    norms = _live(t)
    if norms is None:
        return None
    ord = bound.get("p" if func in (torch.norm, torch.Tensor.norm) else "ord")
    if func is torch.linalg.norm and ord is not None and t.dim() == 2:
        ord = "matrix"      # a matrix norm: not a function of the shards' norms
    dim = bound.get("dim")
    whole = dim is None or sorted(d % t.dim() for d in ([dim] if isinstance(dim, int) else dim)) == list(
        range(t.dim()))
    if _order(ord) is None or not whole:
        return _NOT_HELD
    out = norms.of(t._index, _order(ord)).to(device=t.device, dtype=bound.get("dtype") or t.dtype)
    if bound.get("keepdim"):
        out = out.reshape([1] * t.dim())
    return out


class GradientClipping:
    """Mixin of :class:`bindings.torch.DistributedOptimizer`: ``opt.clip_grad_norm_(max_norm,
    norm_type)`` clips by the global norm of the gradient the update uses (sharded strategies: one
    scalar per rank gathered).  Uses the optimizer's buckets and flat gradients."""

    comm: Any
    buckets: list[Any]
    _flat_grads: list[torch.Tensor]
    _sharded: bool
    _gathered: bool
    _reduce: Callable[[], None]

    @torch.compiler.disable
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients the update will use by their global norm; return that norm (as torch's).

        The norm is the one single-process training computes on the
        concatenated batch: that of the averaged gradient.  Full-gradient
        strategies (``AllReduce``, ``SparseAllReduce``: the exchanged gradient;
        ``SelSync`` and ``SyncSwitch`` on synchronous steps) need no
        communication; a sharded strategy (``DeAR``) sums its shards' norms
        through one small all-gather (a scalar per rank, as FSDP's all-reduce).
        On a gate's local step (SelSync without sync, Sync-Switch's ASP/SSP)
        each rank clips its own gradient.
        A bad ``max_norm`` or ``norm_type`` raises before any collective
        (sharded: on every rank, even when only one rank's is bad, through the
        norm's own small all-gather).

        Example:
            >>> scaler.unscale_(opt)                # under a GradScaler: unscale first
            >>> norm = opt.clip_grad_norm_(1.0)
        """
        problem = ""
        if not (isinstance(max_norm, numbers.Real) and max_norm >= 0):
            problem = f"max_norm {max_norm!r}: expected a number >= 0"
        if not (isinstance(norm_type, numbers.Real) and norm_type > 0):
            problem = f"norm_type {norm_type!r}: expected a number > 0 or inf"
        sharded = self._sharded and not self._gathered and self.comm.size > 1
        if problem and not sharded:          # no collective here: raise before any
            raise ValueError(f"clip_grad_norm_: {problem}")
        self._reduce()
        self._adopt_assigned()      # a .grad assigned since is what the update reads: clipped with the rest
        p = float(norm_type) if not problem else 2.0
        if sharded:
            rank = self.comm.rank
            parts = [g[b.shard(rank)] for b, g in zip(self.buckets, self._flat_grads)]
        else:
            parts = list(self._flat_grads)
        norms = torch.stack([torch.linalg.vector_norm(g, p) for g in parts]).double()
        if sharded:     # each rank's part of the norm and its problem, in one small all-gather
            local = norms.max() if p == float("inf") else norms.pow(p).sum()
            row = torch.stack([local, torch.tensor(float(bool(problem)), dtype=torch.float64)])
            table = self.comm.allgather(row, tag="gradnorm")
            if table[:, 1].any():
                raise ValueError("clip_grad_norm_: ranks " + ", ".join(
                    str(r) for r in range(self.comm.size) if table[r, 1]) + " rejected their arguments"
                    + (f" (here: {problem})" if problem else ""))
            total = table[:, 0].max() if p == float("inf") else table[:, 0].sum().pow(1.0 / p)
        else:
            total = torch.linalg.vector_norm(norms, p)
        total = total.to(parts[0].dtype)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for b, g in zip(self.buckets, self._flat_grads):
            g[:b.numel].mul_(coef.to(g.dtype))     # not the padding: 0 * NaN would stay in it for good
        return total
