"""Refuse to report figures unless the links deliver the configured rate.

Run inside the ranks (``python -m benchmarks.cluster.selfcheck``) or call
:func:`selfcheck` at the start of a benchmark: it times a large raw mpi4py
allreduce, turns it into bus bandwidth (``2(n-1)/n * S / t``) and raises if
that is more than ``tolerance`` away from ``COMMLIB_CLUSTER_RATE`` — a silent
shared-memory fallback shows up as far too fast, a broken shaping as too slow.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np


class SelfCheckFailed(RuntimeError):
    """The achieved link rate is not the configured one: figures would lie."""


def ring_bound_s(nbytes: int, n: int, rate_bps: float) -> float:
    """Ring all-reduce lower bound ``2(n-1)/n * S / B`` in seconds.

    Example:
        >>> round(ring_bound_s(4 << 20, 2, 1e9) * 1e3, 1)
        33.6
    """
    return 2 * (n - 1) / n * nbytes * 8 / rate_bps


def selfcheck(comm: Any = None, rate_bps: float | None = None, nbytes: int = 16 << 20,
              tolerance: float = 0.15, iters: int = 3) -> dict[str, float]:
    """Measure the allreduce bus bandwidth and compare it with the configured rate.

    Returns the figures; raises :class:`SelfCheckFailed` on every rank when
    the rate is off by more than ``tolerance``.  Without a configured rate
    (unshaped run) it only measures.
    """
    from mpi4py import MPI

    comm = comm or MPI.COMM_WORLD
    if rate_bps is None and os.environ.get("COMMLIB_CLUSTER_RATE"):
        rate_bps = float(os.environ["COMMLIB_CLUSTER_RATE"])
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    comm.Allreduce(a, b)
    times = []
    for _ in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(a, b)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    t = float(np.median(times))
    n = comm.size
    busbw = 2 * (n - 1) / n * nbytes * 8 / t if n > 1 else float("inf")
    out = {"bytes": nbytes, "seconds": t, "busbw_bps": busbw, "rate_bps": rate_bps or 0.0}
    if rate_bps and n > 1:
        out["ratio"] = busbw / rate_bps
        if abs(out["ratio"] - 1) > tolerance:
            raise SelfCheckFailed(
                f"links deliver {busbw / 1e9:.3g} Gbit/s of allreduce bus bandwidth, configured "
                f"{rate_bps / 1e9:.3g} Gbit/s ({out['ratio']:.2f}x, tolerance {tolerance:.0%}): "
                + ("traffic bypasses the shaped links (shared memory?); is MPIR_CVAR_NOLOCAL=1 set?"
                   if busbw > rate_bps else "the links are slower than configured"))
    return out


def main() -> None:
    from mpi4py import MPI

    try:
        res = selfcheck()
    except SelfCheckFailed as exc:
        if MPI.COMM_WORLD.rank == 0:
            print(f"selfcheck FAILED: {exc}", file=sys.stderr)
        sys.exit(3)
    if MPI.COMM_WORLD.rank == 0:
        ratio = f", {res['ratio']:.2f}x of the configured rate" if "ratio" in res else ""
        print(f"selfcheck ok: 16 MiB allreduce {res['seconds'] * 1e3:.1f} ms, bus bandwidth "
              f"{res['busbw_bps'] / 1e9:.3g} Gbit/s{ratio}", flush=True)


if __name__ == "__main__":
    main()
