"""Horovod-style helpers for PyTorch and the DDP comm hook (re-exported by :mod:`bindings.torch`).

Example:
    >>> from commlib.bindings.torch import broadcast_parameters, register_comm_hook
    >>> broadcast_parameters(model.state_dict(), root_rank=0)
"""

from __future__ import annotations

import numbers
import queue
import threading
from typing import Any

import numpy as np
import torch

import commlib
from commlib.arrays import DTYPES
from commlib.errors import MismatchError, ValidationError
from commlib.ops import agree, digest


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def is_dense(t: torch.Tensor) -> bool:
    """Every element of ``t`` has its own place in one block of ``numel`` elements (contiguous,
    channels_last, any permutation of the dimensions): ``t`` can live in a bucket as it is laid out.
    One of no element is (``nn.Linear(0, 3)``'s weight: shape ``(3, 0)``, strides ``(1, 1)``)."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


Layout = tuple[torch.Size, tuple[int, ...]]


def layout(t: torch.Tensor) -> Layout:
    """The shape and strides of ``t``: where each of its elements sits in its block."""
    return t.shape, t.stride()


def in_layout(flat: torch.Tensor, offset: int, lay: Layout) -> torch.Tensor:
    """The block of ``flat`` at ``offset`` seen with the shape and strides ``lay`` (dense): a
    channels_last parameter's bucket region stays channels_last, so the parameter, its gradient
    and its optimizer state map element for element onto the same flat positions."""
    shape, stride = lay
    return flat[offset:offset + shape.numel()].as_strided(shape, stride)


def flat_in_layout(t: torch.Tensor, lay: Layout) -> torch.Tensor:
    """``t`` as a 1-D tensor in the memory order of ``lay`` (a copy)."""
    flat = torch.empty(lay[0].numel(), dtype=t.dtype, device=t.device)
    in_layout(flat, 0, lay).copy_(t)
    return flat


def agree_tensors(comm: commlib.Communicator, what: str, tensors: list[torch.Tensor], extra: str = "",
           problem: str | None = None, strides: bool = False) -> None:
    """Raise the same error on every rank unless all ranks have the same tensors (shapes, dtypes,
    devices; with ``strides`` also the strides of those not contiguous) and ``extra`` settings, and
    none has a ``problem`` (one small all-gather)."""
    listed = ";".join(f"{tuple(t.shape)}/{dtype_name(t)}/{t.device.type}"
                      + (f"/{t.stride()}" if strides and not t.is_contiguous() else "")
                      for t in tensors)
    # the summaries name which part differs; the settings come first in the rank's own text
    summary = (f"{len(tensors)} tensors, {sum(t.numel() for t in tensors)} elements (#{digest(listed)}), "
               f"settings #{digest(extra)}")
    try:
        agree(comm, what, f"settings {extra} | tensors {listed}", noun="tensor list",
              differs="tensor list or settings",
              summary=summary, problem=problem)
    except MismatchError as exc:     # for a binding, a different model is invalid input
        raise ValidationError(str(exc)) from exc


# ---------------------------------------------------------------------- Horovod-style helpers
def _tensors(params: Any) -> list[torch.Tensor]:
    if isinstance(params, dict):
        items = list(params.values())
    else:
        items = [p[1] if isinstance(p, tuple) else p for p in params]
    return [t for t in items if torch.is_tensor(t)]


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels in: itself where commlib carries it, else widened
    exactly (float64 for other floats, int64 for bool and other integers).

    Example:
        >>> wire_dtype(torch.bool)
        torch.int64
    """
    if str(dtype).removeprefix("torch.") in DTYPES:     # what commlib carries as it is
        return dtype
    return torch.float64 if dtype.is_floating_point else torch.int64


def broadcast_parameters(params: Any, root_rank: int = 0, comm: commlib.Communicator | None = None) -> None:
    """Copy ``root_rank``'s tensors to every rank, in place.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` or an iterable of tensors, of
    any dtype (bool masks and uint8 buffers travel widened, complex ones as real pairs).

    Example:
        >>> broadcast_parameters(model.state_dict(), root_rank=0)
    """
    comm = commlib.as_communicator(comm, "broadcast_parameters")
    tensors = _tensors(params)
    agree_tensors(comm, "broadcast_parameters", tensors)
    with torch.no_grad():
        for t in tensors:
            if t.numel():
                data = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
                wire = wire_dtype(data.dtype)
                if data.is_contiguous() and wire == data.dtype:
                    comm.broadcast(data, root_rank, out=data)
                else:
                    data.copy_(comm.broadcast(data.contiguous().to(wire), root_rank))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              comm: commlib.Communicator | None = None) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters.

    A :class:`DistributedOptimizer` broadcasts over its own communicator
    (:meth:`~DistributedOptimizer.broadcast_state`): under ``DeAR``, whose state lives in pieces, a
    checkpoint ``root_rank`` alone loaded since its last step is sent whole (Horovod's resume).

    Example:
        >>> if comm.rank == 0:
        ...     opt.load_state_dict(torch.load(path)["opt"])
        >>> broadcast_optimizer_state(opt, root_rank=0)
    """
    from .torch import DistributedOptimizer

    if isinstance(optimizer, DistributedOptimizer):    # over its own communicator; sharded state too
        optimizer.broadcast_state(root_rank)
        return
    comm = commlib.as_communicator(comm, "broadcast_optimizer_state")
    sd = optimizer.state_dict()
    sd = comm.mpi_comm.bcast(sd if comm.rank == root_rank else None, root=root_rank)
    optimizer.load_state_dict(sd)


def average_loss(comm: commlib.Communicator, loss: Any) -> Any:
    """A closure's loss (a number or a one-element tensor) averaged over ranks, in one small
    all-reduce: what ``step(closure)`` gives the optimizer, and returns, so that LBFGS compares the
    same losses on every rank.  A closure that returns ``None`` (or a larger tensor) on every rank:
    as it is; on some ranks only: ``ValueError`` on every rank.

    Example:
        >>> average_loss(comm, torch.tensor(0.5 + comm.rank))      # 2 ranks: tensor(1.)
    """
    if comm.size == 1:
        return loss
    scalar = isinstance(loss, numbers.Real) or (torch.is_tensor(loss) and loss.numel() == 1)
    value = float(loss.detach() if torch.is_tensor(loss) else loss) if scalar else 0.0
    total, scalars = comm.allreduce(np.array([value, float(scalar)]), "sum", tag="closure loss")
    if scalars == 0:
        return loss
    if scalars != comm.size:
        raise ValueError(f"step(closure): the closure returned a loss (a number or a one-element tensor) on "
                         f"{int(scalars)} of {comm.size} ranks (here: {type(loss).__name__}): return it on "
                         "every rank")
    mean = float(total) / comm.size
    return loss.detach().new_tensor(mean) if torch.is_tensor(loss) else mean


# ---------------------------------------------------------------------- DDP comm hook
class _Completer:
    """One daemon thread that waits on commlib works and completes torch futures in order."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="commlib-ddp-hook").start()

    def _run(self) -> None:
        while True:
            work, fut, tensor = self.q.get()
            try:
                work.wait()
                fut.set_result(tensor)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting DDP reducer
                fut.set_exception(e)


_completer: _Completer | None = None


def _result(fut: torch.futures.Future) -> torch.Tensor:
    """``fut``'s tensor, or its error raised: DDP's reducer reads a Python future's result in C++,
    where one given by ``set_exception`` is not raised but cast ("Unable to cast <the error> to
    Tensor"); raised in a ``then`` callback, it fails the future DDP waits on."""
    return fut.value()


def register_comm_hook(ddp_model: torch.nn.parallel.DistributedDataParallel,
                       comm: commlib.Communicator | None = None) -> None:
    """Route a DDP model's gradient buckets through commlib's all-reduce (averaged).

    DDP keeps its bucketing and overlap; commlib carries the bytes (MPI or
    NCCL), with its timeouts, checks and timeline.  ``comm`` (default: the world) must hold
    the ranks of the model's process group, in its order (a DDP group of part of the world:
    a split, ``commlib.init().split(color, key)``); another is refused (a collective, like the
    registration: every member of the group makes it).  ``ddp.join(divide_by_initial_world_size
    =False)`` is not honoured (as by DDP's own Python hooks): the average is over the group.

    Example:
        >>> ddp = torch.nn.parallel.DistributedDataParallel(model)   # gloo process group
        >>> register_comm_hook(ddp, commlib.init())
    """
    global _completer
    comm = commlib.as_communicator(comm, "register_comm_hook")
    members = torch.distributed.get_process_group_ranks(ddp_model.process_group)
    here = [] if len(members) != comm.size else comm.allgather_object(
        torch.distributed.get_rank(), label="register_comm_hook")
    if here != members:
        raise ValueError(f"register_comm_hook: the DDP model's process group holds ranks {members} of "
                         f"torch.distributed's world, the communicator {comm.size} rank(s)"
                         + (f" ({here})" if here else "") + ": pass comm=, a communicator of the group's "
                         "ranks in its order (commlib.init().split(color, key)), or its gradients are "
                         "averaged over other ranks")
    if _completer is None:
        _completer = _Completer()

    def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP rejects string annotations here
        t = bucket.buffer()
        fut: torch.futures.Future = torch.futures.Future()
        _completer.q.put((state.iallreduce(t, "avg", out=t, tag=f"ddp{bucket.index()}"), fut, t))
        return fut.then(_result)


    ddp_model.register_comm_hook(comm, hook)
