"""OSU-style sweep of allreduce, reduce_scatter, allgather: commlib against raw mpi4py and gloo.

In one run, on the same float32 numpy buffers, per operation and message size:

* ``mpi4py``      raw uppercase calls, out of place (``Allreduce``, ``Reduce_scatter``, ``Allgather``);
* ``commlib``     blocking calls (default settings: timeout 300 s, nonblocking MPI polled);
* ``commlib-nb``  the ``i``-form plus ``wait()`` (through the progress engine);
* ``commlib-t0``  blocking calls with ``timeout=0`` (the same polled path, no timeout);
* ``gloo``        ``torch.distributed`` on gloo, same memory (``all_reduce`` is in place: a copy first);
* ``mpi4py-nb``   (only with ``--contenders``) raw ``Iallreduce(...).Wait()`` and so on;
* ``commlib-torch`` (only with ``--contenders``) ``commlib``'s blocking calls on torch tensors that
  share those buffers (``torch.from_numpy``): what a torch user's call costs on top;
* ``mpi4py-new``, ``commlib-new`` (only with ``--contenders``) a new result per call, kept until
  the next call returns (``r = f(x)`` in a loop): raw calls into ``np.empty_like`` results, and
  commlib's calls without ``out``;
* ``jax-jit``     (only with ``--contenders``; allreduce, allgather) a jitted function calling
  ``commlib.bindings.jax.allreduce`` / ``allgather`` on a jax array, result ready;
* ``jax-eager``   (only with ``--contenders``; allreduce, allgather) the same calls outside
  ``jax.jit``, on a concrete jax array, result ready (metrics, a script's own collectives);
* ``mpi4jax``     (only with ``--contenders``, where it imports) the same jitted function with
  mpi4jax's ``allreduce`` / ``allgather`` on ``MPI.COMM_WORLD``: what a JAX user has today.

Operations: ``allreduce``, ``reduce_scatter``, ``allgather`` and ``rs+ag`` (reduce_scatter,
then allgather of the shard).  The size S is the full buffer (as nccl-tests): allreduce S in
and out, reduce_scatter S in and S/n out, allgather S/n in and S out; sizes below 4n bytes
are rounded up to whole float32 shards.

Timing (``--timing batch``): per size, every contender is warmed up, then one batch length is
chosen for all (about ``--target-ms`` per batch, at most ``--iters`` calls and
``--budget-bytes`` moved, at least ``--min-iters``; gloo gets its own).  A batch starts after a
barrier; its time is the slowest rank's elapsed time over the batch length.  The contenders
run round-robin, ``--rounds`` times (the first one rotates), and the median over rounds is
kept, so that machine noise (4 ranks on 2 cores) hits all of them alike.  ``--timing iter``:
a barrier before every call, per round the median over calls of the slowest rank's time.
Rank 0 counts runnable tasks after each round; the report flags sizes where other jobs competed.

Reported: latency, algorithm bandwidth S/t, bus bandwidth (allreduce and rs+ag
``2(n-1)/n * S/t``, reduce_scatter and allgather ``(n-1)/n * S/t``), the ratios
commlib/mpi4py, commlib-nb/commlib ("nb/blocking"), commlib-t0/mpi4py, gloo/mpi4py, and the
targets of :data:`TARGETS`.  With ``COMMLIB_CLUSTER_RATE`` (bits/s, set by
``benchmarks.cluster``) allreduce and rs+ag rows add the ring bound ``2(n-1)/n * S/B``.

Example:
    timeout 1800 mpiexec -n 4 python -m benchmarks.collectives --json out.json --plot out.png
    timeout 120 mpiexec -n 2 python -m benchmarks.collectives --quick --no-torch
    timeout 600 mpiexec -n 4 python -m benchmarks.collectives --no-torch --min-bytes 4096 \\
        --max-bytes 1048576 --step 16 --rounds 15 --contenders mpi4py mpi4py-nb commlib commlib-nb
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import commlib
from benchmarks import _common as bc
from benchmarks import engine_figures

OPS = ("allreduce", "reduce_scatter", "allgather", "rs+ag")
CONTENDERS = ("mpi4py", "commlib", "commlib-nb", "commlib-t0", "gloo")
OPTIONAL = ("mpi4py-nb", "commlib-torch", "mpi4py-new", "commlib-new", "jax-jit", "jax-eager",
            "mpi4jax")
#: ratio name -> (first, second contender)
RATIOS = {"commlib/mpi4py": ("commlib", "mpi4py"), "nb/blocking": ("commlib-nb", "commlib"),
          "t0/mpi4py": ("commlib-t0", "mpi4py"), "gloo/mpi4py": ("gloo", "mpi4py"),
          "mpi4py-nb/mpi4py": ("mpi4py-nb", "mpi4py"), "jax-jit/mpi4jax": ("jax-jit", "mpi4jax"),
          "jax-jit/mpi4py": ("jax-jit", "mpi4py"), "new/out": ("commlib-new", "commlib"),
          "commlib-new/mpi4py-new": ("commlib-new", "mpi4py-new"),
          "torch/numpy": ("commlib-torch", "commlib"), "jax-eager/numpy": ("jax-eager", "commlib")}
#: (ratio, sizes, limit): the project's targets, checked per operation at the end of a run
TARGETS = (("commlib/mpi4py", ">=1MiB", 1.05), ("commlib/mpi4py", "4KiB", 1.5),
           ("nb/blocking", "1MiB", 1.10))
_BUS = {"allreduce": 2.0, "rs+ag": 2.0, "reduce_scatter": 1.0, "allgather": 1.0}
#: an overlap slowdown below this is impossible (a loop does not run faster beside another): noise
SLOWDOWN_FLOOR = -0.05


def sizes(lo: int, hi: int, step: int = 4) -> list[int]:
    """Requested sizes in bytes: powers of ``step`` from ``lo``, plus 4 KiB, 1 MiB, 16 MiB, ``hi``."""
    out, s = {hi}, lo
    while s <= hi:
        out.add(s)
        s *= step
    return sorted(out | {x for x in (4096, 1 << 20, 16 << 20) if lo <= x <= hi})


def element_count(nbytes: int, n: int) -> int:
    """float32 elements of the full buffer: ``nbytes``/4 rounded up to a multiple of ``n``."""
    return -(-max(-(-nbytes // 4), 1) // n) * n


def ring_bound_s(nbytes: int, n: int, rate_bps: float) -> float:
    """Ring all-reduce lower bound ``2(n-1)/n * S / B`` in seconds (``rate_bps`` in bits/s)."""
    return 2 * (n - 1) / n * nbytes * 8 / rate_bps


def bus_factor(op: str, n: int) -> float:
    """Bus bandwidth over algorithm bandwidth: ``2(n-1)/n`` or ``(n-1)/n``."""
    return _BUS[op] * (n - 1) / n


def make_calls(op: str, count: int, world: Any, comm: commlib.Communicator,
               comm0: commlib.Communicator, dist: Any,
               wanted: list[str]) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """One callable per wanted contender doing ``op`` on a full buffer of ``count`` float32.

    Returns the calls and, for contenders that cannot do ``op``, why.  All of them read
    and write the same numpy buffers.
    """
    n = world.size
    x = np.random.default_rng(world.rank).random(count, dtype=np.float32)
    full, shard = np.empty(count, np.float32), np.empty(count // n, np.float32)
    part, counts, c, c0 = x[:count // n].copy(), [count // n] * n, comm, comm0
    kept: list[Any] = [None]        # the last new result, held while the next call runs

    def new(fill: Callable[[np.ndarray], Any], like: np.ndarray) -> None:
        r = np.empty_like(like)
        fill(r)
        kept[0] = r

    def keep(r: Any) -> None:
        kept[0] = r

    table: dict[str, dict[str, Callable[[], Any]]] = {
        "allreduce": {
            "mpi4py-new": lambda: new(lambda r: world.Allreduce(x, r), full),
            "commlib-new": lambda: keep(c.allreduce(x)),
            "mpi4py": lambda: world.Allreduce(x, full),
            "mpi4py-nb": lambda: world.Iallreduce(x, full).Wait(),
            "commlib": lambda: c.allreduce(x, out=full),
            "commlib-nb": lambda: c.iallreduce(x, out=full).wait(),
            "commlib-t0": lambda: c0.allreduce(x, out=full)},
        "reduce_scatter": {
            "mpi4py-new": lambda: new(lambda r: world.Reduce_scatter(x, r, counts), shard),
            "commlib-new": lambda: keep(c.reduce_scatter(x)),
            "mpi4py": lambda: world.Reduce_scatter(x, shard, counts),
            "mpi4py-nb": lambda: world.Ireduce_scatter(x, shard, counts).Wait(),
            "commlib": lambda: c.reduce_scatter(x, out=shard),
            "commlib-nb": lambda: c.ireduce_scatter(x, out=shard).wait(),
            "commlib-t0": lambda: c0.reduce_scatter(x, out=shard)},
        "allgather": {
            "mpi4py-new": lambda: new(lambda r: world.Allgather(part, r), full),
            "commlib-new": lambda: keep(c.allgather(part)),
            "mpi4py": lambda: world.Allgather(part, full),
            "mpi4py-nb": lambda: world.Iallgather(part, full).Wait(),
            "commlib": lambda: c.allgather(part, out=full),
            "commlib-nb": lambda: c.iallgather(part, out=full).wait(),
            "commlib-t0": lambda: c0.allgather(part, out=full)},
        "rs+ag": {
            "mpi4py": lambda: (world.Reduce_scatter(x, shard, counts), world.Allgather(shard, full)),
            "mpi4py-nb": lambda: (world.Ireduce_scatter(x, shard, counts).Wait(),
                                  world.Iallgather(shard, full).Wait()),
            "commlib": lambda: (c.reduce_scatter(x, out=shard), c.allgather(shard, out=full)),
            "commlib-nb": lambda: (c.ireduce_scatter(x, out=shard).wait(),
                                   c.iallgather(shard, out=full).wait()),
            "commlib-t0": lambda: (c0.reduce_scatter(x, out=shard), c0.allgather(shard, out=full))},
    }
    calls = {k: f for k, f in table[op].items() if k in wanted}
    skipped: dict[str, str] = {}
    for name in ("jax-jit", "jax-eager", "mpi4jax"):
        if name in wanted:
            call, why = jax_call(name, op, x, part, world, c)
            if call is not None:
                calls[name] = call
            else:
                skipped[name] = why
    if "commlib-torch" in wanted:
        import torch

        tx, tfull, tshard, tpart = (torch.from_numpy(a) for a in (x, full, shard, part))
        calls["commlib-torch"] = {
            "allreduce": lambda: c.allreduce(tx, out=tfull),
            "reduce_scatter": lambda: c.reduce_scatter(tx, out=tshard),
            "allgather": lambda: c.allgather(tpart, out=tfull),
            "rs+ag": lambda: (c.reduce_scatter(tx, out=tshard), c.allgather(tshard, out=tfull))}[op]
    if "gloo" in wanted and dist is not None:
        import torch

        tx, tfull, tshard, tpart = (torch.from_numpy(a) for a in (x, full, shard, part))
        # torch 2.13 renamed them *_single and deprecated the old names (a warning per call)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        g = {"allreduce": lambda: dist.all_reduce(tfull.copy_(tx)),
             "reduce_scatter": lambda: rs(tshard, tx),
             "allgather": lambda: ag(tfull, tpart),
             "rs+ag": lambda: (rs(tshard, tx), ag(tfull, tshard))}[op]
        try:
            g()
            why = None
        except Exception as exc:  # noqa: BLE001 - an op gloo lacks: skip it and say so
            why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
        if world.allreduce(why is not None, op=MPI.LOR):   # every rank agrees before timing
            skipped["gloo"] = world.allreduce([why] if why else [], op=MPI.SUM)[0]
        else:
            calls["gloo"] = g
    return calls, skipped


def jax_call(name: str, op: str, x: np.ndarray, part: np.ndarray, world: Any,
             comm: commlib.Communicator) -> tuple[Callable[[], Any] | None, str]:
    """A jitted JAX function doing ``op`` through commlib (``jax-jit``) or mpi4jax, or commlib's
    call outside jit (``jax-eager``), result ready; or None and why not."""
    if op not in ("allreduce", "allgather"):
        return None, "allreduce and allgather only"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if name in ("jax-jit", "jax-eager"):
        from commlib.bindings import jax as ours

        fn = (lambda a: ours.allreduce(a, "sum", comm)) if op == "allreduce" else (
            lambda a: ours.allgather(a, comm))
    else:
        try:
            import mpi4jax
        except ImportError as exc:
            return None, f"mpi4jax does not import here ({exc})"
        fn = (lambda a: mpi4jax.allreduce(a, op=MPI.SUM, comm=world)) if op == "allreduce" else (
            lambda a: mpi4jax.allgather(a, comm=world))
    f, arg = (fn if name == "jax-eager" else jax.jit(fn)), jax.numpy.asarray(x if op == "allreduce" else part)
    return (lambda: f(arg).block_until_ready()), ""


def make_row(op: str, nbytes: int, n: int, iters: dict[str, int], runs: dict[str, list[float]],
             skipped: dict[str, str], rate: float | None) -> dict[str, Any]:
    """Medians, bandwidths and ratios of one (operation, size)."""
    t = {k: bc.median(v) for k, v in runs.items()}
    row: dict[str, Any] = {
        "op": op, "bytes": nbytes, "iters": iters, "time_s": t, "all_s": runs,
        "stats_s": {k: bc.stats(v) for k, v in runs.items()},
        "algbw_GBps": {k: nbytes / v / 1e9 for k, v in t.items()},
        "busbw_GBps": {k: bus_factor(op, n) * nbytes / v / 1e9 for k, v in t.items()},
        "ratio": {k: t[a] / t[b] if a in t and b in t else None for k, (a, b) in RATIOS.items()},
        "ratio_paired": {}, "skipped": skipped}
    for k, (a, b) in RATIOS.items():
        if a in runs and b in runs:   # per round, then the median: robust to slow drifts
            q = [p / r for p, r in zip(runs[a], runs[b])]
            row["ratio_paired"][k] = {"median": bc.median(q), "ci95": bc.median_ci(q)}
    if rate and op in ("allreduce", "rs+ag"):
        row["ring_bound_s"] = ring_bound_s(nbytes, n, rate)
        row["ratio"]["commlib/ring_bound"] = t["commlib"] / row["ring_bound_s"] if "commlib" in t else None
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The sweep (collective: every rank calls it); returns the full result document."""
    world = MPI.COMM_WORLD
    n = world.size
    comm = commlib.init()
    comm0 = commlib.init(comm=world, timeout=0)
    dist, gloo_why = bc.init_gloo(world, "gloo" in args.contenders)
    env = bc.environment(world)
    grid = sorted({element_count(s, n) * 4 for s in sizes(args.min_bytes, args.max_bytes, args.step)})
    from tqdm import tqdm
    bar = tqdm(total=len(grid) * len(args.ops), desc="collectives", file=sys.stderr, unit="size",
               disable=world.rank != 0)
    rows = []
    for op in args.ops:
        for nbytes in grid:
            bar.set_postfix_str(f"{op} {bc.size_label(nbytes)}")
            calls, skipped = make_calls(op, nbytes // 4, world, comm, comm0, dist, args.contenders)
            if "gloo" in args.contenders and dist is None:
                skipped["gloo"] = gloo_why or "unavailable"
            names = [c for c in args.contenders if c in calls]
            cap = max(args.min_iters, min(args.iters, args.budget_bytes // nbytes))
            own = {c: bc.calibrate(world, calls[c], args.warmup, args.target_ms / 1e3, args.min_iters, cap)
                   for c in names}
            common = min((v for c, v in own.items() if c != "gloo"), default=0)
            iters = {c: v if c == "gloo" else common for c, v in own.items()}
            runs: dict[str, list[float]] = {c: [] for c in names}
            busy = []
            for r in range(args.rounds if names else 0):
                k = r % len(names)
                for c in names[k:] + names[:k]:       # round-robin, rotating who goes first
                    runs[c].append(bc.timed(world, calls[c], iters[c], args.timing))
                busy.append(bc.runnable_tasks() if world.rank == 0 else None)
            rows.append(make_row(op, nbytes, n, iters, runs, skipped, env["cluster_rate_bps"]))
            rows[-1]["runnable"] = busy
            bar.update(1)
    bar.close()
    engine = {}
    if not args.no_engine_figures:
        small = {"nbytes": 1 << 20, "rounds": 2} if args.quick else {}
        torch_here = importlib.util.find_spec("torch") is not None
        engine = {"overhead": engine_figures.overhead(world),
                  "overlap": engine_figures.overlap(world, **small) if torch_here else None}
    if dist is not None:
        dist.destroy_process_group()
    comm0.close()
    env["loadavg_end"] = list(os.getloadavg())
    argv = sys.argv[1:] if args.argv is None else args.argv
    return {"benchmark": "collectives", "command": bc.command_line("collectives", argv),
            "env": env, "args": vars(args), "results": rows, "checks": checks(rows),
            "engine": engine, "engine_checks": engine_checks(engine)}


def checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The :data:`TARGETS` per operation, at the worst of the sizes this run measured."""
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):
        for name, where, limit in TARGETS:
            pick = [r for r in rows if r["op"] == op and r["ratio"].get(name) is not None and (
                r["bytes"] >= 1 << 20 if where == ">=1MiB" else bc.size_label(r["bytes"]) == where)]
            if pick:
                worst = max(pick, key=lambda r: r["ratio"][name])
                out.append({"op": op, "ratio": name, "sizes": where, "worst_size": worst["bytes"],
                            "value": worst["ratio"][name], "paired": worst["ratio_paired"].get(name, {}),
                            "limit": limit, "ok": worst["ratio"][name] <= limit})
    return out


def engine_checks(engine: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine's targets: per-call overhead on one rank, overlap slowdowns on two."""
    out = []
    oh, ov = engine.get("overhead"), engine.get("overlap")
    if oh:
        out += [{"figure": "overhead, blocking (us)", "value": oh["blocking_overhead_us"], "limit": 5.0},
                {"figure": "overhead, i-form + wait (us)", "value": oh["nonblocking_overhead_us"],
                 "limit": 15.0}]
        out += [{"figure": f"overhead, {op} (us)", "value": oh[f"{op}_overhead_us"], "limit": 5.0}
                for op in ("broadcast", "barrier") if f"{op}_overhead_us" in oh]
    if ov:
        out += [{"figure": "overlap: allreduce slowdown", "value": ov["allreduce_slowdown"], "limit": 0.15},
                {"figure": "overlap: matmul slowdown", "value": ov["matmul_slowdown"], "limit": 0.15}]
        if ov.get("floor_larger_slowdown") is not None:   # CPU-bound: the floor, not 15 %, is what can hold
            out.append({"figure": "overlap: larger slowdown against its CPU floor + 15 points",
                        "value": max(ov["allreduce_slowdown"], ov["matmul_slowdown"]),
                        "limit": ov["floor_larger_slowdown"] + 0.15})
    for c in out:
        c["ok"] = c["value"] <= c["limit"]
        if c["figure"].startswith("overlap") and c["value"] < SLOWDOWN_FLOOR:
            # running beside another job cannot make a loop faster: timing noise, not a figure
            c["ok"] = None
            c["note"] = f"not measured: a slowdown below {SLOWDOWN_FLOOR:.0%} is noise"
    return out


def report(doc: dict[str, Any]) -> str:
    """Markdown: latencies with ratios, bandwidths, notes, and the targets."""
    rows, env, a = doc["results"], doc["env"], doc["args"]
    names = [c for c in CONTENDERS + OPTIONAL if any(c in r["time_s"] for r in rows)]
    rnames = [k for k in RATIOS if any(r["ratio"].get(k) is not None for r in rows)]
    ring = any("ring_bound_s" in r for r in rows)
    head = ["op", "size"] + [f"{c} us" for c in names] + rnames
    head += ["ring bound us", "commlib/bound"] if ring else []
    lat = []
    for r in rows:
        line = [r["op"], bc.size_label(r["bytes"])] + [r["time_s"][c] * 1e6 if c in r["time_s"] else "n/a"
                                                       for c in names]
        line += [r["ratio"].get(k) if r["ratio"].get(k) is not None else "n/a" for k in rnames]
        if ring:
            line += [r["ring_bound_s"] * 1e6, r["ratio"]["commlib/ring_bound"]] if "ring_bound_s" in r \
                else ["", ""]
        lat.append(line)
    bw = [[r["op"], bc.size_label(r["bytes"])] + [r["algbw_GBps"].get(c, "n/a") for c in names]
          + [r["busbw_GBps"].get(c, "n/a") for c in names] for r in rows]
    rate = env["cluster_rate_bps"]
    shaped = (f"emulated cluster, links at {rate / 1e9:g} Gbit/s" if env["cluster_shaped"] and rate
              else "shaped cluster" if env["cluster_shaped"] else "unshaped (one host, shared memory)")
    how = ("batch after a barrier, slowest rank, per call" if a["timing"] == "batch"
           else "barrier before each call, median over calls of the slowest rank")
    out = [f"{env['ranks']} ranks on {env['host']} ({env['cpus']} cpus, load {env['loadavg'][0]:.1f}), "
           f"{env['mpi']}, {shaped}; timing: {how}; median of {a['rounds']} round-robin rounds. "
           "Ratio > 1: the first is slower.", "", "Latency (us) and ratios", "", bc.markdown_table(head, lat),
           "", "Bandwidth (GB/s): algbw = S/t; busbw = algbw * 2(n-1)/n (allreduce, rs+ag) "
           "or (n-1)/n (reduce_scatter, allgather)", "",
           bc.markdown_table(["op", "size"] + [f"{c} algbw" for c in names]
                             + [f"{c} busbw" for c in names], bw)]
    notes = sorted({f"{c} skipped {r['op']}: {why}" for r in rows for c, why in r["skipped"].items()})
    crowded = [r for r in rows if any((b or 0) > env["local_ranks"] + 1 for b in r.get("runnable", []))]
    if crowded:
        notes.append(f"other jobs competed for the cores during {len(crowded)} of {len(rows)} sizes "
                     f"(more than {env['local_ranks'] + 1} runnable tasks): read those rows with care")
    out += ["", "Notes:", ""] + [f"* {s}" for s in notes] if notes else []
    if doc.get("checks"):
        ck = [[c["op"], c["ratio"], c["sizes"], bc.size_label(c["worst_size"]), c["value"],
               c["paired"].get("median"), "{:.3g}-{:.3g}".format(*c["paired"]["ci95"]) if c["paired"] else "",
               c["limit"], "ok" if c["ok"] else "MISSED"] for c in doc["checks"]]
        out += ["", "Targets (value: ratio of the medians at the worst size in range; paired: median "
                "over rounds of the same-round ratio, with its 95 % confidence interval)", "",
                bc.markdown_table(["op", "ratio", "sizes", "worst at", "value", "paired", "paired 95% CI",
                                   "limit", ""], ck)]
    eng = doc.get("engine") or {}
    if eng.get("overhead"):
        oh = eng["overhead"]
        out += ["", "Per-call cost on one rank, 16 float32 (us): commlib against raw mpi4py", "",
                bc.markdown_table(["form", "mpi4py", "commlib", "overhead"], [
                    ["blocking", oh["mpi4py_us"], oh["commlib_us"], oh["blocking_overhead_us"]],
                    ["i-form + wait()", oh["mpi4py-nb_us"], oh["commlib-nb_us"],
                     oh["nonblocking_overhead_us"]]] + [
                    [op, oh[f"mpi4py-{key}_us"], oh[f"commlib-{key}_us"], oh[f"{op}_overhead_us"]]
                    for op, key in (("broadcast", "bcast"), ("barrier", "barrier"))
                    if f"{op}_overhead_us" in oh])]
    if eng.get("overlap"):
        ov = eng["overlap"]
        out += ["", f"Overlap on 2 ranks: {bc.size_label(ov['bytes'])} iallreduce while the caller runs "
                f"{ov['matmul_steps']} torch matmuls (256x256, one thread) (s)", "",
                bc.markdown_table(["", "alone", "together", "slowdown"], [
                    ["iallreduce", ov["allreduce_alone_s"], ov["allreduce_together_s"],
                     ov["allreduce_slowdown"]],
                    ["matmul loop", ov["matmul_alone_s"], ov["matmul_together_s"], ov["matmul_slowdown"]]])]
        if min(ov["allreduce_slowdown"], ov["matmul_slowdown"]) < SLOWDOWN_FLOOR:
            out += ["", f"A slowdown below {SLOWDOWN_FLOOR:.0%} is timing noise: the overlap targets are "
                    "not measured in this run."]
        if ov.get("allreduce_cpu_s") is not None:
            out += ["", f"The all-reduce alone needs {ov['allreduce_cpu_s'] * 1e3:.3g} ms of CPU "
                    f"({ov['allreduce_cpu_s'] / ov['allreduce_alone_s']:.0%} of its time; user + system, "
                    "driven without busy-wait); "
                    + (f"with {ov['cores_per_rank']:g} core per rank the larger slowdown cannot go below "
                       f"{ov['floor_larger_slowdown']:.0%}." if ov.get("floor_larger_slowdown") is not None
                       else f"{ov['cores_per_rank']:g} cores per rank: no CPU floor.")]
    if doc.get("engine_checks"):
        out += ["", "Engine targets", "", bc.markdown_table(["figure", "value", "limit", ""], [
            [c["figure"], c["value"], c["limit"],
             c.get("note", "not measured") if c["ok"] is None else "ok" if c["ok"] else "MISSED"]
            for c in doc["engine_checks"]])]
    return "\n".join(out)


def plot(doc: dict[str, Any], path: str) -> None:
    """Latency (top) and bus bandwidth (bottom) against size, log-log, one column per operation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(2, len(ops), figsize=(4.6 * len(ops), 7.5), squeeze=False)
    for j, op in enumerate(ops):
        sel = [r for r in rows if r["op"] == op]
        for c in CONTENDERS + OPTIONAL:
            pts = [(r["bytes"], r["time_s"][c] * 1e6, r["busbw_GBps"][c]) for r in sel if c in r["time_s"]]
            if pts:
                xs, ts, bws = zip(*pts)
                axes[0][j].loglog(xs, ts, marker="o", ms=3, label=c)
                axes[1][j].loglog(xs, bws, marker="o", ms=3, label=c)
        bound = [(r["bytes"], r["ring_bound_s"] * 1e6) for r in sel if "ring_bound_s" in r]
        if bound:
            axes[0][j].loglog(*zip(*bound), "k--", label="ring bound")
        axes[0][j].set(title=f"{op} ({doc['env']['ranks']} ranks)", ylabel="latency (us)")
        axes[1][j].set(ylabel="bus bandwidth (GB/s)")
        for ax in axes[:, j]:
            ax.set_xlabel("size S (bytes, full buffer)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options (see the module docs); ``--quick`` is a sweep of seconds for tests."""
    p = bc.base_parser(__doc__.splitlines()[0], plot=True)
    p.add_argument("--min-bytes", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--step", type=int, default=4, help="size ratio of the sweep (2, 4, ...)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS + OPTIONAL)
    p.add_argument("--no-torch", action="store_true",
                   help="leave torch.distributed/gloo out (the overlap figure runs wherever torch imports)")
    p.add_argument("--no-engine-figures", action="store_true",
                   help="skip the per-call overhead and overlap figures (benchmarks.engine_figures)")
    p.add_argument("--rounds", type=bc.positive_int, default=9,
                   help="round-robin rounds per size (median kept)")
    p.add_argument("--timing", choices=("batch", "iter"), default="batch")
    p.add_argument("--iters", type=bc.positive_int, default=1000,
                   help="most calls per timed batch")
    p.add_argument("--min-iters", type=bc.positive_int, default=3,
                   help="fewest calls per timed batch")
    p.add_argument("--budget-bytes", type=int, default=256 << 20,
                   help="at most this many bytes (S * calls) per batch: fewer calls for large S")
    p.add_argument("--target-ms", type=float, default=25.0, help="aim for batches this long")
    p.add_argument("--warmup", type=int, default=3, help="calls before timing (also calibrate)")
    # --quick: a sweep of seconds; it sets the defaults only, an option given on the command line wins
    args = bc.parse_quick(p, argv, max_bytes=1 << 20, step=16, rounds=2, iters=20, min_iters=2,
                          target_ms=3.0, warmup=1)
    args.argv = argv
    if args.no_torch:
        args.contenders = [c for c in args.contenders if c != "gloo"]
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes or args.rounds < 1 or args.step < 2:
        p.error("need 1 <= --min-bytes <= --max-bytes, --rounds >= 1, --step >= 2")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep; rank 0 prints the Markdown report and writes ``--json`` and ``--plot``."""
    args = parse_args(argv)
    return bc.publish(args, run(args), report, plot)


if __name__ == "__main__":
    main()
