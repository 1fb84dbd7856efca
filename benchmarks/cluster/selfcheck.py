"""Refuse to report figures unless the links deliver the configured rate.

:func:`selfcheck` runs inside the ranks (the launcher runs it before every
command; a benchmark may call it at start).  It times two things with raw
mpi4py, rank 0's verdict is shared, and every rank raises
:class:`SelfCheckFailed` when either is more than ``tolerance`` away from the
configured rate:

- the link: every rank sends ``nbytes`` to its right neighbour at once
  (``Sendrecv``), so each link carries ``nbytes`` once; a shared-memory
  fallback shows up as many times too fast, a broken shaper as too slow;
- a large allreduce as bus bandwidth ``2(n-1)/n * S / t``, the figure the
  benchmarks compare with :func:`ring_bound_s`; the links may be right while
  the host is too small for the ranks at this rate (reductions, page faults
  and 4 busy-polling ranks on 2 cores), and then figures would be the host's,
  not the network's.

``python -m benchmarks.cluster.selfcheck --sizes 4,16,64`` (inside the ranks)
prints the allreduce table of benchmarks/results/cluster-selfcheck.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np


class SelfCheckFailed(RuntimeError):
    """The achieved rate is not the configured one: figures would lie.

    Example:
        >>> try:                                   # doctest: +SKIP
        ...     selfcheck(comm)
        ... except SelfCheckFailed as exc:
        ...     sys.exit(f"no figures: {exc}")
    """


def ring_bound_s(nbytes: int, n: int, rate_bps: float) -> float:
    """Ring all-reduce lower bound ``2(n-1)/n * S / B`` in seconds (``S`` bytes, ``B`` bits/s).

    Example:
        >>> round(ring_bound_s(4 << 20, 2, 1e9) * 1e3, 2), round(ring_bound_s(4 << 20, 4, 1e9) * 1e3, 2)
        (33.55, 50.33)
    """
    return 2 * (n - 1) / n * nbytes * 8 / rate_bps if n > 1 else 0.0


def default_nbytes(n: int, rate_bps: float | None) -> int:
    """Allreduce size for the check: about 0.5 s at the ring bound, a power of two, 4..256 MiB.

    Large enough that per-operation overheads stay small (4 ranks at 1 Gbit/s on
    2 cores: 4 MiB 0.86-0.94x of the bound, 64 MiB 0.89-0.92x), small enough
    that the check takes seconds.

    Example:
        >>> default_nbytes(4, 1e9) >> 20, default_nbytes(2, 2e8) >> 20, default_nbytes(8, 1e8) >> 20
        (32, 8, 4)
    """
    if not rate_bps or n < 2:
        return 16 << 20
    want_mib = 0.5 * rate_bps / 8 / (2 * (n - 1) / n) / (1 << 20)
    return 1 << (20 + max(2, min(8, int(np.log2(max(want_mib, 1))))))


def _timed(comm: Any, op: Any, iters: int, warmup: int = 2) -> list[float]:
    from mpi4py import MPI

    for _ in range(warmup):  # connections, page faults, TCP windows (2-3 transfers to open up)
        op()
    times = []
    for _ in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        op()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return times


def allreduce_times(comm: Any, nbytes: int, iters: int = 5) -> list[float]:
    """Seconds (slowest rank) of ``iters`` float32 ``Allreduce`` of ``nbytes``, after 2 warm-ups.

    Example:
        >>> allreduce_times(MPI.COMM_WORLD, 4 << 20)   # doctest: +SKIP
        [0.052, 0.051, 0.053, 0.052, 0.052]
    """
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    return _timed(comm, lambda: comm.Allreduce(a, b), iters)


def link_times(comm: Any, nbytes: int, iters: int = 5) -> list[float]:
    """Seconds of ``iters`` ring exchanges: each rank sends ``nbytes`` right, receives from the left.

    Example:
        >>> link_times(MPI.COMM_WORLD, 4 << 20)   # doctest: +SKIP
        [0.034, 0.034, 0.035, 0.034, 0.034]
    """
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    r, n = comm.rank, comm.size
    return _timed(comm, lambda: comm.Sendrecv(a, (r + 1) % n, 7, b, (r - 1) % n, 7), iters)


def _verdict(res: dict[str, Any], n: int, tolerance: float) -> tuple[str, bool]:
    """The problem with one measurement against ``res["rate_bps"]`` (``""`` if none), and
    whether measuring again may clear it (too slow may be a busy moment; too fast is not)."""
    if res["link_ratio"] > 1 + tolerance or res["allreduce_ratio"] > 1 + tolerance:
        return ("traffic bypasses the shaped links (shared memory? is MPIR_CVAR_NOLOCAL=1 "
                "set in the ranks?)"), False
    if res["link_ratio"] < 1 - tolerance:
        return "the links are slower than configured (host too busy, or the shaper is off)", True
    if res["allreduce_ratio"] < 1 - tolerance:
        return (f"the links are right, but this host cannot keep {n} ranks busy at this rate "
                "(CPU-bound reductions and polling): use fewer ranks or a lower rate"), True
    return "", False


def selfcheck(comm: Any = None, rate_bps: float | None = None, nbytes: int | None = None,
              tolerance: float = 0.15, iters: int = 5, attempts: int = 3,
              settle_s: float = 2.0) -> dict[str, Any]:
    """Measure link rate and allreduce bus bandwidth; raise if either is off the configured rate.

    ``rate_bps`` defaults to ``COMMLIB_CLUSTER_RATE``.  Unshaped ranks
    (``COMMLIB_CLUSTER_SHAPED`` not ``1``) and a single rank are only measured.
    A measurement that comes out too slow (a busy moment of the host: another
    process, a burst of page faults) is taken again after ``settle_s`` seconds,
    up to ``attempts`` measurements in all; the first within ``tolerance``
    passes, and a host that is too slow every time is refused.  Too fast
    (traffic bypassing the links) is refused at once.  Every rank returns the
    same dict (medians of ``iters`` runs; ``"attempts"`` lists each measurement's
    ratios) or raises :class:`SelfCheckFailed`.

    Example:
        >>> from mpi4py import MPI                         # doctest: +SKIP
        >>> res = selfcheck(MPI.COMM_WORLD, 1e9)           # doctest: +SKIP
        >>> round(res["allreduce_ratio"], 2), round(res["link_ratio"], 2)   # doctest: +SKIP
        (0.92, 0.97)
    """
    from mpi4py import MPI

    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    comm = comm or MPI.COMM_WORLD
    n = comm.size
    shaped = os.environ.get("COMMLIB_CLUSTER_SHAPED") == "1"
    if rate_bps is None and shaped and os.environ.get("COMMLIB_CLUSTER_RATE"):
        rate_bps = float(os.environ["COMMLIB_CLUSTER_RATE"])
    nbytes = nbytes or default_nbytes(n, rate_bps)
    res: dict[str, Any] = {"shaped": shaped, "ranks": n, "rate_bps": rate_bps, "bytes": nbytes,
                           "tolerance": tolerance}
    if n < 2:
        return {**res, "ok": True, "note": "one rank: nothing to check"}
    tried: list[dict[str, float]] = []
    while True:
        t_link = float(np.median(link_times(comm, nbytes, iters)))
        t_ar = float(np.median(allreduce_times(comm, nbytes, iters)))
        res.update(link_s=t_link, link_bps=nbytes * 8 / t_link, allreduce_s=t_ar,
                   busbw_bps=ring_bound_s(nbytes, n, 1.0) / t_ar)
        if not rate_bps:
            return {**res, "ok": True, "note": "no configured rate: measured only"}
        res.update(link_ratio=res["link_bps"] / rate_bps, allreduce_ratio=res["busbw_bps"] / rate_bps)
        tried.append({"link_ratio": res["link_ratio"], "allreduce_ratio": res["allreduce_ratio"]})
        # the times are every rank's slowest (MAX), so every rank holds the same figures; rank 0's
        # verdict is shared anyway, as every rank must take the same branch
        problem, again = comm.bcast(_verdict(res, n, tolerance), root=0)
        if not again or len(tried) == attempts:
            break
        if comm.rank == 0:
            print(f"cluster: selfcheck attempt {len(tried)} of {attempts} too slow "
                  f"({describe(res)}); measuring again in {settle_s:g} s", file=sys.stderr, flush=True)
        time.sleep(settle_s)
    res.update(ok=not problem, problem=problem, attempts=tried)
    if not res["ok"]:
        raise SelfCheckFailed(f"{describe(res)}: {res['problem']}")
    return res


def describe(res: dict[str, Any]) -> str:
    """One line for a :func:`selfcheck` result.

    Example:
        >>> describe({"ranks": 4, "bytes": 16 << 20, "rate_bps": 1e9, "link_bps": 0.97e9,
        ...           "allreduce_s": 0.218, "busbw_bps": 0.92e9})[21:]
        'link 0.97 Gbit/s (0.97x), 16 MiB allreduce 218.0 ms = bus bandwidth 0.92 Gbit/s (0.92x)'
    """
    rate = res.get("rate_bps")
    head = f"{res['ranks']} ranks " + (f"at {rate / 1e9:g} Gbit/s" if rate else "unshaped")
    if "link_bps" not in res:
        return f"{head}: {res.get('note', '')}"

    def _gbit(v: float) -> str:
        return f"{v / 1e9:.3g} Gbit/s" + (f" ({v / rate:.2f}x)" if rate else "")

    tried = res.get("attempts", [])
    earlier = ("" if len(tried) < 2 else f" (measurement {len(tried)}; before: "
               + ", ".join(f"{t['allreduce_ratio']:.2f}x" for t in tried[:-1]) + ")")
    return (f"{head}: link {_gbit(res['link_bps'])}, {res['bytes'] >> 20} MiB allreduce "
            f"{res['allreduce_s'] * 1e3:.1f} ms = bus bandwidth {_gbit(res['busbw_bps'])}{earlier}")


def from_env() -> dict[str, Any] | None:
    """The launcher's self-check result (``COMMLIB_CLUSTER_SELFCHECK``, JSON), if any.

    Example:
        >>> from_env() is None or "ok" in from_env()
        True
    """
    raw = os.environ.get("COMMLIB_CLUSTER_SELFCHECK")
    return json.loads(raw) if raw else None


def table(comm: Any, sizes_mib: list[int], rate_bps: float | None, iters: int) -> list[dict]:
    """Allreduce at each size vs the ring bound (rows for rank 0's markdown table).

    Example:
        >>> table(MPI.COMM_WORLD, [4, 16], 1e9, 10)[0]["bytes"] >> 20   # doctest: +SKIP
        4
    """
    rows = []
    for mib in sizes_mib:
        ts = sorted(allreduce_times(comm, mib << 20, iters))
        row = {"bytes": mib << 20, "median_s": float(np.median(ts)), "min_s": ts[0], "max_s": ts[-1]}
        if rate_bps:
            row["bound_s"] = ring_bound_s(mib << 20, comm.size, rate_bps)
            row["ratio"] = row["bound_s"] / row["median_s"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run inside the ranks: the self-check (exit 3 when it fails), with ``--sizes`` a table.

    Example:
        >>> main(["--sizes", "4,16,64", "--iters", "10"])   # doctest: +SKIP
        0
    """
    from mpi4py import MPI

    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster.selfcheck")
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--attempts", type=int, default=3,
                   help="measurements before a too-slow host is refused (3)")
    p.add_argument("--bytes", type=int, default=None)
    p.add_argument("--sizes", default="", help="MiB, comma-separated: print an allreduce table")
    p.add_argument("--json", default=None, help="rank 0 writes the result here")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    try:
        res = selfcheck(comm, nbytes=args.bytes, tolerance=args.tolerance, iters=args.iters,
                        attempts=args.attempts)
    except SelfCheckFailed as exc:
        if comm.rank == 0:
            print(f"cluster: selfcheck FAILED, no figures: {exc}", file=sys.stderr, flush=True)
        return 3
    if args.sizes:
        res["table"] = table(comm, [int(s) for s in args.sizes.split(",")], res["rate_bps"],
                             args.iters)
    if comm.rank == 0:
        print(f"cluster: selfcheck ok: {describe(res)}", file=sys.stderr, flush=True)
        for row in res.get("table", []):
            bound = (f" | {row['bound_s'] * 1e3:.1f} | {row['ratio']:.2f}" if "bound_s" in row
                     else " | - | -")
            print(f"| {row['bytes'] >> 20} MiB | {row['median_s'] * 1e3:.1f} | "
                  f"{row['min_s'] * 1e3:.1f} | {row['max_s'] * 1e3:.1f}{bound} |", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
