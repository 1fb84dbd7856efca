"""Horovod's helpers: parameters, optimizer state and Python objects from one rank to all.

Example:
    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    >>> hvd.broadcast_optimizer_state(opt, root_rank=0)
    >>> epoch = hvd.broadcast_object(epoch, root_rank=0)
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from commlib.bindings import torch_comm

from . import basics
from .mpi_ops import allgather, broadcast_, global_process_set

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Copy ``root_rank``'s tensors to every rank, in place (a collective).

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` or a list of
    ``(name, tensor)`` pairs or tensors.  Shapes or dtypes that differ across ranks
    raise on every rank.

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    torch_comm.broadcast_parameters([t for _, t in params], root_rank, basics.world())


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters (a collective).

    The state travels whole (the state dict, pickled), so an optimizer that has not stepped yet
    needs none first: Horovod runs one local step on zero gradients to make it, which decays
    the parameters it has just broadcast under a decoupled weight decay (AdamW) on the ranks
    that had none (its resume: rank 0 loads the checkpoint alone) and counts a step one process
    never took.  Here the parameters and the step count stay as one process's.

    Example:
        >>> hvd.broadcast_optimizer_state(opt, root_rank=0)
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    torch_comm.broadcast_optimizer_state(optimizer, root_rank, basics.world())


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every rank (pickled; a collective).

    Example:
        >>> state = hvd.broadcast_object({"epoch": 3} if hvd.rank() == 0 else None, root_rank=0)
    """
    if basics.rank() == root_rank:
        buf = io.BytesIO()
        torch.save(obj, buf, pickle_module=pickle)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, None if name is None else f"{name}.sz", process_set)
    if basics.rank() != root_rank:
        payload = torch.zeros(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, None if name is None else f"{name}.t", process_set)
    if basics.rank() == root_rank:
        return obj
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; a collective).

    Example:
        >>> metrics = hvd.allgather_object({"loss": loss.item()})   # a list of size() dicts
    """
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=pickle)
    payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64),
                      None if name is None else f"{name}.sz", process_set).tolist()
    gathered = allgather(payload, None if name is None else f"{name}.t", process_set).numpy().tobytes()
    out, offset = [], 0
    for n in sizes:
        out.append(torch.load(io.BytesIO(gathered[offset:offset + n]), weights_only=False))
        offset += n
    return out
