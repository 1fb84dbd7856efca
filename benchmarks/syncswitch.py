"""Sync-Switch side by side: BSP, ASP, SSP, offline and online Sync-Switch on one CNN, in one run.

A CNN of about 1.07M parameters (conv 1->32->64, fc 4096->256->10) on scikit-learn's
bundled 8x8 digits (1437 train / 360 test), torch SGD with momentum on flat parameter and
gradient buffers driven through :class:`collectives.syncswitch.SyncSwitch`'s lifecycle
(``bucket_ready``, ``before_update``, the optimizer, ``after_update``).  Every contender
trains the same number of samples (``--steps`` BSP-equivalent steps of ``--batch`` per rank;
asynchronous steps count 1/n each) from the same initial model.

Contenders: ``bsp`` (AllReduce), ``asp``, ``ssp`` (``--staleness``), ``offline``
(``OfflinePolicy(--bsp-fraction)``, lr x ``--asp-lr-scale`` and momentum ``--momentum`` at the
switch) and ``online`` (``StragglerPolicy(--theta, --window, --m-windows)``).

``--straggler RANK:FACTOR:FROM:TO``: rank RANK is FACTOR times slower while the run's progress
is in [FROM, TO) (fractions): with ``--straggler-mode step`` (default) each of its steps sleeps
``(FACTOR-1) x`` its median unslowed step time (the whole step, communication included: a slow
machine), with ``compute`` ``(FACTOR-1) x`` its forward+backward time of that step (a slow
processor; on communication-bound steps that changes little).

Reported per contender (slowest rank's wall time): seconds, samples/s, ratio to BSP, time to
``--target-acc`` (rank 0's replica, evaluated every ``--eval-every`` of its steps), final test
accuracy (after the job returns to BSP: replicas identical), bytes per rank, seconds blocked in
communication (all-reduce waits, store traffic, SSP waits) and switches.  ``--store-only``
measures the parameter store alone: sharded vs server layout, push+pull of the model's size.

Example:
    mpiexec -n 4 python -m benchmarks.syncswitch --quick
    python -m benchmarks.cluster --ranks 4 --rate 1gbit -- python -m benchmarks.syncswitch \\
        --straggler 3:4:0.25:0.75 --json benchmarks/results/syncswitch-straggler.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks._common import (
    base_parser,
    environment,
    markdown_table,
    non_negative_int,
    parse_quick,
    positive_float,
    positive_int,
    write_json,
)

CONTENDERS = ("bsp", "asp", "ssp", "offline", "online")


def _parser():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    p.add_argument("--steps", type=positive_int, default=300, help="BSP-equivalent steps per contender")
    p.add_argument("--batch", type=positive_int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum-coef", type=float, default=0.9)
    p.add_argument("--staleness", type=non_negative_int, default=2)
    p.add_argument("--bsp-fraction", type=float, default=0.25)
    p.add_argument("--asp-lr-scale", type=positive_float, default=0.5)
    p.add_argument("--momentum", default="reset", choices=("keep", "reset", "ramp"))
    p.add_argument("--theta", type=float, default=1.5)
    p.add_argument("--window", type=positive_int, default=5)
    p.add_argument("--m-windows", type=positive_int, default=2)
    p.add_argument("--straggler", metavar="RANK:FACTOR:FROM:TO", type=_straggler)
    p.add_argument("--straggler-mode", choices=("step", "compute"), default="step")
    p.add_argument("--target-acc", type=float, default=0.95)
    p.add_argument("--eval-every", type=positive_int, default=10)
    p.add_argument("--store-only", action="store_true", help="time the parameter store layouts only")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str] | None = None) -> Any:
    """Options; ``--quick`` sets the defaults only (an option given on the command line wins)."""
    return parse_quick(_parser(), argv, steps=40, eval_every=5)


def _straggler(spec: str) -> tuple[int, float, float, float]:
    """``RANK:FACTOR:FROM:TO`` (an argparse ``type``: a bad one is a usage error)."""
    parts = spec.split(":")
    try:
        r, f, a, b = int(parts[0]), float(parts[1]), float(parts[2]), float(parts[3])
        if len(parts) != 4:
            raise ValueError
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected RANK:FACTOR:FROM:TO (integer RANK, "
                                         "numbers FACTOR, FROM, TO)") from None
    if r < 0 or f < 1 or not 0 <= a <= b <= 1:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected RANK >= 0, FACTOR >= 1 and "
                                         "0 <= FROM <= TO <= 1")
    return r, f, a, b


def _data(seed: int):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    y = d.target.astype(np.int64)
    idx = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    return x[idx[:cut]], y[idx[:cut]], x[idx[cut:]], y[idx[cut:]]


def _model(torch):
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))


def _policy(name: str, args: Any):
    from commlib.collectives.policies import OfflinePolicy, SchedulePolicy, StragglerPolicy

    if name in ("bsp", "asp", "ssp"):
        return SchedulePolicy(name, lr_scale=args.asp_lr_scale if name != "bsp" else 1.0)
    if name == "offline":
        return OfflinePolicy(args.bsp_fraction, args.steps, lr_scale=args.asp_lr_scale,
                             momentum=args.momentum)
    return StragglerPolicy(theta=args.theta, window_k=args.window, m_windows=args.m_windows)


def run_one(comm: Any, name: str, args: Any, data: tuple, init: np.ndarray) -> dict[str, Any]:
    """Train one contender; collective; returns rank 0's figures (slowest rank's time)."""
    import torch

    from commlib.collectives.buckets import TensorSpec, plan_buckets
    from commlib.collectives.syncswitch import SyncSwitch

    xtr, ytr, xte, yte = data
    torch.manual_seed(args.seed)
    model = _model(torch)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    buckets = plan_buckets([TensorSpec(0, numel, "float32", 4)], comm.size, cap_bytes=1 << 40,
                           first_cap_bytes=None)
    flat_p = torch.zeros(buckets[0].padded)
    flat_g = torch.zeros(buckets[0].padded)
    flat_p[:numel] = torch.from_numpy(init)
    off = 0
    for p in params:
        n = p.numel()
        p.data = flat_p[off:off + n].view_as(p)
        p.grad = flat_g[off:off + n].view_as(p)
        off += n
    opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum_coef)
    ss = SyncSwitch(policy=_policy(name, args), staleness=args.staleness)

    def on_switch(old: str, new: str, changes: dict) -> None:
        for p in params:
            buf = opt.state.get(p, {}).get("momentum_buffer")
            if buf is None:
                continue
            if old == "bsp" and changes.get("momentum") == "reset":
                buf.zero_()
            elif new == "bsp":                # replicas' optimizers must agree again
                comm.allreduce(buf.numpy(), "avg", out=buf.numpy(), tag="momentum")

    ss.on_switch(on_switch)
    ss.setup(comm, buckets, [flat_p.numpy()], [flat_g.numpy()])
    strag = args.straggler
    if strag is not None and strag[0] >= comm.size:
        raise SystemExit(f"--straggler: rank {strag[0]} is not a rank of 0..{comm.size - 1}")
    rng = np.random.default_rng([args.seed, comm.rank])
    mine = np.arange(comm.rank, len(ytr), comm.size)
    xte_t, yte_t = torch.from_numpy(xte), torch.from_numpy(yte)

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(xte_t).argmax(1) == yte_t).float().mean())

    loss_fn = torch.nn.CrossEntropyLoss()
    curve: list[tuple[float, float, float]] = []
    comm.barrier()
    t0 = time.perf_counter()
    local = 0
    slept = 0.0
    normal: list[float] = []               # this rank's unslowed step times
    t_step = time.perf_counter()
    while (progress := ss.progress()) < args.steps:
        for g in opt.param_groups:
            g["lr"] = args.lr * ss.lr_scale
            g["momentum"] = args.momentum_coef * ss.momentum_scale
        b = rng.choice(mine, args.batch)
        tc = time.perf_counter()
        flat_g.zero_()
        loss_fn(model(torch.from_numpy(xtr[b])), torch.from_numpy(ytr[b])).backward()
        compute = time.perf_counter() - tc
        slow = strag and comm.rank == strag[0] and strag[2] <= progress / args.steps < strag[3]
        if slow:
            base = compute
            if args.straggler_mode == "step" and normal:
                base = float(np.median(normal[-50:]))
            time.sleep((strag[1] - 1) * base)
            slept += (strag[1] - 1) * base
        ss.bucket_ready(0)
        ss.before_update()
        opt.step()
        ss.after_update()
        now = time.perf_counter()
        if not slow:
            normal.append(now - t_step)
        t_step = now
        local += 1
        if comm.rank == 0 and local % args.eval_every == 0:     # the progress this step made
            curve.append((time.perf_counter() - t0, ss.progress(), accuracy()))
    ss.close()                                  # back to BSP: identical replicas
    wall = comm.allreduce(np.array([time.perf_counter() - t0]), "max")[0]
    acc = accuracy()
    stats = {k: float(v) for k, v in ss.stats.items()}
    blocked = comm.allreduce(np.array([ss.bsp.stats["wait_s"] + stats["store_s"] + stats["switch_s"]]),
                             "avg")[0]
    nbytes = comm.allreduce(np.array([stats["bytes"] + ss.bsp.stats["bytes"]]), "avg")[0]
    tta = next((t for t, _, a in curve if a >= args.target_acc), None)
    # the samples trained: asynchronous ranks test the progress before a step, so together they
    # may make up to size - 1 steps more than --steps BSP steps
    steps_per_rank = [int(v) for v in np.asarray(comm.allgather(np.array([local], np.int64))).reshape(-1)]
    samples = sum(steps_per_rank) * args.batch
    return {"contender": name, "seconds": float(wall), "samples": samples,
            "samples_per_s": samples / wall, "final_acc": acc,
            "time_to_acc": tta, "bytes_per_rank": float(nbytes), "blocked_s": float(blocked),
            "local_steps": local, "steps_per_rank": steps_per_rank, "straggler_sleep_s": slept,
            "switches": ss.switches,
            "decisions": ss.policy.log, "curve": curve, "stats": stats, "params": numel}


def store_only(comm: Any, numel: int, iters: int) -> list[dict[str, Any]]:
    """Push+pull of ``numel`` float32 through each layout; the slowest rank's mean seconds."""
    from commlib.collectives.paramstore import ParamStore

    rows = []
    for layout in ("sharded", "server"):
        store = ParamStore(comm, numel, "float32", init=np.zeros(numel, np.float32), layout=layout)
        store.activate()
        delta, out = np.full(numel, 1e-3, np.float32), np.empty(numel, np.float32)
        store.push_pull(delta, out)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            store.push_pull(delta, out)
        dt = comm.allreduce(np.array([(time.perf_counter() - t0) / iters]), "max")[0]
        store.close()
        rows.append({"layout": layout, "numel": numel, "push_pull_s": float(dt),
                     "progress": store.progress})
    return rows


def main(argv: list[str] | None = None) -> None:
    import torch

    import commlib

    args = parse_args(argv)
    torch.set_num_threads(1)
    comm = commlib.init(timeout=600)
    model = _model(torch)
    numel = sum(p.numel() for p in model.parameters())
    doc: dict[str, Any] = {"benchmark": "syncswitch", "args": vars(args),
                           "env": environment(comm.mpi_comm)}
    if args.store_only:
        rows = store_only(comm, numel, 5 if args.quick else 20)
        doc["store"] = rows
        if comm.rank == 0:
            print(markdown_table(["layout", "elements", "push+pull ms"],
                                 [[r["layout"], r["numel"], r["push_pull_s"] * 1e3] for r in rows]))
        write_json(args.json if comm.rank == 0 else None, doc)
        return
    data = _data(args.seed)
    torch.manual_seed(args.seed)
    init = torch.nn.utils.parameters_to_vector(_model(torch).parameters()).detach().numpy().copy()
    results = [run_one(comm, name, args, data, init) for name in args.contenders]
    doc["results"] = results
    if comm.rank == 0:
        base = next((r for r in results if r["contender"] == "bsp"), None)
        rows = [[r["contender"], r["seconds"], r["samples_per_s"],
                 base["seconds"] / r["seconds"] if base else None, r["time_to_acc"], r["final_acc"],
                 r["bytes_per_rank"] / 2**20, r["blocked_s"], len(r["switches"])] for r in results]
        strag = (", straggler rank {} x{} in progress [{}, {})".format(*args.straggler)
                 if args.straggler else "")
        print(f"{numel} parameters, {comm.size} ranks, {args.steps} steps x {args.batch} per rank{strag}")
        print(markdown_table(["contender", "s", "samples/s", "speedup vs BSP", f"s to {args.target_acc}",
                              "final acc", "MiB/rank", "blocked s", "switches"], rows))
    write_json(args.json if comm.rank == 0 else None, doc)


if __name__ == "__main__":
    main()
