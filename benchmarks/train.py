"""End-to-end data-parallel training throughput: DDP over gloo vs commlib ``AllReduce`` vs ``DeAR``.

Every contender trains its own copy of the same model (same initial
parameters, same synthetic batches) in one run; rounds rotate which goes
first.  ``local`` trains without any communication: the compute-only time
that tells how much communication each contender leaves exposed
(``1 - t_local / t``).  Run under ``mpiexec`` (CPU ranks), or on the emulated
cluster::

    python -m benchmarks.cluster --ranks 4 --rate 1gbit -- \\
        python -m benchmarks.train --models resnet --json out.json

Example (a quick local smoke run):
    $ mpiexec -n 2 python -m benchmarks.train --quick
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import commlib
from benchmarks import _common as bc
from benchmarks.models import build, count, loss_of
from commlib.bindings.torch import DistributedOptimizer
from commlib.collectives import AllReduce, DeAR

CONTENDERS = ("local", "ddp", "allreduce", "dear", "exdyna", "topk")
#: sparse contenders (issue 5), left out unless asked for: they change what is trained
SPARSE = ("exdyna", "topk")
DEFAULTS = {"resnet": {"width": 64, "image": 16}, "transformer": {}, "mlp": {}}


class Trainer:
    """One contender: a model copy, its optimizer, and ``step()``."""

    def __init__(self, name: str, model_name: str, batch: int, world: Any, comm: commlib.Communicator,
                 dist: Any, cap_mb: float, lr: float, density: float = 0.01):
        torch.manual_seed(0)
        self.name, self.model_name, self.batch = name, model_name, batch
        self.model, self.make_batch, self.unit = build(model_name, **DEFAULTS[model_name])
        self.opt_inner = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.dopt: DistributedOptimizer | None = None
        self.net = self.model
        if name == "ddp":
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=cap_mb)
            self.opt = self.opt_inner
        elif name in ("allreduce", "dear"):
            strategy = AllReduce(cap_mb=cap_mb) if name == "allreduce" else DeAR(cap_mb=cap_mb)
            self.dopt = self.opt = DistributedOptimizer(self.opt_inner, self.model, strategy, comm)
        elif name in SPARSE:
            from commlib.sparsify import ExDyna, SparseAllReduce, TopK
            selector = ExDyna(density=density) if name == "exdyna" else TopK(density=density)
            self.dopt = self.opt = DistributedOptimizer(self.opt_inner, self.model,
                                                        SparseAllReduce(selector=selector), comm)
        else:
            self.opt = self.opt_inner
        self.seed = 1000 * world.rank
        self.units_per_sample = 1
        x, _ = self.make_batch(1, 0)
        if self.unit == "tokens":
            self.units_per_sample = x.shape[1]

    def step(self) -> None:
        self.seed += 1
        x, y = self.make_batch(self.batch, self.seed)
        self.opt.zero_grad()
        loss_of(self.model_name, self.net(x), y).backward()
        self.opt.step()

    def finish(self) -> None:
        if self.dopt is not None:
            self.dopt.flush()

    def wait_s(self) -> float:
        return self.dopt.strategy.stats["wait_s"] if self.dopt is not None else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    comm = commlib.init(timeout=args.timeout)
    dist, gloo_why = bc.init_gloo(world, "ddp" in args.contenders)
    contenders = [c for c in args.contenders if c != "ddp" or dist is not None]
    env = bc.environment(world)
    rows, plans = [], {}
    for model_name in args.models:
        trainers = {c: Trainer(c, model_name, args.batch, world, comm, dist, args.cap_mb, args.lr,
                               args.density) for c in contenders}
        first = next(iter(trainers.values()))
        for t in trainers.values():            # warm-up: allocator, first-step set-up
            for _ in range(args.warmup):
                t.step()
            t.finish()
        times: dict[str, list[float]] = {c: [] for c in trainers}
        waits: dict[str, list[float]] = {c: [] for c in trainers}
        names = list(trainers)
        for r in range(args.rounds):
            k = r % len(names)
            for c in names[k:] + names[:k]:
                t = trainers[c]
                w0 = t.wait_s()
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    t.step()
                t.finish()
                dt = world.allreduce((time.perf_counter() - t0) / args.steps, op=MPI.MAX)
                times[c].append(dt)
                waits[c].append((t.wait_s() - w0) / args.steps)
        samples = args.batch * world.size * first.units_per_sample
        med = {c: bc.median(v) for c, v in times.items()}
        for c in names:
            row = {"model": model_name, "params": count(first.model), "contender": c,
                   "step_s": med[c], "step_s_all": times[c], "throughput": samples / med[c],
                   "unit": f"{first.unit}/s", "wait_s": bc.median(waits[c])}
            if "local" in med:
                row["exposed_comm"] = max(0.0, 1 - med["local"] / med[c])
            for base in ("ddp", "allreduce"):
                if base in med:
                    row[f"vs_{base}"] = med[base] / med[c]
            rows.append(row)
        for c, t in trainers.items():
            if t.dopt is not None:
                plans[f"{model_name}/{c}"] = t.dopt.plan
        del trainers
    if dist is not None:
        dist.destroy_process_group()
    return {"benchmark": "train", "args": vars(args), "env": env, "rows": rows, "plans": plans,
            "skipped": {"ddp": gloo_why} if gloo_why else {}}


def report(doc: dict[str, Any]) -> str:
    env = doc["env"]
    rate = env.get("cluster_rate_bps")
    lines = [f"# Training throughput, {env['ranks']} ranks"
             + (f", emulated links {rate / 1e9:g} Gbit/s" if rate else ", no link shaping"), ""]
    header = ["model", "params", "contender", "step (s)", "throughput", "exposed comm", "wait (s)",
              "vs ddp", "vs allreduce"]
    table = []
    for r in doc["rows"]:
        table.append([r["model"], f"{r['params'] / 1e6:.1f}M", r["contender"], f"{r['step_s']:.3f}",
                      f"{r['throughput']:.1f} {r['unit']}",
                      f"{r['exposed_comm']:.0%}" if "exposed_comm" in r else "-",
                      f"{r['wait_s']:.3f}" if r["wait_s"] == r["wait_s"] else "-",
                      bc.fmt(r.get("vs_ddp")), bc.fmt(r.get("vs_allreduce"))])
    lines.append(bc.markdown_table(header, table))
    lines.append("")
    for key, plan in doc["plans"].items():
        sizes = [bc.size_label(b["bytes"]) for b in plan]
        lines.append(f"- fusion plan {key}: {len(plan)} buckets: {', '.join(sizes)}")
    for c, why in doc["skipped"].items():
        lines.append(f"- {c} skipped: {why}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bc.base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["resnet", "transformer", "mlp"], choices=list(DEFAULTS))
    p.add_argument("--contenders", nargs="+", default=[c for c in CONTENDERS if c not in SPARSE],
                   choices=CONTENDERS, help="exdyna and topk (sparse, --density) only when named")
    p.add_argument("--density", type=float, default=0.01, help="density of the sparse contenders")
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cap-mb", type=float, default=25.0, help="bucket cap of every contender (DDP too)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.rounds, args.warmup, args.batch = ["mlp"], 2, 1, 1, 4
        DEFAULTS["mlp"] = {"wide": 1024}
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    return bc.publish(args, run(args), report)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
