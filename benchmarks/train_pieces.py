"""The measured pieces of a training step and the overlap bounds built from them (``benchmarks.train``).

Every piece is measured alone, in the same run and on the same link as the
steps it bounds, on every rank at once (the ranks share the cores as they do
while training); a piece's time is the slowest rank's, median over repetitions:

* compute, no communication: ``t_fwd`` (forward and loss), ``t_bwd`` (backward),
  ``t_update`` (the optimizer step on every parameter) and ``t_update_shard``
  (the same optimizer on a ``1/ranks`` slice of every parameter: DeAR's ZeRO-1 update);
* communication of the contenders' bucket plan, nothing else running: through
  commlib (``t_allreduce``, ``t_reduce_scatter``, ``t_allgather``: every bucket
  launched with the ``i``-form, then all waited, as the strategies do), through
  raw mpi4py (``mpi4py_*``: ``Iallreduce``/``Ireduce_scatter_block``/``Iallgather``,
  then ``Waitall``), and gloo's ``all_reduce`` (``t_allreduce_gloo``, DDP's).

Bounds (:func:`bounds`), the best a step can do when communication overlaps perfectly:

* WFBP (AllReduce, DDP): ``t_fwd + max(t_bwd, t_allreduce) + t_update``
* DeAR: ``max(t_fwd, t_allgather) + max(t_bwd, t_reduce_scatter) + t_update_shard``
* local: ``t_fwd + t_bwd + t_update``

Example:
    >>> bounds({"t_fwd": 1.0, "t_bwd": 2.0, "t_update": 0.5, "t_update_shard": 0.25,
    ...         "t_allreduce": 3.0, "t_reduce_scatter": 1.5, "t_allgather": 1.5,
    ...         "t_allreduce_gloo": 2.5})
    {'local': 3.5, 'ddp': 4.0, 'allreduce': 4.5, 'dear': 3.75}
    >>> ring_s(1 << 20, 2, 1e9, "allreduce") == 8 * (1 << 20) / 1e9
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

#: ring traffic per rank, in units of the buffer, of each operation (n ranks)
_RING = {"allreduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "allgather": lambda n: (n - 1) / n}


def ring_s(nbytes: int, n: int, rate_bps: float, op: str) -> float:
    """Seconds a ring ``op`` on ``nbytes`` needs at least on links of ``rate_bps`` each way."""
    return _RING[op](n) * 8 * nbytes / rate_bps


def bounds(p: dict[str, float]) -> dict[str, float]:
    """The overlap bound of every contender from the measured pieces ``p``."""
    out = {"local": p["t_fwd"] + p["t_bwd"] + p["t_update"]}
    if p.get("t_allreduce_gloo") is not None:
        out["ddp"] = p["t_fwd"] + max(p["t_bwd"], p["t_allreduce_gloo"]) + p["t_update"]
    out["allreduce"] = p["t_fwd"] + max(p["t_bwd"], p["t_allreduce"]) + p["t_update"]
    out["dear"] = (max(p["t_fwd"], p["t_allgather"]) + max(p["t_bwd"], p["t_reduce_scatter"])
                   + p["t_update_shard"])
    out["syncswitch-dear"] = out["dear-join"] = out["dear"]       # in BSP throughout: DeAR's steps
    out["allreduce-join"] = out["allreduce"]
    return out


def _slowest_median(world: Any, samples: Sequence[float]) -> float:
    mine = np.asarray(samples, np.float64)
    worst = np.empty_like(mine)
    world.Allreduce(mine, worst, op=MPI.MAX)       # per repetition: the slowest rank
    return float(np.median(worst))


def _timed(world: Any, fn: Callable[[], Any], reps: int) -> float:
    fn()                                            # warm: connections, allocations
    samples = []
    for _ in range(reps):
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return _slowest_median(world, samples)


def compute_pieces(world: Any, model: torch.nn.Module, make_batch: Callable, loss: Callable,
                   batch: int, lr: float, reps: int) -> dict[str, float]:
    """``t_fwd``, ``t_bwd``, ``t_update``, ``t_update_shard`` of ``model`` (its own copy of the
    optimizer state; the model's parameters move as in training)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    n, r = world.size, world.rank
    shard = []
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        lo, hi = r * flat.numel() // n, (r + 1) * flat.numel() // n
        if hi > lo:
            q = torch.nn.Parameter(flat[lo:hi].clone())
            q.grad = torch.randn_like(q) * 1e-3
            shard.append(q)
    shard_opt = torch.optim.SGD(shard, lr=lr, momentum=0.9)
    fwd, bwd, upd, upd_shard = [], [], [], []
    for i in range(reps + 1):
        x, y = make_batch(batch, 10_000 + i)
        world.Barrier()
        t0 = time.perf_counter()
        out = loss(model(x), y)
        t1 = time.perf_counter()
        opt.zero_grad()
        out.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        world.Barrier()
        t4 = time.perf_counter()
        shard_opt.step()
        t5 = time.perf_counter()
        if i:                                       # the first is a warm-up
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            upd.append(t3 - t2)
            upd_shard.append(t5 - t4)
    return {"t_fwd": _slowest_median(world, fwd), "t_bwd": _slowest_median(world, bwd),
            "t_update": _slowest_median(world, upd), "t_update_shard": _slowest_median(world, upd_shard)}


def comm_pieces(world: Any, comm: Any, dist: Any, plan: Sequence[dict], reps: int) -> dict[str, float]:
    """The bucket plan's communication alone, through commlib, raw mpi4py and gloo (if ``dist``)."""
    n = world.size
    numels = [-(-(b["bytes"] // 4) // n) * n for b in plan]          # float32, padded like buckets
    bufs = [torch.randn(k) for k in numels]
    shards = [torch.empty(k // n) for k in numels]
    order = list(range(len(bufs)))

    def commlib_ar() -> None:
        for w in [comm.iallreduce(bufs[b], "avg", out=bufs[b], tag=f"piece-ar{b}") for b in order]:
            w.wait()

    def commlib_rs() -> None:
        for w in [comm.ireduce_scatter(bufs[b], "avg", out=shards[b], tag=f"piece-rs{b}")
                  for b in order]:
            w.wait()

    def commlib_ag() -> None:            # DeAR gathers in reverse bucket order (forward order)
        ws = []
        for b in reversed(order):
            k = numels[b] // n
            ws.append(comm.iallgather(bufs[b][world.rank * k:(world.rank + 1) * k], out=bufs[b],
                                      tag=f"piece-ag{b}"))
        for w in ws:
            w.wait()

    raw = world.Dup()
    arrs = [b.numpy() for b in bufs]
    sarrs = [s.numpy() for s in shards]

    def mpi_ar() -> None:
        MPI.Request.Waitall([raw.Iallreduce(MPI.IN_PLACE, a, op=MPI.SUM) for a in arrs])

    def mpi_rs() -> None:
        MPI.Request.Waitall([raw.Ireduce_scatter_block(a, s, op=MPI.SUM) for a, s in zip(arrs, sarrs)])

    def mpi_ag() -> None:
        MPI.Request.Waitall([raw.Iallgather(MPI.IN_PLACE, a) for a in reversed(arrs)])

    out = {"t_allreduce": _timed(world, commlib_ar, reps),
           "t_reduce_scatter": _timed(world, commlib_rs, reps),
           "t_allgather": _timed(world, commlib_ag, reps),
           "mpi4py_allreduce": _timed(world, mpi_ar, reps),
           "mpi4py_reduce_scatter": _timed(world, mpi_rs, reps),
           "mpi4py_allgather": _timed(world, mpi_ag, reps),
           "t_allreduce_gloo": None}
    raw.Free()
    if dist is not None:
        def gloo_ar() -> None:
            for w in [dist.all_reduce(b, async_op=True) for b in bufs]:
                w.wait()
        out["t_allreduce_gloo"] = _timed(world, gloo_ar, reps)
    for b in bufs:                                   # keep values finite across repetitions
        b.zero_()
    return out


def set_rate(world: Any, rate_bps: float | None) -> bool:
    """Every rank's link to ``rate_bps`` (``None``: the launcher's rate), through the emulated
    cluster's launcher (:func:`benchmarks.cluster.request_link`); False on unshaped ranks."""
    from benchmarks.cluster import request_link

    changed = request_link(world.rank, rate_bps=rate_bps)
    ok = world.allreduce(int(changed), op=MPI.MIN)
    world.Barrier()
    return bool(ok)
