"""Horovod's blocking collectives, differentiable through autograd (``hvd.allreduce``...).

The asynchronous forms, handles and process state live in :mod:`.handles` and
:mod:`.basics`; this module re-exports them, so ``horovod.torch.mpi_ops`` imports keep working.

Example:
    >>> x = torch.ones(3, requires_grad=True)
    >>> hvd.allreduce(x, op=hvd.Sum).sum().backward()     # x.grad: size() everywhere
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .basics import *  # noqa: F403 - Horovod's mpi_ops namespace
from .basics import Average, ProcessSet, Sum, global_process_set, rank, size
from .compression import Compression
from .engine import Request
from .handles import *  # noqa: F403
from .handles import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    check_process_set,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    reducescatter_async,
    resolve_op,
    submit,
    synchronize,
)


# ---------------------------------------------------------------------- blocking forms with autograd
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, pre: float, post: float) -> Any:
        ctx.args = (op, pre, post)
        return synchronize(allreduce_async(tensor, None, name, op, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post = ctx.args
        out = synchronize(allreduce_async(grad.contiguous(), None, None, op, pre, post))
        return out, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, pre: float, post: float, *tensors: torch.Tensor) -> Any:
        ctx.args = (op, pre, post)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post = ctx.args
        h = grouped_allreduce_async([g.contiguous() for g in grads], None, None, op, pre, post)
        return (None, None, None, None, *synchronize(h))


# The gradients follow Horovod 0.28's conventions (its torch mpi_ops backward functions), not the
# exact derivative of the sum of the ranks' losses: allgather and broadcast average the upstream
# gradients over ranks, reducescatter gathers them and scales by size() under Sum.
class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> Any:
        ctx.first = tensor.shape[0] if tensor.dim() else 1
        ctx.shape = tensor.shape
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        averaged = synchronize(allreduce_async(grad.contiguous(), op=Average))
        firsts = synchronize(allgather_async(torch.tensor([ctx.first], dtype=torch.int64))).tolist()
        start = sum(firsts[:rank()])
        return averaged.narrow(0, start, ctx.first).reshape(ctx.shape), None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None) -> Any:
        ctx.root = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        averaged = synchronize(allreduce_async(grad.contiguous(), op=Average))
        if rank() != ctx.root:
            averaged = averaged * 0
        return averaged, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: torch.Tensor | None, name: str | None) -> Any:
        out, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> Any:
        out, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received))
        return out, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, pre: float, post: float) -> Any:
        ctx.args = (op, pre, post)
        return synchronize(reducescatter_async(tensor, name, op, global_process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post = ctx.args
        gathered = synchronize(allgather_async(grad.contiguous()))
        factor = pre * post * (size() if op == Sum else 1)
        return gathered * factor, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """All-reduce ``tensor`` (default: average over ranks) into a new tensor; differentiable.

    Example:
        >>> hvd.allreduce(torch.tensor([1.0, 2.0]), op=hvd.Sum)     # 2 ranks: tensor([2., 4.])
    """
    check_process_set(process_set)
    op = resolve_op(average, op)
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce` (not differentiable); returns ``tensor``.

    Example:
        >>> hvd.allreduce_(grad, op=hvd.Average)
    """
    h = allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(h)


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """All-reduce a list of tensors in one fused exchange where they agree; differentiable.

    Example:
        >>> a2, b2 = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    """
    check_process_set(process_set)
    op = resolve_op(average, op)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`; returns the tensors.

    Example:
        >>> hvd.grouped_allreduce_([a, b], op=hvd.Sum)
    """
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (first dimensions may differ); differentiable
    (Horovod's gradient: this rank's rows of the upstream gradients averaged over ranks).

    Example:
        >>> hvd.allgather(torch.full((hvd.rank() + 1,), hvd.rank()))   # 2 ranks: tensor([0, 1, 1])
    """
    check_process_set(process_set)
    return _Allgather.apply(tensor, name)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor; differentiable (Horovod's gradient:
    the upstream gradients averaged over ranks on ``root_rank``, zeros on the others).

    Example:
        >>> w0 = hvd.broadcast(w, root_rank=0)
    """
    check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`broadcast`; returns ``tensor``.

    Example:
        >>> hvd.broadcast_(w, root_rank=0)
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall(tensor: torch.Tensor, splits: torch.Tensor | Sequence[int] | None = None,
             name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[r]`` rows of ``tensor`` to rank r; differentiable.  Returns the received rows,
    and with ``splits`` given also the rows received from each rank (Horovod 0.28).

    Example:
        >>> out = hvd.alltoall(torch.arange(4.0))                      # 2 ranks: 2 rows each way
        >>> out, got = hvd.alltoall(x, torch.tensor([1, 3], dtype=torch.int32))
    """
    check_process_set(process_set)
    out, received = _Alltoall.apply(tensor, splits, name)
    return out if splits is None else (out, received)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: int = Average, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's rows of the result; differentiable (Horovod's
    gradient: the upstream gradients all-gathered, times ``size()`` under ``Sum``, times 1 under ``Average``).

    Example:
        >>> hvd.reducescatter(torch.ones(4, 2), op=hvd.Sum)   # 2 ranks: 2 rows of 2.0 each
    """
    check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def join(device: int = -1) -> int:
    """Say this rank has no more data; until every rank has joined, it takes part in the others'
    all-reduces with zeros (other collectives fail on the ranks that call them).  Returns the
    rank that joined last.

    Example:
        >>> for batch in my_shard: train(batch)     # shards of different lengths
        >>> hvd.join()
    """
    return int(synchronize(submit(Request("join"))).item())


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank has called ``barrier``.

    Example:
        >>> hvd.barrier()
    """
    check_process_set(process_set)
    synchronize(submit(Request("barrier")))
