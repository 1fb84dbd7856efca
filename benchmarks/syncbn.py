"""What SyncBatchNorm costs: per layer against BatchNorm plus raw mpi4py, and per training step.

Two parts, side by side in one run (``mpiexec -n N``, one torch thread per rank):

* ``layer``: one forward and backward of a ``BatchNorm2d`` at the shapes of a
  ResNet's four stages (batch ``--batch`` per rank): ``bn`` (torch's, each rank
  its own statistics), ``syncbn`` (commlib's), and ``bound``: ``bn`` plus the
  two raw mpi4py collectives SyncBatchNorm needs (``Allgather`` of ``2C + 2``
  float64, ``Allreduce`` of ``2C`` float32), timed apart and added.
  ``syncbn / bound`` is what commlib adds beyond torch's kernel and MPI's calls.
* ``step``: a training step of the benchmarks' ResNet (``--width``, ``--image``)
  through ``DistributedOptimizer(AllReduce)``: ``bn`` (its BatchNorm layers as
  they are), ``rendezvous`` (``bn`` plus SyncBatchNorm's two raw mpi4py
  collectives at the same points: the cost of synchronizing the ranks 2 times
  per layer, without the arithmetic) and ``syncbn`` (converted by
  ``SyncBatchNorm.convert_sync_batchnorm``).

torch's own ``nn.SyncBatchNorm`` is no contender here: it refuses CPU tensors.

Example:
    timeout 600 mpiexec -n 2 python -m benchmarks.syncbn --json out.json
    timeout 120 mpiexec -n 2 python -m benchmarks.syncbn --quick
"""

from __future__ import annotations

import argparse
import datetime
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import commlib
from benchmarks import _common as bc
from benchmarks.models import build
from commlib.bindings.torch import DistributedOptimizer, SyncBatchNorm
from commlib.collectives import AllReduce


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bc.base_parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=bc.positive_int, default=16,
                   help="samples per rank (16)")
    p.add_argument("--width", type=bc.positive_int, default=16,
                   help="ResNet width: stages of 1, 2, 4, 8 times it (16)")
    p.add_argument("--image", type=bc.positive_int, default=32,
                   help="image side (32)")
    p.add_argument("--rounds", type=bc.positive_int, default=5,
                   help="alternating rounds per contender (5)")
    p.add_argument("--steps", type=bc.positive_int, default=10,
                   help="training steps per round (10)")
    return bc.parse_quick(p, argv, rounds=2, steps=3)   # given options win over --quick


def layer_part(comm: commlib.Communicator, mc: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    # the four stages of the ResNet: 4 * width channels at full size, doubling as the side halves
    return [one_layer(comm, mc, args, args.width * 4 << stage, max(1, args.image >> stage))
            for stage in range(4)]


def one_layer(comm: commlib.Communicator, mc: Any, args: argparse.Namespace, c: int,
              side: int) -> dict[str, Any]:
    x = torch.randn(args.batch, c, side, side, requires_grad=True)
    bn, sync = torch.nn.BatchNorm2d(c), SyncBatchNorm(c, comm=comm)
    stats, table = np.zeros(2 * c + 2), np.zeros((comm.size, 2 * c + 2))
    sums = np.zeros(2 * c, np.float32)

    def raw() -> None:
        mc.Allgather(stats, table)
        mc.Allreduce(MPI.IN_PLACE, sums)

    contenders = {"bn": lambda: bn(x).sum().backward(), "syncbn": lambda: sync(x).sum().backward(),
                  "mpi": raw}
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            iters = bc.calibrate(mc, fn, warmup=3, target_s=0.05 if args.quick else 0.2, lo=5, hi=5000)
            times[name].append(bc.timed(mc, fn, iters))
    med = {k: bc.median(v) for k, v in times.items()}
    return {"shape": [args.batch, c, side, side], "bn_us": med["bn"] * 1e6,
            "syncbn_us": med["syncbn"] * 1e6, "mpi_us": med["mpi"] * 1e6,
            "bound_us": (med["bn"] + med["mpi"]) * 1e6,
            "syncbn_over_bound": med["syncbn"] / (med["bn"] + med["mpi"]),
            "syncbn_over_bn": med["syncbn"] / med["bn"], "rounds": times}


def step_part(comm: commlib.Communicator, mc: Any, args: argparse.Namespace) -> dict[str, Any]:
    models = {}
    for name in ("bn", "rendezvous", "syncbn"):
        torch.manual_seed(0)
        model, make_batch, _ = build("resnet", width=args.width, image=args.image)
        if name == "syncbn":
            model = SyncBatchNorm.convert_sync_batchnorm(model, comm)
        if name == "rendezvous":
            add_rendezvous(model, mc)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model,
                                   strategy=AllReduce(), comm=comm)
        x, y = make_batch(args.batch, comm.rank)
        models[name] = (model, opt, x, y)

    def step(name: str) -> None:
        model, opt, x, y = models[name]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    times: dict[str, list[float]] = {k: [] for k in models}
    for name in models:
        for _ in range(2):
            step(name)
    for _ in range(args.rounds):
        for name in models:
            times[name].append(bc.timed(mc, lambda n=name: step(n), args.steps))
    med = {k: bc.median(v) for k, v in times.items()}
    layers = sum(isinstance(m, SyncBatchNorm) for m in models["syncbn"][0].modules())
    return {"bn_s": med["bn"], "rendezvous_s": med["rendezvous"], "syncbn_s": med["syncbn"],
            "syncbn_over_bn": med["syncbn"] / med["bn"],
            "syncbn_over_rendezvous": med["syncbn"] / med["rendezvous"],
            "layers": layers, "added_per_layer_us": (med["syncbn"] - med["bn"]) / layers * 1e6,
            "rounds": times}


def add_rendezvous(model: torch.nn.Module, mc: Any) -> None:
    """BatchNorm layers as they are, plus SyncBatchNorm's two raw mpi4py collectives per layer at the
    same points (forward: all-gather of 2C + 2 float64; backward: all-reduce of 2C float32) on
    ``mc``: the synchronization any SyncBatchNorm costs, without its arithmetic."""
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            c = m.num_features
            row, table = np.zeros(2 * c + 2), np.zeros((mc.size, 2 * c + 2))
            sums = np.zeros(2 * c, np.float32)
            m.register_forward_pre_hook(lambda *_, r=row, t=table: mc.Allgather(r, t))
            m.register_full_backward_pre_hook(lambda *_, s=sums: mc.Allreduce(MPI.IN_PLACE, s))


def report(doc: dict[str, Any]) -> str:
    rows = [["x".join(map(str, r["shape"])), r["bn_us"], r["mpi_us"], r["syncbn_us"], r["syncbn_over_bound"],
             r["syncbn_over_bn"]] for r in doc["layer"]]
    s, a = doc["step"], doc["args"]
    return "\n".join([
        f"SyncBatchNorm, {doc['ranks']} ranks ({doc['date']}): one layer's forward + backward (median us)",
        bc.markdown_table(["input per rank", "bn", "raw mpi4py pair", "syncbn", "syncbn / (bn + mpi)",
                           "syncbn / bn"], rows),
        "",
        f"ResNet width {a['width']}, {a['image']}px, batch {a['batch']} per rank, "
        f"AllReduce: step {s['bn_s'] * 1e3:.1f} ms with BatchNorm, {s['rendezvous_s'] * 1e3:.1f} ms with "
        f"BatchNorm plus SyncBatchNorm's raw mpi4py collectives at the same points, "
        f"{s['syncbn_s'] * 1e3:.1f} ms with SyncBatchNorm: {s['syncbn_over_bn']:.3f}x BatchNorm "
        f"({s['added_per_layer_us']:.0f} us per layer, {s['layers']} layers), "
        f"{s['syncbn_over_rendezvous']:.3f}x BatchNorm + raw collectives",
    ])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    comm = commlib.init()
    mc = comm.mpi_comm
    doc = {"benchmark": "syncbn", "ranks": comm.size, "args": vars(args),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "environment": bc.environment(mc)}
    doc["layer"] = layer_part(comm, mc, args)
    doc["step"] = step_part(comm, mc, args)
    return bc.publish(args, doc, report)


if __name__ == "__main__":
    main()
