"""Horovod's asynchronous collectives and their handles (``allreduce_async``, ``poll``, ``synchronize``).

Every call queues one request on the engine (:mod:`.engine`) and returns an ``int``
handle at once; :func:`poll` is False until the engine ran it.  Requests run on every
rank in the order each rank submits them, checked across ranks first: a mismatch
raises :class:`HorovodInternalError` on every rank.  A name may be used by one
outstanding operation at a time (``ValueError`` otherwise).

Example:
    >>> h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum)
    >>> hvd.poll(h)                # False right after submitting
    >>> hvd.synchronize(h)         # tensor([2., 2., 2.]) on 2 ranks
"""

from __future__ import annotations

import itertools
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from . import basics
from .basics import Adasum, Average, ProcessSet, Sum, global_process_set, size
from .engine import DTYPES, Request

__all__ = [
    "poll", "synchronize", "allreduce_async", "allreduce_async_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_", "alltoall_async",
    "reducescatter_async",
]

_counter = itertools.count(1)


# ---------------------------------------------------------------------- handles
def check_process_set(process_set: Any) -> None:
    if process_set is not global_process_set:
        raise NotImplementedError("commlib.horovod supports only the global process set")


def resolve_op(average: bool | None, op: int | None) -> int:
    """Horovod's ``average=`` (deprecated) and ``op=`` to one reduce op (default Average)."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        op = Average if average else Sum
    if op is None:
        op = Average
    if op == Adasum:
        raise NotImplementedError("commlib.horovod: Adasum is not supported (use op=hvd.Average)")
    if op not in basics.OP_NAMES:
        raise ValueError(f"op {op!r}: expected hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


def op_name(average: bool | None, op: int | None) -> str:
    return basics.OP_NAMES[resolve_op(average, op)]


def _problem(tensor: Any) -> str | None:
    if not torch.is_tensor(tensor):
        return f"expected a torch.Tensor, got {type(tensor).__name__}"
    if tensor.dtype not in DTYPES:
        return f"dtype {tensor.dtype} is not supported"
    if tensor.is_sparse:
        return "sparse tensors are not supported (convert with .to_dense())"
    return None


def submit(req: Request) -> int:
    engine = basics.engine()
    if req.problem is None and req.tensor is not None:
        req.problem = _problem(req.tensor)
        if req.problem is not None and not torch.is_tensor(req.tensor):
            raise TypeError(req.problem)
    with basics.lock:
        # outstanding = submitted and not yet synchronized: the same on every rank running the same
        # program, whereas "not finished yet" depends on timing (one rank raising, another submitting)
        if req.name is not None:
            if req.name in basics.names:
                raise ValueError(f"Duplicate name: an operation named {req.name!r} is outstanding (not yet "
                                 "synchronized); names must be unique among outstanding operations")
            basics.names.add(req.name)
        handle = next(_counter)
        basics.handles[handle] = req
    engine.submit(req)
    return handle


class Group:
    """The requests behind one handle of a grouped operation (:func:`grouped_allreduce_async`)."""

    def __init__(self, reqs: list[Request]):
        self.reqs = reqs


def submit_group(reqs: list[Request]) -> int:
    """Queue ``reqs`` under one handle: :func:`synchronize` returns their results as a list.

    What :func:`submit` refuses at the call (a non-tensor, a name outstanding) is refused for the
    whole group before any of it is queued, so that no rank runs part of a group.

    Example:
        >>> h = submit_group([Request("allreduce", a), Request("allreduce", b)]); hvd.synchronize(h)
    """
    for req in reqs:
        if not torch.is_tensor(req.tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(req.tensor).__name__}")
    named = [req.name for req in reqs if req.name is not None]
    with basics.lock:
        taken = [n for n in named if n in basics.names]
    if taken or len(set(named)) < len(named):
        raise ValueError(f"Duplicate name: an operation named {(taken or named)[0]!r} is outstanding (not "
                         "yet synchronized); names must be unique among outstanding operations")
    inner = [submit(req) for req in reqs]
    with basics.lock:
        for h in inner:
            basics.handles.pop(h, None)
        handle = next(_counter)
        basics.handles[handle] = Group(reqs)
    return handle


def poll(handle: int) -> bool:
    """True once the operation of ``handle`` has finished (then :func:`synchronize` does not block);
    for a grouped operation's handle, once all of them have.

    Example:
        >>> h = hvd.allreduce_async(t); hvd.poll(h)
        False
    """
    req = basics.handles.get(handle)
    if req is None:
        raise ValueError(f"poll: unknown handle {handle!r}")
    if isinstance(req, Group):
        return all(r.done.is_set() for r in req.reqs)
    return req.done.is_set()


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its result (``None`` for an unknown handle);
    for a grouped operation's handle, the list of its results.

    Example:
        >>> summed = hvd.synchronize(hvd.allreduce_async(t, op=hvd.Sum))
        >>> a2, b2 = hvd.synchronize(hvd.grouped_allreduce_async([a, b], op=hvd.Sum))
    """
    entry = basics.handles.get(handle)
    if entry is None:
        return None
    reqs = entry.reqs if isinstance(entry, Group) else [entry]
    for req in reqs:
        req.done.wait()
    with basics.lock:
        basics.handles.pop(handle, None)
        for req in reqs:
            basics.names.discard(req.name)
    for req in reqs:
        if req.error is not None:
            raise req.error
    return [req.result for req in reqs] if isinstance(entry, Group) else entry.result


# ---------------------------------------------------------------------- asynchronous operations
def _bool_average(tensor: Any, op: str, kind: str) -> str | None:
    """Why ``kind`` refuses ``tensor`` under ``op``: averaging bool tensors has no bool result
    (Horovod reduces no bool tensors); the logical ops (Sum: or, Min/Product: and, Max: or) do."""
    if op == "average" and torch.is_tensor(tensor) and tensor.dtype == torch.bool:
        return (f"{kind}: op=Average is not defined for bool tensors; use hvd.Sum or hvd.Max (logical or), "
                "hvd.Min or hvd.Product (logical and), or convert the tensor to a number type")
    return None


def _allreduce_request(tensor: torch.Tensor, inplace: bool, name: str | None, name_op: str,
                       prescale_factor: float, postscale_factor: float) -> Request:
    """The request of one all-reduce (a bool tensor under Average is rejected on every rank)."""
    return Request("allreduce", tensor, inplace, name, name_op, float(prescale_factor),
                   float(postscale_factor), problem=_bool_average(tensor, name_op, "allreduce"))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an all-reduce of ``tensor`` into a new tensor (default ``op=Average``); returns a handle.

    Example:
        >>> h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum); hvd.synchronize(h)
    """
    check_process_set(process_set)
    return submit(_allreduce_request(tensor, False, name, op_name(average, op), prescale_factor,
                                     postscale_factor))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`allreduce_async`: ``tensor`` holds the result after :func:`synchronize`.

    Example:
        >>> h = hvd.allreduce_async_(grad, name="fc1.weight"); hvd.synchronize(h)
    """
    check_process_set(process_set)
    return submit(_allreduce_request(tensor, True, name, op_name(average, op), prescale_factor,
                                     postscale_factor))


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """All-reduce a list of tensors together (fused where they agree); returns one handle, whose
    :func:`synchronize` returns the list of results (Horovod 0.28).

    Example:
        >>> h = hvd.grouped_allreduce_async([a, b], op=hvd.Sum); a2, b2 = hvd.synchronize(h)
    """
    check_process_set(process_set)
    name_op = op_name(average, op)
    names = [None if name is None else f"{name}.{i}" for i in range(len(tensors))]
    return submit_group([_allreduce_request(t, False, n, name_op, prescale_factor, postscale_factor)
                         for t, n in zip(tensors, names)])


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`grouped_allreduce_async`: one handle; the tensors hold the results after
    :func:`synchronize` (which returns them as a list).

    Example:
        >>> hvd.synchronize(hvd.grouped_allreduce_async_([a, b]))
    """
    check_process_set(process_set)
    name_op = op_name(average, op)
    names = [None if name is None else f"{name}.{i}" for i in range(len(tensors))]
    return submit_group([_allreduce_request(t, True, n, name_op, prescale_factor, postscale_factor)
                         for t, n in zip(tensors, names)])


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (first dimensions may differ).

    Example:
        >>> hvd.synchronize(hvd.allgather_async(torch.full((hvd.rank() + 1, 2), hvd.rank())))
    """
    check_process_set(process_set)
    return submit(Request("allgather", tensor, False, name))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start giving every rank ``root_rank``'s ``tensor`` (a new tensor).

    Example:
        >>> w = hvd.synchronize(hvd.broadcast_async(w, root_rank=0))
    """
    check_process_set(process_set)
    return submit(Request("broadcast", tensor, False, name, root=int(root_rank)))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`broadcast_async`.

    Example:
        >>> hvd.synchronize(hvd.broadcast_async_(w, root_rank=0))
    """
    check_process_set(process_set)
    return submit(Request("broadcast", tensor, True, name, root=int(root_rank)))


def alltoall_async(tensor: torch.Tensor, splits: torch.Tensor | Sequence[int] | None = None,
                   name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start sending rows of ``tensor`` to each rank (``splits[r]`` rows to rank r; equal parts by default).

    :func:`synchronize` returns ``(output, received_splits)``.

    Example:
        >>> out, got = hvd.synchronize(hvd.alltoall_async(x, torch.tensor([1, 3], dtype=torch.int32)))
    """
    check_process_set(process_set)
    n = size()
    problem, split_list = None, None
    if splits is not None:      # a tensor of integers (Horovod's int32, or any), or a list of them
        given = splits.reshape(-1).tolist() if torch.is_tensor(splits) else list(splits)
        if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in given):
            raise ValueError(f"alltoall: splits must be integers (a tensor or a list), got {splits!r}")
        split_list = [int(s) for s in given]
    first = tensor.shape[0] if tensor.dim() else 1
    if split_list is None and first % n:
        problem = f"alltoall: the first dimension ({first}) is not a multiple of the number of ranks ({n})"
    elif split_list is not None and (len(split_list) != n or min(split_list) < 0 or sum(split_list) > first):
        problem = (f"alltoall: splits {split_list} must be {n} non-negative counts summing to at most "
                   f"the first dimension ({first})")
    elif split_list is not None and sum(split_list) < first:
        tensor = tensor[:sum(split_list)]
    return submit(Request("alltoall", tensor, False, name, splits=split_list, problem=problem))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over ranks and giving rank r its part of dimension 0
    (the first ``n % size`` ranks one row more).

    Example:
        >>> part = hvd.synchronize(hvd.reducescatter_async(torch.ones(4, 3), op=hvd.Sum))
    """
    check_process_set(process_set)
    name_op = op_name(None, op)
    if name_op not in ("average", "sum"):
        raise ValueError("reducescatter: op must be hvd.Average or hvd.Sum")
    return submit(Request("reducescatter", tensor, False, name, name_op, float(prescale_factor),
                           float(postscale_factor), problem=_bool_average(tensor, name_op, "reducescatter")))


