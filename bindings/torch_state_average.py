"""The ranks' optimizer states made one again: what SelSync's synced steps (``sync_optimizer_state``)
and Sync-Switch's return to BSP ask of the binding, after steps each rank took on its own.

A mixin of :class:`~commlib.bindings.torch.DistributedOptimizer`, on its wrapped optimizer's state
held whole (the phases that average it are not sharded).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

from .torch_comm import dtype_name

#: the largest fused all-reduce of optimizer state (a temporary of this size at most)
_FUSED_BYTES = 64 << 20


def _chunks(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into runs of at most ``cap`` bytes (a larger tensor alone)."""
    runs: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if runs[-1] and size + nbytes > cap:
            runs.append([])
            size = 0
        runs[-1].append(t)
        size += nbytes
    return [r for r in runs if r]


class AveragedState:
    """:meth:`_average_optimizer_state` over the wrapped optimizer's state (see module docs).

    Example (what a switch back to BSP runs, on every rank):
        >>> opt._average_optimizer_state()
    """

    comm: Any
    _inner: torch.optim.Optimizer
    _params: list[torch.nn.Parameter]

    def _average_optimizer_state(self) -> None:
        """Every rank's optimizer state tensors become the ranks' average (a collective; SelSync's
        synced steps, Sync-Switch's return to BSP): the 0-dim ones too (Adam's ``step``: a rank that
        stepped alone, in ASP or past a GradScaler's skip, counts as the others then), over the union
        of the ranks' entries (a parameter or key a rank has no state for counts as zeros there and
        gets the average), so that every rank makes the same calls.  Integer tensors take the max."""
        st = self._inner.state
        mine = sorted((i, k, tuple(v.shape), dtype_name(v)) for i, p in enumerate(self._params)
                      for k, v in st.get(p, {}).items() if torch.is_tensor(v))
        crc = zlib.crc32(repr(mine).encode())
        both = self.comm.allreduce(np.array([crc, -crc], np.int64), "max", tag="optstate-layout")
        layout = mine
        if both[0] != -both[1]:         # the ranks hold different entries: their union
            union: dict[tuple[int, str], tuple[tuple[int, ...], str]] = {}
            for entries in self.comm.allgather_object(mine, label="optimizer state layout"):
                for i, k, shape, dt in entries:
                    if union.setdefault((i, k), (shape, dt)) != (shape, dt):
                        raise ValueError(f"DistributedOptimizer: state {k!r} of parameter #{i} differs in "
                                         f"shape or dtype across ranks: {union[(i, k)]} and {(shape, dt)}")
            layout = sorted((i, k, *v) for (i, k), v in union.items())
        scalars = []        # real 0-dim tensors (a step count per parameter): one all-reduce for all
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for i, k, shape, dt in layout:
            entry = st[self._params[i]]
            t = entry.get(k)
            if t is None:
                t = entry[k] = torch.zeros(shape, dtype=getattr(torch, dt), device=self._params[i].device)
            if t.is_floating_point() and t.dim() == 0:
                scalars.append(t)
            elif t.is_floating_point() or t.is_complex():
                groups.setdefault((t.dtype, t.device), []).append(t)
            elif dt.startswith("int"):
                self.comm.allreduce(t, "max", out=t, tag="optstate")
        for tensors in groups.values():     # fused: one all-reduce per 64 MiB of a dtype, not per tensor
            for chunk in _chunks(tensors, _FUSED_BYTES):
                if len(chunk) == 1 and chunk[0].is_contiguous():
                    self.comm.allreduce(chunk[0], "avg", out=chunk[0], tag="optstate")
                    continue
                flat = torch.cat([t.reshape(-1) for t in chunk])
                self.comm.allreduce(flat, "avg", out=flat, tag="optstate")
                for t, part in zip(chunk, flat.split([t.numel() for t in chunk])):
                    t.copy_(part.view(t.shape))
        if scalars:
            values = torch.stack([t.to("cpu", torch.float64) for t in scalars])
            self.comm.allreduce(values, "avg", out=values, tag="optstate")
            for t, v in zip(scalars, values):
                t.copy_(v)
