"""Helpers shared by the benchmarks: environment facts, timing, tables, JSON."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def environment(comm: Any) -> dict[str, Any]:
    """Facts that make a figure reproducible: ranks, versions, host, link shaping."""
    from mpi4py import MPI

    import commlib

    rate = os.environ.get("COMMLIB_CLUSTER_RATE")
    return {
        "ranks": comm.size,
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "commlib": commlib.__version__,
        "cluster_shaped": os.environ.get("COMMLIB_CLUSTER_SHAPED", "0") == "1",
        "cluster_rate_bps": float(rate) if rate else None,
        "unix_time": time.time(),
    }


def timed(comm: Any, fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Seconds per call of ``fn``: a batch after a barrier, the slowest rank's time."""
    from mpi4py import MPI

    for _ in range(warmup):
        fn()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - t0) / iters
    return comm.allreduce(elapsed, op=MPI.MAX)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def size_label(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"
