"""Data-parallel training steps against their overlap bounds: DDP/gloo, commlib AllReduce (WFBP), DeAR.

Every contender trains its own copy of the same model (same initial
parameters, same synthetic batches) in one run; rounds rotate which goes
first.  ``local`` trains without communication.  On the emulated cluster,
``--rates`` sweeps the link rate: before each rate every rank asks the
launcher to reshape its link (``benchmarks.cluster.request_link``), so one
cluster and one self-check serve the whole sweep.  At every rate the pieces
of a step are measured alone, on that link (:mod:`benchmarks.train_pieces`;
``t_fwd``, ``t_bwd``, ``t_update`` from the ``local`` contender's own rounds,
which interleave with the others' and so see the same machine),
and every contender's step is reported against its own overlap bound:
WFBP ``t_fwd + max(t_bwd, t_allreduce) + t_update``, DeAR ``max(t_fwd,
t_allgather) + max(t_bwd, t_reduce_scatter) + t_update_shard``.  Each step is
also split into forward, backward and optimizer step, each with the time the
strategy was blocked waiting for communication (``wait``), so that a step
over its bound shows whether compute ran slower than alone (the cores are
shared with the communication) or communication did (waits over what the bound
leaves exposed).

``syncswitch-dear`` (named only): ``SyncSwitch(bsp=DeAR())`` in BSP throughout, against DeAR's bound
(the composition's BSP steps should cost DeAR's).  ``allreduce-join`` and ``dear-join`` (named only):
their batches through ``opt.join`` (uneven inputs; every rank has one here), against their strategy's
bound: the per-batch census is all they add.

Step time: per round one untimed step (DeAR's all-gathers are then in flight
as in steady state), then ``--steps`` timed steps, the slowest rank's mean;
the median over ``--rounds`` rounds.

Example (2 ranks, one core each, four link rates; about 2.5 minutes)::

    python -m benchmarks.cluster --ranks 2 --rate 1gbit --prefix tr- -- \\
        python -m benchmarks.train --rates 100mbit 250mbit 500mbit 1gbit --json out.json --plot out.png

Example (a quick local smoke run, no link shaping):
    $ mpiexec -n 2 python -m benchmarks.train --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import commlib
from benchmarks import _common as bc
from benchmarks import train_pieces as tp
from benchmarks.models import build, count, loss_of
from commlib.bindings.torch import DistributedOptimizer
from commlib.collectives import AllReduce, DeAR, SyncSwitch

CONTENDERS = ("local", "ddp", "allreduce", "dear", "syncswitch-dear", "allreduce-join", "dear-join", "exdyna",
              "topk")
#: sparse contenders (issue 5), left out unless asked for: they change what is trained
SPARSE = ("exdyna", "topk")
#: left out unless asked for too: SyncSwitch(bsp=DeAR()) in BSP throughout, whose steps should cost DeAR's
NAMED_ONLY = SPARSE + ("syncswitch-dear", "allreduce-join", "dear-join")
#: the targets of issue 12 (2 ranks): DeAR's speedups at the rate where they differ most, step/bound
TARGETS = {"dear/allreduce": 1.10, "dear/ddp": 1.10, "step/bound": 1.15}
PHASES = ("fwd", "bwd", "opt")


def model_kwargs(args: argparse.Namespace, name: str) -> dict[str, Any]:
    if name == "resnet":
        return {"width": args.width, "image": args.image}
    if name == "mlp" and args.quick:
        return {"wide": 1024}
    return {}


class Trainer:
    """One contender: a model copy, its optimizer, and ``step()`` timed by phase."""

    def __init__(self, name: str, model_name: str, args: argparse.Namespace, world: Any,
                 comm: commlib.Communicator):
        torch.manual_seed(0)
        self.name, self.model_name, self.batch = name, model_name, args.batch
        self.model, self.make_batch, self.unit = build(model_name, **model_kwargs(args, model_name))
        self.opt_inner = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.dopt: DistributedOptimizer | None = None
        self.net = self.model
        self.opt: Any = self.opt_inner
        if name == "ddp":
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=args.cap_mb)
        elif name in ("allreduce", "dear", "allreduce-join", "dear-join"):
            cls = AllReduce if name.startswith("allreduce") else DeAR
            self.dopt = self.opt = DistributedOptimizer(self.opt_inner, self.model,
                                                        cls(cap_mb=args.cap_mb), comm)
        elif name == "syncswitch-dear":
            self.dopt = self.opt = DistributedOptimizer(self.opt_inner, self.model,
                                                        SyncSwitch(bsp=DeAR(cap_mb=args.cap_mb)), comm)
        elif name in SPARSE:
            from commlib.sparsify import ExDyna, SparseAllReduce, TopK
            selector = ExDyna(density=args.density) if name == "exdyna" else TopK(density=args.density)
            self.dopt = self.opt = DistributedOptimizer(self.opt_inner, self.model,
                                                        SparseAllReduce(selector=selector), comm)
        self.seed = 1000 * world.rank
        joins = self.dopt is not None and name.endswith("-join")
        self.batches = iter(self.dopt.join(self.endless())) if joins else self.endless()
        x, _ = self.make_batch(1, 0)
        self.units_per_sample = x.shape[1] if self.unit == "tokens" else 1
        self.phase_s = np.zeros(2 * len(PHASES))     # wall fwd, bwd, opt; wait fwd, bwd, opt
        #: with COMMLIB_TIMELINE the phases join commlib's timeline (track 9), beside the collectives
        self.tracer = comm.tracer if comm.tracer.recording else None

    def wait_s(self) -> float:
        if self.dopt is None:
            return 0.0
        s = self.dopt.strategy
        return (s.bsp if isinstance(s, SyncSwitch) else s).stats["wait_s"]     # BSP's waits are its inner's

    def endless(self) -> Any:
        while True:
            self.seed += 1
            yield self.make_batch(self.batch, self.seed)

    def step(self) -> None:
        x, y = next(self.batches)       # untimed by phase, as the batch was before: in the step's time
        clock = time.perf_counter
        t0, w0 = clock(), self.wait_s()
        loss = loss_of(self.model_name, self.net(x), y)
        t1, w1 = clock(), self.wait_s()
        self.opt.zero_grad()
        loss.backward()
        t2, w2 = clock(), self.wait_s()
        self.opt.step()
        t3, w3 = clock(), self.wait_s()
        self.phase_s += (t1 - t0, t2 - t1, t3 - t2, w1 - w0, w2 - w1, w3 - w2)
        if self.tracer is not None:
            end = self.tracer.now_us()
            for ph, a, b in zip(PHASES, (t0, t1, t2), (t1, t2, t3)):
                self.tracer.add(ph, self.name, "model", end - (t3 - a) * 1e6, end - (t3 - b) * 1e6)

    def finish(self) -> None:
        if self.dopt is not None:
            self.dopt.flush()


def thread_cpu_s() -> tuple[float, float]:
    """CPU seconds used so far by this process's main thread and by all its other threads
    (commlib's engine, gloo's, torch's), from ``/proc/self/task``; zeros where unreadable."""
    import os

    main, other, tick = 0.0, 0.0, os.sysconf("SC_CLK_TCK")
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick        # utime + stime
            if int(tid) == os.getpid():
                main += cpu
            else:
                other += cpu
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    return main, other


def time_round(world: Any, t: Trainer, steps: int) -> tuple[float, np.ndarray]:
    """One untimed step, ``steps`` timed ones: the slowest rank's mean step, mean phases (wall
    and wait) and CPU seconds per step of the main thread and of the other threads."""
    world.Barrier()
    t.step()
    t.phase_s[:] = 0
    c0 = thread_cpu_s()
    t0 = time.perf_counter()
    for _ in range(steps):
        t.step()
    dt = (time.perf_counter() - t0) / steps
    c1 = thread_cpu_s()
    phases = np.concatenate([t.phase_s / steps, [(c1[0] - c0[0]) / steps, (c1[1] - c0[1]) / steps]])
    t.finish()
    worst = np.empty_like(phases)
    world.Allreduce(phases, worst, op=MPI.MAX)
    return world.allreduce(dt, op=MPI.MAX), worst


def measure_point(args: argparse.Namespace, world: Any, comm: Any, dist: Any,
                  trainers: dict[str, Trainer], plan: list[dict], rate: float | None) -> dict[str, Any]:
    """Pieces, bounds and every contender's steps at one link rate."""
    local = trainers.get("local") or next(iter(trainers.values()))
    m, mb, _ = build(local.model_name, **model_kwargs(args, local.model_name))
    m.load_state_dict(local.model.state_dict())
    pieces = tp.compute_pieces(world, m, mb, lambda o, y: loss_of(local.model_name, o, y),
                               args.batch, args.lr, args.piece_reps)
    pieces.update(tp.comm_pieces(world, comm, dist if "ddp" in trainers else None, plan,
                                 args.piece_reps))
    times: dict[str, list[float]] = {c: [] for c in trainers}
    phases: dict[str, list[np.ndarray]] = {c: [] for c in trainers}
    names = list(trainers)
    for r in range(args.rounds):
        k = r % len(names)
        for c in names[k:] + names[:k]:
            dt, ph = time_round(world, trainers[c], args.steps)
            times[c].append(dt)
            phases[c].append(ph)
    samples = args.batch * world.size * local.units_per_sample
    med = {c: bc.median(v) for c, v in times.items()}
    if "local" in phases:     # compute without communication, interleaved with the contenders' rounds
        ph = np.median(np.stack(phases["local"]), axis=0)
        for i, k in enumerate(("t_fwd", "t_bwd", "t_update")):
            pieces[f"{k}_alone"] = pieces[k]
            pieces[k] = float(ph[i])
    bound = tp.bounds(pieces)
    rows = {}
    for c in names:
        ph = np.median(np.stack(phases[c]), axis=0)
        row = {"step_s": med[c], "step_s_all": times[c], "throughput": samples / med[c],
               "unit": f"{local.unit}/s", **{f"{p}_s": float(ph[i]) for i, p in enumerate(PHASES)},
               **{f"wait_{p}_s": float(ph[3 + i]) for i, p in enumerate(PHASES)},
               "cpu_main_s": float(ph[6]), "cpu_other_s": float(ph[7])}
        if c in bound:
            row["bound_s"] = bound[c]
            row["vs_bound"] = med[c] / bound[c]
        for base in ("ddp", "allreduce"):
            if base in med:
                row[f"vs_{base}"] = med[base] / med[c]
        rows[c] = row
    nbytes = sum(b["bytes"] for b in plan)
    line = {op: tp.ring_s(nbytes, world.size, rate, op) for op in ("allreduce", "reduce_scatter",
                                                                    "allgather")} if rate else {}
    return {"model": local.model_name, "rate_bps": rate, "pieces": pieces, "bounds": bound,
            "line_rate_s": line, "contenders": rows, "runnable": bc.runnable_tasks()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    comm = commlib.init(timeout=args.timeout)
    dist, gloo_why = bc.init_gloo(world, "ddp" in args.contenders)
    contenders = [c for c in args.contenders if c != "ddp" or dist is not None]
    env = bc.environment(world)
    shaped = env["cluster_shaped"]
    rates: list[float | None] = list(args.rate_bps) if shaped and args.rate_bps else [None]
    if args.rate_bps and not shaped and world.rank == 0:
        print("benchmarks.train: --rates needs the emulated cluster (python -m benchmarks.cluster ...); "
              "measuring at the launcher's link only", file=sys.stderr, flush=True)
    points, plans, models = [], {}, {}
    for model_name in args.models:
        trainers = {c: Trainer(c, model_name, args, world, comm) for c in contenders}
        for t in trainers.values():            # warm-up: allocator, first-step set-up
            for _ in range(args.warmup):
                t.step()
            t.finish()
        first = next(iter(trainers.values()))
        models[model_name] = {"params": count(first.model), "kwargs": model_kwargs(args, model_name)}
        for c, t in trainers.items():
            if t.dopt is not None:
                plans[f"{model_name}/{c}"] = t.dopt.plan
        plan = next((plans[k] for k in (f"{model_name}/allreduce", f"{model_name}/dear")
                     if k in plans), None)
        if plan is None:                        # no commlib contender: DDP-like buckets
            plan = [{"bytes": 4 * count(first.model)}]
        for rate in rates:
            if rate is not None and not tp.set_rate(world, rate):
                rate = None
            points.append(measure_point(args, world, comm, dist, trainers, plan,
                                        rate or env["cluster_rate_bps"]))
        del trainers
    if rates != [None]:
        tp.set_rate(world, None)               # back to the launcher's rate
    if dist is not None:
        dist.destroy_process_group()
    return {"benchmark": "train", "args": vars(args), "env": env,
            "models": models, "points": points, "plans": plans, "targets": TARGETS,
            "skipped": {"ddp": gloo_why} if gloo_why else {}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.cluster import parse_rate

    p = bc.base_parser(__doc__.splitlines()[0], plot=True)
    p.add_argument("--models", nargs="+", default=["resnet"], choices=["resnet", "transformer", "mlp"])
    p.add_argument("--contenders", nargs="+", default=[c for c in CONTENDERS if c not in NAMED_ONLY],
                   choices=CONTENDERS,
                   help="exdyna and topk (sparse, --density) and syncswitch-dear only when named")
    p.add_argument("--rates", nargs="*", default=[],
                   help="link rates to sweep on the emulated cluster (e.g. 100mbit 1gbit); "
                        "default: the launcher's rate only")
    p.add_argument("--width", type=int, default=32, help="resnet: first stage width")
    p.add_argument("--image", type=int, default=32, help="resnet: image side")
    p.add_argument("--density", type=float, default=0.01, help="density of the sparse contenders")
    p.add_argument("--batch", type=bc.positive_int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=bc.positive_int, default=4, help="timed steps per round")
    p.add_argument("--rounds", type=bc.positive_int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--piece-reps", type=bc.positive_int, default=3, help="repetitions of each measured piece")
    p.add_argument("--cap-mb", type=float, default=4.0, help="bucket cap of every contender (DDP too)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--timeout", type=float, default=600.0)
    # --quick sets the defaults only: an option given on the command line wins
    args = bc.parse_quick(p, argv, models=["mlp"], steps=2, rounds=1, warmup=1, batch=4, piece_reps=1)
    try:
        args.rate_bps = sorted(parse_rate(r) for r in args.rates)
    except ValueError as exc:
        p.error(f"--rates: {exc}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.train_report import plot, report

    args = parse_args(argv)
    return bc.publish(args, run(args), report, plot)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
