"""Two figures of the progress engine, measured beside the collective sweep.

* **Per-call overhead**: one rank (a communicator of its own), 16 float32, what
  a commlib call costs beyond the raw mpi4py call: blocking ``allreduce``
  against ``Allreduce``, ``iallreduce(...).wait()`` against
  ``Iallreduce(...).Wait()``, ``broadcast`` against ``Bcast`` and ``barrier``
  against ``Barrier``, in microseconds (median of batches).  Only rank 0
  measures; the other ranks sleep meanwhile, so that they do not compete for
  the cores.
* **Overlap**: two ranks, a 16 MiB ``iallreduce`` while the caller runs a torch
  matmul loop (one torch thread): the slowdown of each against running alone.
  The loop is sized to last about as long as the all-reduce alone; the
  all-reduce's completion is stamped by a thread asleep in ``wait()``.  Ranks
  beyond the first two sleep meanwhile.  Beside it, the CPU the all-reduce
  itself needs (user + system time of the process while a raw ``Iallreduce``
  is driven by a thread that sleeps 50 us between ``Test`` calls, so no
  busy-wait is counted) and, where a rank has one core or less, the floor
  this sets: both together need ``t_matmul + cpu_allreduce`` of the rank's
  core, so the larger slowdown is at least
  ``(t_matmul + cpu_allreduce) / max(t_matmul, t_allreduce) - 1`` (or 0).

Both run inside ``python -m benchmarks.collectives`` (``--no-engine-figures`` skips them).

Example:
    >>> from mpi4py import MPI
    >>> overhead(MPI.COMM_WORLD)["blocking_overhead_us"]     # rank 0
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import commlib
from benchmarks import _common as bc


def _idle_until_done(world: Any, busy: bool) -> None:
    """Ranks not measuring wait for those that do without spinning on the cores."""
    req = world.Ibarrier()
    if busy:
        req.Wait()
        return
    while not req.Test():
        time.sleep(1e-3)


def _per_call(fn: Callable[[], Any], calls: int, batches: int) -> float:
    clock = time.perf_counter
    times = []
    for _ in range(batches):
        t0 = clock()
        for _ in range(calls):
            fn()
        times.append((clock() - t0) / calls)
    return bc.median(times)


def overhead(world: Any, calls: int = 2000, batches: int = 9) -> dict[str, float] | None:
    """Per-call overhead on one rank (collective over ``world``; rank 0's figures, else None)."""
    mine = world.rank == 0
    out = None
    if mine:
        c = commlib.init(comm=MPI.COMM_SELF)
        raw = MPI.COMM_SELF.Dup()
        x = np.ones(16, np.float32)
        y = np.empty_like(x)
        figs = {}
        for _ in range(2):   # the second pass is the one kept (warm caches and allocator)
            figs = {"mpi4py": _per_call(lambda: raw.Allreduce(x, y), calls, batches),
                    "mpi4py-nb": _per_call(lambda: raw.Iallreduce(x, y).Wait(), calls, batches),
                    "commlib": _per_call(lambda: c.allreduce(x, out=y), calls, batches),
                    "commlib-nb": _per_call(lambda: c.iallreduce(x, out=y).wait(), calls, batches),
                    "mpi4py-bcast": _per_call(lambda: raw.Bcast(y, 0), calls, batches),
                    "commlib-bcast": _per_call(lambda: c.broadcast(y, 0), calls, batches),
                    "mpi4py-barrier": _per_call(raw.Barrier, calls, batches),
                    "commlib-barrier": _per_call(c.barrier, calls, batches)}
        out = {f"{k}_us": v * 1e6 for k, v in figs.items()}
        out["blocking_overhead_us"] = (figs["commlib"] - figs["mpi4py"]) * 1e6
        out["nonblocking_overhead_us"] = (figs["commlib-nb"] - figs["mpi4py-nb"]) * 1e6
        out["broadcast_overhead_us"] = (figs["commlib-bcast"] - figs["mpi4py-bcast"]) * 1e6
        out["barrier_overhead_us"] = (figs["commlib-barrier"] - figs["mpi4py-barrier"]) * 1e6
        c.close()
        raw.Free()
    _idle_until_done(world, mine)
    return out


def _matmul_loop(a: Any, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        a @ a
    return time.perf_counter() - t0


def _cpu_needed(comm: Any, x: Any) -> float:
    """User + system seconds this process spends on one in-place ``Iallreduce`` of ``x``
    driven by a thread that sleeps between ``Test`` calls (no busy-wait counted)."""
    def drive(req: Any) -> None:
        while not req.Test():
            time.sleep(5e-5)

    comm.Barrier()
    t0 = resource.getrusage(resource.RUSAGE_SELF)
    th = threading.Thread(target=drive, args=(comm.Iallreduce(MPI.IN_PLACE, x),))
    th.start()
    th.join()
    t1 = resource.getrusage(resource.RUSAGE_SELF)
    return (t1.ru_utime - t0.ru_utime) + (t1.ru_stime - t0.ru_stime)


def floor_larger_slowdown(t_matmul: float, t_allreduce: float, cpu_allreduce: float) -> float:
    """The least the larger of the two slowdowns can be where both share one core: together they
    need ``t_matmul + cpu_allreduce`` of it, against the longer one alone; never below 0 (a loop
    that came out much shorter than the all-reduce, on a noisy machine, gave -66 %).

    Example:
        >>> floor_larger_slowdown(1.0, 1.0, 0.25), floor_larger_slowdown(0.2, 1.0, 0.1)
        (0.25, 0.0)
    """
    return max(0.0, (t_matmul + cpu_allreduce) / max(t_matmul, t_allreduce) - 1)


def overlap(world: Any, nbytes: int = 16 << 20, rounds: int = 5) -> dict[str, float] | None:
    """Slowdowns of an ``iallreduce`` and a matmul loop run together, on ranks 0 and 1
    (collective over ``world``; rank 0's figures, else None; None on one rank)."""
    if world.size < 2:
        return None
    pair = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
    out = None
    if pair != MPI.COMM_NULL:
        import torch

        torch.set_num_threads(1)
        c = commlib.init(comm=pair)
        x = np.ones(nbytes // 4, np.float32)
        a = torch.randn(256, 256)
        finished: list[float] = []

        def allreduce_alone() -> float:
            pair.Barrier()
            t0 = time.perf_counter()
            c.iallreduce(x, out=x).wait()
            return time.perf_counter() - t0

        t_ar = bc.median([allreduce_alone() for _ in range(rounds)])
        _matmul_loop(a, 20)       # warm-up: the first matmuls (allocator, caches) are not timed
        per_step = bc.median([_matmul_loop(a, 20) / 20 for _ in range(rounds)])
        steps = max(1, int(t_ar / per_step))
        t_mm = bc.median([_matmul_loop(a, steps) for _ in range(rounds)])
        ar_together, mm_together = [], []
        for _ in range(rounds):
            pair.Barrier()
            t0 = time.perf_counter()
            work = c.iallreduce(x, out=x)
            # a thread asleep in wait() stamps the completion (it wakes once)
            stamp = threading.Thread(target=lambda w=work: (w.wait(), finished.append(time.perf_counter())))
            stamp.start()
            mm_together.append(_matmul_loop(a, steps))
            stamp.join()
            ar_together.append(finished.pop() - t0)
        out = {"bytes": nbytes, "allreduce_alone_s": t_ar, "matmul_alone_s": t_mm, "matmul_steps": steps,
               "allreduce_together_s": bc.median(ar_together), "matmul_together_s": bc.median(mm_together)}
        out["allreduce_slowdown"] = out["allreduce_together_s"] / t_ar - 1
        out["matmul_slowdown"] = out["matmul_together_s"] / t_mm - 1
        cpu = bc.median([_cpu_needed(pair, x) for _ in range(rounds)])
        host = socket.gethostname()
        cores = (os.cpu_count() or 1) / pair.allgather(host).count(host)   # of the two ranks
        out.update(allreduce_cpu_s=cpu, cores_per_rank=cores,
                   floor_larger_slowdown=floor_larger_slowdown(t_mm, t_ar, cpu) if cores <= 1 else None)
        c.close()
        pair.Free()
        if world.rank != 0:
            out = None
    _idle_until_done(world, world.rank < 2)
    return out


def main(argv: list[str] | None = None) -> int:
    """The CLI: says that ``benchmarks.collectives`` measures these figures (``--help``: the docs)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_figures", description=__doc__.split("\n\n")[0],
        epilog="These figures run inside the collective sweep: "
               "mpiexec -n 2 python -m benchmarks.collectives (--no-engine-figures skips them).")
    p.parse_args(argv)
    print("engine_figures: nothing to run on its own; the per-call overhead and overlap figures are "
          "measured inside the collective sweep:\n"
          "    mpiexec -n 2 python -m benchmarks.collectives [--quick]   (--no-engine-figures skips them)",
          file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
