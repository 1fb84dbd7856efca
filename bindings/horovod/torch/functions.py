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

try:    # Horovod's pickler: functions and classes by value; pickle where cloudpickle is not installed
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - the horovod extra installs it
    _pickler = pickle

from commlib.bindings import torch_comm
from commlib.errors import ValidationError

from . import basics
from .engine import HorovodInternalError
from .mpi_ops import allgather, broadcast_, global_process_set

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Copy ``root_rank``'s tensors to every rank, in place (a collective).

    ``params``: ``model.state_dict()``, or a list of ``(name, tensor)`` pairs
    (``list(model.named_parameters())``; the generator itself is refused, as by Horovod)
    or of tensors.  Shapes or dtypes that differ across ranks raise on every rank.

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    try:
        torch_comm.broadcast_parameters([t for _, t in params], root_rank, basics.world())
    except ValidationError as exc:    # raised on every rank (the tensors are compared first): Horovod's
        raise HorovodInternalError(f"broadcast_parameters: {exc}") from exc


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


def _dumps(obj: Any) -> tuple[bytes, bool]:
    """``obj`` pickled (``torch.save`` with cloudpickle: lambdas and local classes travel, as in
    Horovod), and False; or why it does not pickle, and True."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf, pickle_module=_pickler)
    except Exception as exc:  # noqa: BLE001 - the peers hear of it in the exchange, then every rank raises
        return f"{type(exc).__name__}: {exc}".encode(), True
    return buf.getvalue(), False


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every rank (pickled with cloudpickle, as Horovod: lambdas and
    local classes travel; a collective).  An object that does not pickle raises
    ``pickle.PicklingError`` on every rank (the root sends why instead of the object).

    Example:
        >>> state = hvd.broadcast_object({"epoch": 3} if hvd.rank() == 0 else None, root_rank=0)
        >>> fn = hvd.broadcast_object((lambda x: x + 1) if hvd.rank() == 0 else None, root_rank=0)
    """
    root = basics.rank() == root_rank
    data, failed = _dumps(obj) if root else (b"", False)
    head = torch.tensor([len(data), int(failed)], dtype=torch.int64)
    broadcast_(head, root_rank, None if name is None else f"{name}.sz", process_set)
    length, failed = (int(v) for v in head.tolist())
    payload = _bytes_tensor(data) if root else torch.zeros(length, dtype=torch.uint8)
    broadcast_(payload, root_rank, None if name is None else f"{name}.t", process_set)
    data = payload.numpy().tobytes()
    if failed:
        raise pickle.PicklingError(f"broadcast_object: rank {root_rank} could not pickle its object "
                                   f"({data.decode(errors='replace')})")
    return obj if root else _loads(data)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled with cloudpickle, as Horovod; a collective).
    An object that does not pickle on some rank raises ``pickle.PicklingError`` on every rank,
    naming the rank (it sends why instead of its object).

    Example:
        >>> metrics = hvd.allgather_object({"loss": loss.item()})   # a list of size() dicts
    """
    data, failed = _dumps(obj)
    heads = allgather(torch.tensor([[len(data), int(failed)]], dtype=torch.int64),
                      None if name is None else f"{name}.sz", process_set).tolist()
    gathered = allgather(_bytes_tensor(data), None if name is None else f"{name}.t", process_set)
    gathered = gathered.numpy().tobytes()
    pieces, offset = [], 0
    for n, _ in heads:
        pieces.append(gathered[offset:offset + n])
        offset += n
    bad = [r for r, (_, f) in enumerate(heads) if f]
    if bad:
        raise pickle.PicklingError("allgather_object: " + "; ".join(
            f"rank {r} could not pickle its object ({pieces[r].decode(errors='replace')})" for r in bad))
    return [_loads(p) for p in pieces]
