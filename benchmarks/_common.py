"""Helpers shared by the benchmarks: options, environment facts, timing, statistics, tables, JSON.

Every benchmark under ``benchmarks/`` runs under ``mpiexec`` and reports on
rank 0; these helpers keep their options, timing method and output alike.

Example:
    >>> from benchmarks._common import base_parser, markdown_table, size_label, stats
    >>> args = base_parser("demo", plot=True).parse_args(["--json", "out.json", "--quick"])
    >>> args.json, args.quick, args.plot
    ('out.json', True, None)
    >>> stats([3.0, 1.0, 2.0])["median"], size_label(4096), size_label(3 << 20)
    (2.0, '4KiB', '3MiB')
    >>> print(markdown_table(["a", "b"], [[1, 2.5]]))
    | a | b |
    |---|---|
    | 1 | 2.5 |
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

#: environment variables worth recording: they change what a figure means
_ENV_PREFIXES = ("COMMLIB_", "MPIR_CVAR_", "MPICH_", "FI_", "UCX_", "OMP_", "GLOO_")


def base_parser(description: str, plot: bool = False) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has: ``--json``, ``--quick``, and
    ``--plot`` for those that draw one (``plot``: a benchmark without a plot does not offer it)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", metavar="PATH", help="write every figure and the environment here")
    if plot:
        p.add_argument("--plot", metavar="PATH", help="write a PNG plot here (matplotlib, Agg)")
    p.add_argument("--quick", action="store_true", help="a short run (tests, CI, smoke runs)")
    return p


def command_line(name: str | None = None, argv: Sequence[str] | None = None) -> str:
    """The command that ran benchmark ``name`` (default: the script run), as it runs again from the
    repository root: ``python -m benchmarks.<name> <argv>`` (``argv`` default ``sys.argv[1:]``).

    Example:
        >>> command_line("train", ["--quick", "--json", "out.json"])
        'python -m benchmarks.train --quick --json out.json'
    """
    import shlex

    if name is None:
        script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        if os.path.dirname(script) == os.path.dirname(os.path.abspath(__file__)):
            name = os.path.splitext(os.path.basename(script))[0]
    head = f"python -m benchmarks.{name}" if name else shlex.join(sys.argv[:1])
    return " ".join([head, shlex.join(sys.argv[1:] if argv is None else list(argv))]).strip()


def positive_int(text: str) -> int:
    """An argparse ``type``: an int of at least 1 (``--steps 0`` is a usage error, not a traceback).

    Example:
        >>> positive_int("3")
        3
    """
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an int of at least 0 (``--staleness``)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a float > 0 (``--asp-lr-scale``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {value}")
    return value


def parse_quick(p: argparse.ArgumentParser, argv: Sequence[str] | None,
                **quick: Any) -> argparse.Namespace:
    """``p.parse_args(argv)``; under ``--quick``, ``quick`` gives the defaults of the options not given.

    An option the user gives always wins over ``--quick``; validate the returned values.

    Example:
        >>> p = base_parser("demo")
        >>> _ = p.add_argument("--rounds", type=int, default=9)
        >>> parse_quick(p, ["--quick"], rounds=2).rounds
        2
        >>> parse_quick(p, ["--quick", "--rounds", "7"], rounds=2).rounds
        7
    """
    args = p.parse_args(argv)
    if args.quick and quick:
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    return args


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _version(module: str) -> str | None:
    mod = sys.modules.get(module)
    return getattr(mod, "__version__", None) if mod is not None else None


def environment(comm: Any) -> dict[str, Any]:
    """Facts that make a figure reproducible: ranks, versions, host, load, link shaping.

    ``comm`` is an mpi4py communicator; call on every rank (the ranks' host
    names are gathered).  ``cluster_shaped``/``cluster_rate_bps`` come from
    ``COMMLIB_CLUSTER_SHAPED`` and ``COMMLIB_CLUSTER_RATE`` (bits/s), set by
    ``benchmarks.cluster``; torch's version is recorded only if it was imported.
    """
    from mpi4py import MPI

    import commlib

    rate = os.environ.get("COMMLIB_CLUSTER_RATE")
    hosts = comm.allgather(socket.gethostname())
    return {
        "ranks": comm.size,
        "host": hosts[0],
        "hosts": sorted(set(hosts)),
        "local_ranks": hosts.count(hosts[comm.rank]),
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi4py": _version("mpi4py"),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "commlib": commlib.__version__,
        "git": _git_commit(),
        "cluster_shaped": os.environ.get("COMMLIB_CLUSTER_SHAPED", "0") == "1",
        "cluster_rate_bps": float(rate) if rate else None,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
        "unix_time": time.time(),
    }


def timed(comm: Any, fn: Callable[[], Any], iters: int, mode: str = "batch") -> float:
    """Seconds per call of ``fn`` on the slowest rank (collective: every rank calls it).

    ``mode="batch"``: one barrier, then ``iters`` back-to-back calls; each
    rank's elapsed time divided by ``iters``, the maximum over ranks.
    ``mode="iter"``: a barrier before every call; per call the maximum over
    ranks, then the median over the calls.
    """
    from mpi4py import MPI

    clock = time.perf_counter
    if mode == "batch":
        comm.Barrier()
        t0 = clock()
        for _ in range(iters):
            fn()
        return comm.allreduce((clock() - t0) / iters, op=MPI.MAX)
    if mode != "iter":
        raise ValueError(f"timing mode {mode!r}: expected 'batch' or 'iter'")
    import numpy as np

    mine = np.empty(iters)
    for i in range(iters):
        comm.Barrier()
        t0 = clock()
        fn()
        mine[i] = clock() - t0
    slowest = np.empty_like(mine)
    comm.Allreduce(mine, slowest, op=MPI.MAX)
    return float(np.median(slowest))


def calibrate(comm: Any, fn: Callable[[], Any], warmup: int, target_s: float, lo: int,
              hi: int) -> int:
    """Warm ``fn`` up and return how many calls take about ``target_s`` (within ``lo``..``hi``).

    Collective; every rank returns the same count (from the slowest rank's time).
    """
    from mpi4py import MPI

    fn()                              # first call: allocations, connections
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(max(warmup, 1)):
        fn()
    per_call = comm.allreduce((time.perf_counter() - t0) / max(warmup, 1), op=MPI.MAX)
    want = int(target_s / per_call) if per_call > 0 else hi
    return max(lo, min(hi, want))


def runnable_tasks() -> int | None:
    """Tasks the kernel counts as runnable right now (``/proc/loadavg``); None where unknown.

    Busy-polling MPI ranks are always runnable, so more than the ranks on this host
    (plus one) means another job competes for the cores.
    """
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def stats(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, extremes and count of ``values`` (non-empty)."""
    v = sorted(values)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return {"median": float(statistics.median(v)), "p25": float(q[0]), "p75": float(q[2]),
            "min": float(v[0]), "max": float(v[-1]), "n": len(v)}


def median_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """Distribution-free ~95 % confidence interval of the median (order statistics).

    With few values it is simply the range.
    """
    v = sorted(values)
    half = z * len(v) ** 0.5 / 2
    lo = max(int(len(v) / 2 - half), 0)
    hi = min(int(-(-(len(v) / 2 + half) // 1)), len(v) - 1)
    return float(v[lo]), float(v[hi])


def fmt(v: Any) -> str:
    """A table cell: three significant digits for floats, blank for None."""
    if v is None:
        return ""
    if isinstance(v, float):
        if v != v:        # NaN
            return "n/a"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells go through :func:`fmt`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` (creating its folder), with the ``command`` that ran it where ``doc``
    names none; nothing when ``path`` is empty."""
    if not path:
        return
    doc.setdefault("command", command_line(doc.get("benchmark")))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def size_label(n: int) -> str:
    """``4096`` -> ``4KiB``; sizes that are not whole KiB/MiB stay in bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def init_gloo(world: Any, enabled: bool) -> tuple[Any, str | None]:
    """``torch.distributed`` on gloo over TCP with MPI's ranks, or ``(None, why not)``.

    Rank 0 picks a free port (on ``COMMLIB_CLUSTER_ADDR`` under the emulated cluster, else
    127.0.0.1) and broadcasts it.  torch gets one intra-op thread (ranks share the cores).
    """
    if not enabled:
        return None, "left out (--no-torch)"
    try:
        import torch
        import torch.distributed as dist
        why = None if dist.is_available() and dist.is_gloo_available() else "no gloo in this torch"
    except ImportError as exc:
        why = f"torch not importable: {exc}"
    if world.allreduce(why is not None, op=_lor()):
        return None, world.bcast(why) or "torch unavailable on some rank"
    torch.set_num_threads(1)
    if os.environ.get("COMMLIB_CLUSTER_NETNS"):
        # gloo binds to the host name's address (loopback in a namespace): use the rank's link
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    addr, port = None, None
    if world.rank == 0:
        addr = os.environ.get("COMMLIB_CLUSTER_ADDR", "127.0.0.1")
        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
    addr, port = world.bcast((addr, port))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=world.rank,
                                world_size=world.size, timeout=datetime.timedelta(seconds=60))
        why = None
    except Exception as exc:  # noqa: BLE001 - report, and go on without gloo
        why = f"init_process_group failed: {exc}"
    if world.allreduce(why is not None, op=_lor()):
        return None, why or "init_process_group failed on another rank"
    return dist, None


def _lor() -> Any:
    from mpi4py import MPI
    return MPI.LOR


def publish(args: argparse.Namespace, doc: dict[str, Any], report: Callable[[dict[str, Any]], str],
            plot: Callable[[dict[str, Any], str], None] | None = None) -> dict[str, Any]:
    """On rank 0: print ``report(doc)``, write ``--json`` and, given ``plot``, ``--plot``; return ``doc``."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.rank == 0:
        print(report(doc), flush=True)
        write_json(args.json, doc)
        if plot is not None and getattr(args, "plot", None):
            plot(doc, args.plot)
    return doc
