"""Horovod-style helpers for PyTorch and the DDP comm hook (re-exported by :mod:`bindings.torch`).

Example:
    >>> from commlib.bindings.torch import broadcast_parameters, register_comm_hook
    >>> broadcast_parameters(model.state_dict(), root_rank=0)
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

import commlib
from commlib.errors import MismatchError, ValidationError
from commlib.ops import agree


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def agree_tensors(comm: commlib.Communicator, what: str, tensors: list[torch.Tensor], extra: str = "",
           problem: str | None = None) -> None:
    """Raise the same error on every rank unless all ranks have the same tensors (shapes, dtypes,
    devices) and ``extra`` settings, and none has a ``problem`` (one small all-gather)."""
    desc = ";".join(f"{tuple(t.shape)}/{dtype_name(t)}/{t.device.type}" for t in tensors) + "|" + extra
    try:
        agree(comm, what, desc, noun="tensor list",
              summary=f"{len(tensors)} tensors, {sum(t.numel() for t in tensors)} elements", problem=problem)
    except MismatchError as exc:     # for a binding, a different model is invalid input
        raise ValidationError(str(exc)) from exc


# ---------------------------------------------------------------------- Horovod-style helpers
def _tensors(params: Any) -> list[torch.Tensor]:
    if isinstance(params, dict):
        items = list(params.values())
    else:
        items = [p[1] if isinstance(p, tuple) else p for p in params]
    return [t for t in items if torch.is_tensor(t)]


def broadcast_parameters(params: Any, root_rank: int = 0, comm: commlib.Communicator | None = None) -> None:
    """Copy ``root_rank``'s tensors to every rank, in place.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` or an iterable of tensors.

    Example:
        >>> broadcast_parameters(model.state_dict(), root_rank=0)
    """
    comm = comm or commlib.init()
    tensors = _tensors(params)
    agree_tensors(comm, "broadcast_parameters", tensors)
    with torch.no_grad():
        for t in tensors:
            if t.numel():
                data = t.detach()
                if data.is_contiguous():
                    comm.broadcast(data, root_rank, out=data)
                else:
                    data.copy_(comm.broadcast(data.contiguous(), root_rank))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              comm: commlib.Communicator | None = None) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters.

    Example:
        >>> broadcast_optimizer_state(opt, root_rank=0)
    """
    comm = comm or commlib.init()
    sd = optimizer.state_dict()
    sd = comm.mpi_comm.bcast(sd if comm.rank == root_rank else None, root=root_rank)
    optimizer.load_state_dict(sd)


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


def register_comm_hook(ddp_model: torch.nn.parallel.DistributedDataParallel,
                       comm: commlib.Communicator | None = None) -> None:
    """Route a DDP model's gradient buckets through commlib's all-reduce (averaged).

    DDP keeps its bucketing and overlap; commlib carries the bytes (MPI or
    NCCL), with its timeouts, checks and timeline.

    Example:
        >>> ddp = torch.nn.parallel.DistributedDataParallel(model)   # gloo process group
        >>> register_comm_hook(ddp, commlib.init())
    """
    global _completer
    comm = comm or commlib.init()
    if _completer is None:
        _completer = _Completer()

    def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP rejects string annotations here
        t = bucket.buffer()
        fut: torch.futures.Future = torch.futures.Future()
        _completer.q.put((state.iallreduce(t, "avg", out=t, tag=f"ddp{bucket.index()}"), fut, t))
        return fut

    ddp_model.register_comm_hook(comm, hook)
