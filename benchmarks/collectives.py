"""OSU-style sweep of allreduce, reduce_scatter and allgather: commlib against raw mpi4py and gloo.

In one run, on the same buffers, per operation and message size:

* ``mpi4py``      raw uppercase calls (``Allreduce``, ``Reduce_scatter``, ``Allgather``);
* ``commlib``     blocking calls;
* ``commlib-nb``  the ``i``-form plus ``wait()`` (through the progress engine);
* ``commlib-t0``  blocking calls with ``timeout=0`` (MPI's blocking collectives, no hang detection);
* ``gloo``        ``torch.distributed`` over gloo (``--no-torch`` leaves it out).

Contenders run round-robin, ``--rounds`` times per size, and the median is
kept, so machine noise hits all of them alike.  Each time is a batch of
calls after a barrier, divided by the batch length, of the slowest rank.
Bus bandwidth follows the NCCL-tests convention: allreduce ``2(n-1)/n * S/t``,
reduce_scatter and allgather ``(n-1)/n * S/t`` with S the full buffer.
Under the emulated cluster (``COMMLIB_CLUSTER_RATE`` set, bits/s) the table
adds the ring lower bound ``2(n-1)/n * S/B`` of allreduce and
reduce_scatter + allgather.

Example:
    mpiexec -n 4 python -m benchmarks.collectives --json out.json --plot out.png
    mpiexec -n 2 python -m benchmarks.collectives --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import commlib
from benchmarks._common import environment, markdown_table, median, size_label, timed, write_json

OPS = ("allreduce", "reduce_scatter", "allgather", "rs+ag")
CONTENDERS = ("mpi4py", "commlib", "commlib-nb", "commlib-t0", "gloo")


def sizes(lo: int, hi: int) -> list[int]:
    """Message sizes in bytes: powers of 4 from ``lo``, plus 4 KiB, 1 MiB, 16 MiB and ``hi``."""
    out = {hi}
    s = lo
    while s <= hi:
        out.add(s)
        s *= 4
    out |= {x for x in (4096, 1 << 20, 16 << 20) if lo <= x <= hi}
    return sorted(out)


def _gloo(world: Any, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    # torch 2.13 renamed reduce_scatter_tensor; the old name is the one every release has
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    port = world.bcast(29500 + os.getpid() % 2000 if world.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=world.rank, world_size=world.size)
    return dist


def make_calls(op: str, nbytes: int, world: Any, comm: commlib.Communicator,
               comm0: commlib.Communicator, dist: Any) -> dict[str, Callable[[], Any] | None]:
    """One callable per contender doing ``op`` on ``nbytes`` (None: not supported)."""
    n = world.size
    count = max(nbytes // 4, n)
    count -= count % n          # divisible, so every contender does the same work
    x = np.random.default_rng(world.rank).random(count, dtype=np.float32)
    full = np.empty(count, np.float32)
    shard = np.empty(count // n, np.float32)
    gathered = np.empty(count * n, np.float32)
    counts = [count // n] * n
    calls: dict[str, Callable[[], Any] | None] = {}
    if op == "allreduce":
        calls["mpi4py"] = lambda: world.Allreduce(x, full)
        calls["commlib"] = lambda: comm.allreduce(x, out=full)
        calls["commlib-nb"] = lambda: comm.iallreduce(x, out=full).wait()
        calls["commlib-t0"] = lambda: comm0.allreduce(x, out=full)
    elif op == "reduce_scatter":
        calls["mpi4py"] = lambda: world.Reduce_scatter(x, shard, counts)
        calls["commlib"] = lambda: comm.reduce_scatter(x, out=shard)
        calls["commlib-nb"] = lambda: comm.ireduce_scatter(x, out=shard).wait()
        calls["commlib-t0"] = lambda: comm0.reduce_scatter(x, out=shard)
    elif op == "allgather":
        calls["mpi4py"] = lambda: world.Allgather(x, gathered)
        calls["commlib"] = lambda: comm.allgather(x, out=gathered)
        calls["commlib-nb"] = lambda: comm.iallgather(x, out=gathered).wait()
        calls["commlib-t0"] = lambda: comm0.allgather(x, out=gathered)
    else:  # reduce_scatter then allgather of the shard: DeAR's decoupled allreduce
        calls["mpi4py"] = lambda: (world.Reduce_scatter(x, shard, counts), world.Allgather(shard, full))
        calls["commlib"] = lambda: (comm.reduce_scatter(x, out=shard), comm.allgather(shard, out=full))
        calls["commlib-nb"] = lambda: (comm.ireduce_scatter(x, out=shard).wait(),
                                       comm.iallgather(shard, out=full).wait())
        calls["commlib-t0"] = lambda: (comm0.reduce_scatter(x, out=shard), comm0.allgather(shard, out=full))
    calls["gloo"] = None
    if dist is not None:
        import torch

        tx, tfull = torch.from_numpy(x), torch.from_numpy(full)
        tshard, tgath = torch.from_numpy(shard), torch.from_numpy(gathered)
        g = {"allreduce": lambda: dist.all_reduce(tfull.copy_(tx)),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(tshard, tx),
             "allgather": lambda: dist.all_gather_into_tensor(tgath, tx),
             "rs+ag": lambda: (dist.reduce_scatter_tensor(tshard, tx),
                               dist.all_gather_into_tensor(tfull, tshard))}[op]
        try:
            g()
            ok = True
        except (RuntimeError, ValueError):
            ok = False
        ok = world.allreduce(int(ok), op=MPI.MIN)   # every rank agrees before timing
        calls["gloo"] = g if ok else None
    return calls


def busbw(op: str, nbytes: int, n: int, seconds: float) -> float:
    """Bus bandwidth in GB/s."""
    factor = {"allreduce": 2 * (n - 1) / n, "rs+ag": 2 * (n - 1) / n}.get(op, (n - 1) / n)
    return factor * nbytes / seconds / 1e9


def ring_bound_s(nbytes: int, n: int, rate_bps: float) -> float:
    """Ring all-reduce lower bound 2(n-1)/n * S / B, in seconds."""
    return 2 * (n - 1) / n * nbytes * 8 / rate_bps


def run(args: argparse.Namespace) -> dict[str, Any]:
    world = MPI.COMM_WORLD
    comm = commlib.init()
    comm0 = commlib.init(comm=world, timeout=0)
    dist = _gloo(world, not args.no_torch)
    env = environment(world)
    rate = env["cluster_rate_bps"]
    grid = sizes(args.min_bytes, args.max_bytes)
    bar = None
    if world.rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=len(grid) * len(args.ops), desc="collectives", file=sys.stderr)
    results = []
    for op in args.ops:
        for nbytes in grid:
            calls = make_calls(op, nbytes, world, comm, comm0, dist)
            iters = int(min(args.max_iters, max(args.min_iters, args.budget_bytes // nbytes)))
            times: dict[str, list[float]] = {c: [] for c in CONTENDERS if calls.get(c)}
            for _ in range(args.rounds):
                for name in times:
                    times[name].append(timed(world, calls[name], iters))
            row = {"op": op, "bytes": nbytes, "iters": iters,
                   "time_s": {k: median(v) for k, v in times.items()},
                   "all_s": times}
            t = row["time_s"]
            row["busbw_GBps"] = {k: busbw(op, nbytes, world.size, v) for k, v in t.items()}
            row["ratio"] = {
                "commlib/mpi4py": t["commlib"] / t["mpi4py"],
                "nb/blocking": t["commlib-nb"] / t["commlib"],
                "t0/mpi4py": t["commlib-t0"] / t["mpi4py"],
                "gloo/mpi4py": t["gloo"] / t["mpi4py"] if "gloo" in t else None,
            }
            if rate and op in ("allreduce", "rs+ag"):
                row["ring_bound_s"] = ring_bound_s(nbytes, world.size, rate)
                row["ratio"]["commlib/ring_bound"] = t["commlib"] / row["ring_bound_s"]
            results.append(row)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if dist is not None:
        dist.destroy_process_group()
    return {"benchmark": "collectives", "env": env, "args": vars(args), "results": results}


def report(doc: dict[str, Any]) -> str:
    """The Markdown table of a run."""
    ring = any("ring_bound_s" in r for r in doc["results"])
    header = ["op", "size", "mpi4py us", "commlib us", "commlib-nb us", "commlib-t0 us", "gloo us",
              "commlib/mpi4py", "nb/blocking", "t0/mpi4py", "gloo/mpi4py", "commlib busbw GB/s"]
    if ring:
        header += ["ring bound us", "commlib/bound"]
    rows = []
    for r in doc["results"]:
        t, q = r["time_s"], r["ratio"]
        row = [r["op"], size_label(r["bytes"]), t["mpi4py"] * 1e6, t["commlib"] * 1e6,
               t["commlib-nb"] * 1e6, t["commlib-t0"] * 1e6, t["gloo"] * 1e6 if "gloo" in t else "n/a",
               q["commlib/mpi4py"], q["nb/blocking"], q["t0/mpi4py"],
               q["gloo/mpi4py"] if q["gloo/mpi4py"] is not None else "n/a",
               r["busbw_GBps"]["commlib"]]
        if ring:
            row += [r["ring_bound_s"] * 1e6 if "ring_bound_s" in r else "",
                    q.get("commlib/ring_bound", "")]
        rows.append(row)
    env = doc["env"]
    shaped = (f"emulated cluster, links at {env['cluster_rate_bps'] / 1e9:g} Gbit/s"
              if env["cluster_shaped"] else "unshaped (shared memory on one host)")
    head = (f"{env['ranks']} ranks, {env['mpi']}, {shaped}; median of {doc['args']['rounds']} "
            "round-robin rounds, slowest rank")
    return head + "\n\n" + markdown_table(header, rows)


def plot(doc: dict[str, Any], path: str) -> None:
    """Latency against size, one panel per operation, one line per contender."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in doc["results"]))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in doc["results"] if r["op"] == op]
        for c in CONTENDERS:
            pts = [(r["bytes"], r["time_s"][c] * 1e6) for r in rows if c in r["time_s"]]
            if pts:
                ax.loglog(*zip(*pts), marker="o", ms=3, label=c)
        bound = [(r["bytes"], r["ring_bound_s"] * 1e6) for r in rows if "ring_bound_s" in r]
        if bound:
            ax.loglog(*zip(*bound), "k--", label="ring bound")
        ax.set_title(op)
        ax.set_xlabel("bytes")
        ax.set_ylabel("latency (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-bytes", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget-bytes", type=int, default=256 << 20,
                   help="bytes moved per timed batch (sets the iterations per size)")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=300)
    p.add_argument("--no-torch", action="store_true", help="leave torch.distributed/gloo out")
    p.add_argument("--quick", action="store_true", help="a short sweep (tests, smoke runs)")
    p.add_argument("--json", help="write all figures here")
    p.add_argument("--plot", help="write a PNG plot here")
    args = p.parse_args(argv)
    if args.quick:
        args.max_bytes = min(args.max_bytes, 1 << 20)
        args.rounds, args.budget_bytes, args.max_iters = 1, 8 << 20, 30
    doc = run(args)
    if MPI.COMM_WORLD.rank == 0:
        print(report(doc), flush=True)
        write_json(args.json, doc)
        if args.plot:
            plot(doc, args.plot)


if __name__ == "__main__":
    main()
