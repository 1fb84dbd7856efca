"""GPU figures on one GPU: the copy ceiling, NCCL through commlib against raw NCCL, ExDyna selection.

Three parts, each with its contenders side by side in one run:

* ``copy``: a device-to-device copy of ``--copy-mib`` MiB (cupy), counting
  bytes read plus bytes written: the device's memory ceiling, and from it the
  time of one read of the gradient (the floor of any selection).
* ``collectives``: on an NCCL communicator of one rank, per size, a blocking
  commlib call on a cupy array against the raw NCCL call (cupy's
  ``NcclCommunicator`` on its own stream, then a stream synchronize): time per
  call (the latency floor at small sizes), algorithm bandwidth (bytes / time;
  a one-rank all-reduce is a device copy) and the ratio commlib / raw.
* ``selection``: ExDyna (``--density``) on a ``--numel`` float32 gradient of
  one rank, after ``--settle`` steps of real reductions (error feedback
  included) so the threshold holds the density; the local selection (the
  one-pass scan with its histogram, the boundary choice, the take of the
  boundary bin; the scan and the rest also timed alone) against
  ``torch.topk`` of ``|g|`` with the same k, in time
  and GB/s of gradient read, with the ratio to one read at the copy ceiling;
  and the same two kernels alone, queued behind a hold kernel so that the
  host's launches never leave the GPU waiting (the GPU's time of the
  selection), against topk's GPU time likewise.
  Targets (issue 14): selection <= 3x one read, >= 10x faster than topk.

Example (on a GPU machine; one rank):
    python -m benchmarks.gpu --json gpu.json
    python -m benchmarks.gpu --quick
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import _common as bc

SIZES = [8 << (3 * i) for i in range(9)]        # 8 B .. 128 MiB, by 8x
OPS = ("allreduce", "allgather", "broadcast", "reduce_scatter")
READ_TARGET, TOPK_TARGET = 3.0, 10.0


def wall(fn: Callable[[], Any], sync: Callable[[], None], iters: int, rounds: int) -> float:
    """Median over ``rounds`` of the seconds per call of ``iters`` back-to-back calls (synced)."""
    fn()
    sync()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        per.append((time.perf_counter() - t0) / iters)
    return bc.median(per)


def calibrated(fn: Callable[[], Any], sync: Callable[[], None], target_s: float, rounds: int) -> float:
    """:func:`wall` with ``iters`` chosen so one batch lasts about ``target_s``."""
    once = wall(fn, sync, 1, 3)
    iters = max(1, min(2000, int(target_s / max(once, 1e-7))))
    return wall(fn, sync, iters, rounds)


def device_time(cupy: Any, fn: Callable[[], Any], rounds: int) -> float:
    """Median GPU time of one call of ``fn`` (``cupyx.profiler.benchmark``: events around each call)."""
    from cupyx.profiler import benchmark

    return float(np.median(benchmark(fn, n_repeat=max(10, rounds), n_warmup=3).gpu_times[0]))


def copy_ceiling(cupy: Any, mib: int, rounds: int) -> dict[str, float]:
    """Device-to-device copy: bytes read + written per second (median of event-timed copies)."""
    n = (mib << 20) // 4
    a = cupy.random.standard_normal(n, dtype=cupy.float32)
    b = cupy.empty_like(a)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(rounds + 2):
        start.record()
        b[...] = a
        stop.record()
        stop.synchronize()
        if i >= 2:
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    assert bool((b[:1000] == a[:1000]).all())
    t = bc.median(times)
    return {"bytes": 2 * a.nbytes, "seconds": t, "bytes_per_s": 2 * a.nbytes / t}


def _contenders(comm: Any, raw: Any, s: int, x: Any, out: Any, f32: int,
                total: int) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """Per op: the raw NCCL call on stream ``s`` and the commlib call, on ``x`` and ``out``."""
    n, xp, op = x.size, x.data.ptr, out.data.ptr
    raws = {"allreduce": lambda: raw.allReduce(xp, op, n, f32, total, s),
            "allgather": lambda: raw.allGather(xp, op, n, f32, s),
            "broadcast": lambda: raw.bcast(xp, n, f32, 0, s),
            "reduce_scatter": lambda: raw.reduceScatter(xp, op, n, f32, total, s)}
    ours = {"allreduce": lambda: comm.allreduce(x, out=out),
            "allgather": lambda: comm.allgather(x, out=out),
            "broadcast": lambda: comm.broadcast(x, root=0),
            "reduce_scatter": lambda: comm.reduce_scatter(x, out=out)}
    return raws, ours


def collectives(comm: Any, cupy: Any, sizes: list[int], target_s: float, rounds: int) -> list[dict]:
    """commlib on NCCL against raw cupy NCCL calls, one rank, per op and size."""
    from cupy.cuda import nccl

    raw = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        x = cupy.random.standard_normal(n, dtype=cupy.float32)
        out = cupy.empty_like(x)
        raws, ours = _contenders(comm, raw, stream.ptr, x, out, nccl.NCCL_FLOAT32, nccl.NCCL_SUM)
        got = comm.allreduce(x)
        assert bool((got == x).all()), "one-rank allreduce must return its input"
        for op in OPS:
            t_raw = calibrated(raws[op], stream.synchronize, target_s, rounds)
            t_ours = calibrated(ours[op], cupy.cuda.get_current_stream().synchronize, target_s, rounds)
            t_raw2 = calibrated(raws[op], stream.synchronize, target_s, rounds)   # the spread
            rows.append({"op": op, "bytes": n * 4, "raw_us": 1e6 * min(t_raw, t_raw2),
                         "raw_spread": max(t_raw, t_raw2) / min(t_raw, t_raw2),
                         "commlib_us": 1e6 * t_ours, "ratio": t_ours / min(t_raw, t_raw2),
                         "algbw_GBps": n * 4 / t_ours / 1e9})
    raw.destroy()
    return rows


def host_profile(fn: Callable[[], Any], calls: int, top: int = 12) -> list[dict[str, Any]]:
    """Where the host's time goes in ``calls`` calls of ``fn`` (cProfile): the ``top`` functions by
    their own time, in microseconds per call of ``fn``."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats                  # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{name} ({file.rsplit('/', 1)[-1]}:{line})", "calls": nc / calls,
             "own_us": 1e6 * tt / calls, "cumulative_us": 1e6 * ct / calls}
            for (file, line, name), (_, nc, tt, ct, _) in rows]


#: a kernel that keeps the GPU busy for ``ns`` nanoseconds (one thread): queued ahead of the calls
#: timed by :func:`queued_time`, so that the host's launches never leave the GPU waiting
_HOLD_SOURCE = r"""
extern "C" __global__ void hold(unsigned long long ns)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""


def queued_time(cupy: Any, fn: Callable[[], Any], calls: int, hold_ms: float = 30.0) -> dict[str, Any]:
    """GPU time per call of ``fn`` with the host ahead of the GPU: a hold kernel first, then
    ``calls`` calls queued behind it between two CUDA events (what the calls cost the GPU where the
    host keeps ahead, as in a training step; ``host_ahead`` says whether it did here)."""
    hold = cupy.RawKernel(_HOLD_SOURCE, "hold")
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    fn()
    cupy.cuda.get_current_stream().synchronize()
    hold((1,), (1,), (np.uint64(hold_ms * 1e6),))
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    queued_s = time.perf_counter() - t0
    stop.synchronize()
    return {"gpu_s": cupy.cuda.get_elapsed_time(start, stop) / 1e3 / calls,
            "host_ahead": queued_s < hold_ms / 1e3}


def selection(comm: Any, cupy: Any, numel: int, density: float, settle: int, rounds: int,
              profile_calls: int = 0) -> dict:
    """ExDyna's local selection on the GPU against torch.topk (see module docs)."""
    from commlib import sparsify
    from commlib.sparsify import gpu_select
    from commlib.sparsify.exdyna import scan_partition, take_chosen

    sel = sparsify.ExDyna(density).setup(comm, numel, cupy)
    fb = sparsify.ErrorFeedback(numel, np.float32, cupy)
    rng = cupy.random.default_rng(7)
    densities, rescans, offsets = [], 0, []
    for _ in range(settle):
        half = sel.policy.half
        out = sel.reduce(fb.accumulate(rng.standard_normal(numel, dtype=cupy.float32)))
        fb.settle(out)
        densities.append(out.stats.density)
        rescans += bool(out.stats.extra["rescanned"])
        offsets.append(out.stats.extra["boundary"] - half)
    acc = fb.accumulate(rng.standard_normal(numel, dtype=cupy.float32))
    policy = sel.policy
    sync = cupy.cuda.get_current_stream().synchronize

    def table_of(fields: list[Any]) -> np.ndarray:
        """The all-gathered counts table of a world of one: this rank's record."""
        return np.concatenate(([0], np.asarray(fields[0]).ravel()))[None, :]

    def select(xp: Any, part: Any) -> Any:
        """ExDyna's local selection, as one rank of one selects."""
        scan, fields = scan_partition(xp, part, policy)
        return take_chosen(xp, policy, sel.k, table_of(fields), 0, scan)[0]

    picked = select(cupy, acc)
    ref = select(np, cupy.asnumpy(acc))      # the same rule on the host picks the same elements
    same = bool(np.array_equal(np.sort(cupy.asnumpy(picked)), np.sort(ref)))

    def scan() -> Any:
        return scan_partition(cupy, acc, policy)

    scanned, fields = scan()
    table = table_of(fields)
    parts = {"scan": scan, "take": lambda: take_chosen(cupy, policy, sel.k, table, 0, scanned)[0],
             "select": lambda: select(cupy, acc)}
    times = {name: wall(fn, sync, 20, rounds) for name, fn in parts.items()}
    t_scan, t_take, t_select = times["scan"], times["take"], times["select"]
    row: dict[str, Any] = {"numel": numel, "density": density, "k": sel.k,
                           "selected": int(picked.size), "matches_host": same,
                           "settle_density_last": densities[-1] if densities else None,
                           # the settling steps: how often the boundary fell below the bins the
                           # scan kept (a second scan), and where it fell (bins from the prediction)
                           "settle_rescans": rescans, "settle_boundary_offsets": offsets,
                           "window_candidates": int(scanned.hist.sum()),
                           "candidates": int(scanned.pos.size), "scan_s": t_scan, "take_s": t_take,
                           "select_s": t_select,
                           # the GPU's own time of each part (CUDA events, one call at a time), beside
                           # the host's above: where the two differ, the host waits or launches
                           **{f"{name}_gpu_s": device_time(cupy, fn, rounds) for name, fn in parts.items()}}
    if profile_calls:
        row["host_profile"] = host_profile(parts["select"], profile_calls)
        sync()
    # the two kernels alone, queued behind a hold (the same work as the selection's)
    floor, _ = policy.window()
    resolution, points = policy.grid()
    j, take = policy.choose(sel.k, table[:, 1:])
    hist, found = scanned.hist, int(scanned.pos.size)
    n_above, n_at = int(hist[j + 1:points].sum()), int(hist[j])

    def kernels() -> Any:
        pos, mag, _, work = gpu_select.queue_scan(cupy, acc, floor, resolution, points,
                                                  policy.store_from(), 2 * found + 1024)
        return gpu_select.queue_take(cupy, pos[:found], mag[:found], floor, resolution, points, j,
                                     take[0], n_at, n_above, work)

    same_kernels = bool(np.array_equal(np.sort(cupy.asnumpy(kernels())), np.sort(ref)))
    queued = queued_time(cupy, kernels, 100)
    row.update({"kernels_gpu_s": queued["gpu_s"], "kernels_host_ahead": queued["host_ahead"],
                "kernels_match_host": same_kernels})
    try:
        import torch
        t = torch.as_tensor(acc, device="cuda")
        k = int(sel.k)
        topk = lambda: torch.topk(t.abs(), k, sorted=False)  # noqa: E731 - a contender
        row["topk_s"] = wall(topk, torch.cuda.synchronize, 5, rounds)
        if torch.cuda.current_stream().cuda_stream == cupy.cuda.get_current_stream().ptr:
            row["topk_gpu_s"] = queued_time(cupy, topk, 20)["gpu_s"]    # (one stream: the hold first)
    except ImportError as exc:
        row["topk_s"] = None
        row["topk_why"] = str(exc)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    import cupy
    from mpi4py import MPI

    import commlib

    comm = commlib.init(comm=MPI.COMM_SELF, backend="nccl")
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    doc: dict[str, Any] = {
        "benchmark": "gpu", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": bc.command_line("gpu"),
        "environment": {**bc.environment(MPI.COMM_SELF), "gpu": props["name"].decode(),
                        "cupy": cupy.__version__, "nccl": cupy.cuda.nccl.get_version()},
    }
    doc["copy"] = copy_ceiling(cupy, args.copy_mib, args.rounds)
    doc["collectives"] = ([] if args.no_collectives
                          else collectives(comm, cupy, args.sizes, args.target_ms / 1e3, args.rounds))
    sel = selection(comm, cupy, args.numel, args.density, args.settle, args.rounds, args.host_profile)
    one_read = 4 * args.numel / doc["copy"]["bytes_per_s"]
    sel["one_read_s"] = one_read
    sel["select_over_read"] = sel["select_s"] / one_read
    sel["read_GBps"] = 4 * args.numel / sel["select_s"] / 1e9
    sel["topk_over_select"] = sel["topk_s"] / sel["select_s"] if sel.get("topk_s") else None
    sel["meets_read"] = sel["select_over_read"] <= READ_TARGET
    sel["meets_topk"] = bool(sel["topk_over_select"] and sel["topk_over_select"] >= TOPK_TARGET)
    # the same targets on the GPU's time (the kernels queued behind a hold, topk likewise)
    sel["kernels_over_read"] = sel["kernels_gpu_s"] / one_read
    sel["topk_gpu_over_kernels"] = (sel["topk_gpu_s"] / sel["kernels_gpu_s"]
                                    if sel.get("topk_gpu_s") else None)
    sel["kernels_meet_read"] = sel["kernels_over_read"] <= READ_TARGET
    sel["kernels_meet_topk"] = bool(sel["topk_gpu_over_kernels"]
                                    and sel["topk_gpu_over_kernels"] >= TOPK_TARGET)
    doc["selection"] = sel
    comm.close()
    return doc


def report(doc: dict[str, Any]) -> str:
    env, cp, sel = doc["environment"], doc["copy"], doc["selection"]
    out = [f"# GPU: {env['gpu']} (cupy {env['cupy']}, NCCL {env['nccl']})", "",
           f"copy ceiling: {cp['bytes_per_s'] / 1e12:.2f} TB/s (read + written, "
           f"{bc.size_label(cp['bytes'] // 2)} copied in {cp['seconds'] * 1e6:.0f} us)", "",
           "## NCCL, one rank: commlib blocking call vs raw cupy NCCL call", ""]
    rows = [[r["op"], bc.size_label(r["bytes"]), r["raw_us"], r["commlib_us"], r["ratio"], r["raw_spread"],
             r["algbw_GBps"]] for r in doc["collectives"]]
    out.append(bc.markdown_table(["op", "size", "raw us", "commlib us", "commlib/raw", "raw spread",
                                  "commlib GB/s"], rows))
    out += ["", f"## ExDyna selection, {sel['numel']:,} float32, density {sel['density']} (k = {sel['k']:,})",
            ""]
    rows = [["one read at the copy ceiling", sel["one_read_s"] * 1e6, "", 1.0, ""],
            ["ExDyna scan (one pass + histogram)", sel["scan_s"] * 1e6, sel["scan_gpu_s"] * 1e6,
             sel["scan_s"] / sel["one_read_s"], 4 * sel["numel"] / sel["scan_s"] / 1e9],
            ["ExDyna choose + take (after the scan)", sel["take_s"] * 1e6, sel["take_gpu_s"] * 1e6,
             sel["take_s"] / sel["one_read_s"], ""],
            ["ExDyna selection (scan, choose, take)", sel["select_s"] * 1e6, sel["select_gpu_s"] * 1e6,
             sel["select_over_read"], sel["read_GBps"]]]
    rows.append(["ExDyna's two kernels alone, queued (GPU time)", sel["kernels_gpu_s"] * 1e6,
                 sel["kernels_gpu_s"] * 1e6, sel["kernels_over_read"],
                 4 * sel["numel"] / sel["kernels_gpu_s"] / 1e9])
    if sel.get("topk_s"):
        topk_gpu = 1e6 * sel["topk_gpu_s"] if sel.get("topk_gpu_s") else None
        rows.append(["torch.topk(|g|, k)", sel["topk_s"] * 1e6, bc.fmt(topk_gpu),
                     sel["topk_s"] / sel["one_read_s"], 4 * sel["numel"] / sel["topk_s"] / 1e9])
    out.append(bc.markdown_table(["what", "us", "GPU us (events)", "x one read", "GB/s of gradient read"],
                                 rows))
    out += ["", f"candidates in the scan's window: {sel['window_candidates']:,}, kept by the scan: "
            f"{sel['candidates']:,}; second scans in the {len(sel['settle_boundary_offsets'])} settling "
            f"steps: {sel['settle_rescans']}; "
            f"selected {sel['selected']:,} (the host rule picks the same: {sel['matches_host']}); "
            f"selection / one read = {sel['select_over_read']:.2f} (target <= {READ_TARGET:g}: "
            f"{'met' if sel['meets_read'] else 'NOT met'}); topk / selection = "
            f"{bc.fmt(sel['topk_over_select'])} (target >= {TOPK_TARGET:g}: "
            f"{'met' if sel['meets_topk'] else 'NOT met'}).  On the GPU's time (kernels queued, the "
            f"host ahead: {sel['kernels_host_ahead']}; they pick the host's: {sel['kernels_match_host']}): "
            f"kernels / one read = {sel['kernels_over_read']:.2f} "
            f"({'met' if sel['kernels_meet_read'] else 'NOT met'}); topk / kernels = "
            f"{bc.fmt(sel['topk_gpu_over_kernels'])} ({'met' if sel['kernels_meet_topk'] else 'NOT met'})"]
    if sel.get("host_profile"):
        out += ["", "## Where the host's time goes in one selection (cProfile, us per selection)", ""]
        out.append(bc.markdown_table(["function", "calls", "own us", "cumulative us"],
                                     [[r["function"], r["calls"], r["own_us"], r["cumulative_us"]]
                                      for r in sel["host_profile"]]))
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bc.base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes per collective")
    p.add_argument("--numel", type=int, default=25_000_000, help="gradient elements for the selection")
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--settle", type=int, default=40, help="reductions before the selection is timed")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--target-ms", type=float, default=20.0)
    p.add_argument("--host-profile", type=int, default=200, metavar="CALLS",
                   help="profile the host's part of this many selections (cProfile; 0: none)")
    p.add_argument("--no-collectives", action="store_true",
                   help="skip the NCCL part (a profile of the selection: .ci/gpu profile)")
    # --quick sets the defaults only: an option given on the command line wins
    return bc.parse_quick(p, argv, sizes=[8, 1 << 20], numel=1 << 20, settle=5, copy_mib=64, rounds=3,
                          host_profile=20)


def main(argv: list[str] | None = None) -> int:
    """The CLI; 0 also where cupy is missing (skipped, said on stderr, as benchmarks.instructions does)."""
    args = parse_args(argv)
    try:
        import cupy  # noqa: F401 - only whether it imports
    except ImportError as exc:
        print(f"gpu: needs cupy and a CUDA GPU (pip install cupy-cuda12x); skipped, no figures ({exc})",
              file=sys.stderr)
        return 0
    bc.publish(args, run(args), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
