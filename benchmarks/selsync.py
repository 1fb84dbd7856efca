"""Time-to-accuracy of SelSync against BSP and FedAvg-style periodic averaging, side by side in one run.

A CNN of about 2.1M parameters (two 3x3 convolutions and a wide fully
connected layer, ``--width``) learns scikit-learn's bundled digits (8x8
images, 10 classes; 70/30 stratified split).  Every rank holds the model's
parameters in flat bucket buffers (``collectives.plan_buckets``), the model's
tensors being views of them, and drives a strategy through the lifecycle as
a binding would (``before_forward``, ``bucket_ready``, ``before_update``,
the update, ``after_update``); SGD with momentum runs on the flat buffers.

Contenders (same initial model, same steps, same per-rank batch ``--batch``):

* ``bsp``       ``AllReduce``: gradients averaged every step; disjoint shards (DefDP);
* ``selsync``   ``SelSync(AllReduce(), delta, window, mode="params")`` with momentum
                averaged on sync steps; SelDP data;
* ``fedavg``    parameters (and momentum) averaged every k steps, k chosen so that it
                syncs as often as SelSync did; SelDP data;
* ``--noniid`` (on by default, ``--no-noniid`` skips it): SelSync on DefDP data, IID
  (``iid``), non-IID (``noniid``: :func:`collectives.data.label_shards`, 2 label-sorted
  shards per rank) and non-IID with data injection (``inject``: ``--alpha`` of the ranks
  share ``--beta`` of their batch, local batch shrunk to keep the total).

Wall time counts training only (the accuracy evaluations pause the clock; each
evaluates the average of the replicas); the final parameter average of the
local methods is counted.  Reported: final test accuracy, wall time, time to
reach BSP's final accuracy minus 0.5 points, speedup over BSP, LSSR, syncs,
bytes sent and saved, the consensus' cost per step; the plot shows accuracy
against wall time and the significance against steps.

Example:
    timeout 900 mpiexec -n 4 python -m benchmarks.selsync --json out.json --plot out.png
    timeout 120 mpiexec -n 2 python -m benchmarks.selsync --quick
    python -m benchmarks.cluster --ranks 4 --rate 1gbit -- .venv/bin/python -m benchmarks.selsync \\
        --json benchmarks/results/latest/selsync.json --plot benchmarks/results/latest/selsync.png
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import commlib
from benchmarks import _common as bc
from commlib.collectives import AllReduce, Strategy, TensorSpec, plan_buckets
from commlib.collectives.data import DataInjector, DefDP, IndexPlan, SelDP, injected_batch_size, label_shards
from commlib.collectives.selsync import SelSync


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bc.base_parser(__doc__.splitlines()[0], plot=True)
    p.add_argument("--steps", type=bc.positive_int, default=400,
                   help="training steps per contender (400)")
    p.add_argument("--batch", type=bc.positive_int, default=32,
                   help="per-rank batch (32)")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (0.02)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0.9)")
    p.add_argument("--delta", type=float, default=0.3, help="SelSync threshold (0.3)")
    p.add_argument("--window", type=bc.positive_int, default=25,
                   help="SelSync EWMA window and warm-up (25)")
    p.add_argument("--width", type=bc.positive_int, default=512,
                   help="hidden units of the fully connected layer (512)")
    p.add_argument("--evals", type=bc.positive_int, default=20,
                   help="accuracy evaluations per contender (20)")
    p.add_argument("--cap-mb", type=float, default=25.0, help="bucket cap in MiB (25)")
    p.add_argument("--noniid", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the non-IID / data-injection comparison (on)")
    p.add_argument("--noniid-delta", type=float, default=None, help="SelSync threshold for it (--delta)")
    p.add_argument("--alpha", type=float, default=0.75, help="injection: fraction of ranks sharing (0.75)")
    p.add_argument("--beta", type=float, default=0.75, help="injection: fraction of the batch shared (0.75)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=bc.positive_int, default=1,
                   help="torch threads per rank (1)")
    # --quick sets the defaults only: an option given on the command line wins
    return bc.parse_quick(p, argv, steps=40, evals=4, window=5, width=128)


# ---------------------------------------------------------------------------- data and model
def load_digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as float32 images (N, 1, 8, 8) in [0, 1] and int64 labels: train, then test."""
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    d = _load()
    X = (d.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = d.target.astype(np.int64)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=seed, stratify=y)
    return Xtr, ytr, Xte, yte


def make_model(width: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10))


class FlatModel:
    """The model's parameters as views of flat bucket buffers, gradients and momentum alike.

    What ``bindings.torch`` does for real; here only what the benchmark needs.
    """

    def __init__(self, model: torch.nn.Module, world_size: int, cap_mb: float):
        self.model = model
        self.tensors = [p for p in model.parameters() if p.requires_grad]
        # gradient-ready order: the last layer's gradients come first in backward
        specs = [TensorSpec(i, p.numel(), "float32", 4) for i, p in reversed(list(enumerate(self.tensors)))]
        self.buckets = plan_buckets(specs, world_size, cap_bytes=int(cap_mb * (1 << 20)))
        self.params = [torch.zeros(b.padded) for b in self.buckets]
        self.grads = [torch.zeros(b.padded) for b in self.buckets]
        self.momentum = [torch.zeros(b.padded) for b in self.buckets]
        self.where: list[tuple[int, slice]] = [None] * len(self.tensors)   # type: ignore[list-item]
        for b, bucket in enumerate(self.buckets):
            for slot in bucket.slots:
                t = self.tensors[slot.index]
                sl = slice(slot.offset, slot.offset + slot.numel)
                self.params[b][sl].copy_(t.detach().reshape(-1))
                t.data = self.params[b][sl].view_as(t)
                self.where[slot.index] = (b, sl)
        self.numel = sum(p.numel() for p in self.tensors)

    def collect_grads(self) -> None:
        for t, (b, sl) in zip(self.tensors, self.where):
            self.grads[b][sl].copy_(t.grad.reshape(-1))

    def sgd(self, lr: float, momentum: float) -> None:
        with torch.no_grad():
            for p, g, m in zip(self.params, self.grads, self.momentum):
                m.mul_(momentum).add_(g)
                p.add_(m, alpha=-lr)


class PeriodicAverage(Strategy):
    """FedAvg-style local SGD: parameters and momentum averaged every ``period`` steps."""

    name = "periodic"

    def __init__(self, period: int, extra: list[Any]):
        super().__init__()
        self.period, self.extra = max(1, int(period)), extra
        self.stats.update({"syncs": 0, "local_steps": 0})

    def launch(self, b: int) -> None:
        pass

    def average(self) -> None:
        works = [self.comm.iallreduce(p, "avg", out=p, tag=f"fedavg{i}")
                 for i, p in enumerate([*self.params, *self.extra])]
        self._wait(works)
        self.stats["bytes"] += sum(b.nbytes for b in self.buckets) * 2

    def after_update(self) -> None:
        if (self.steps + 1) % self.period == 0:
            self.average()
            self.stats["syncs"] += 1
        else:
            self.stats["local_steps"] += 1
        super().after_update()


def batches(plan: IndexPlan, batch: int) -> Iterator[np.ndarray]:
    """Batches of ``plan`` over epochs, forever (the same count on every rank)."""
    epoch = 0
    while True:
        yield from plan.batches(batch, epoch)
        epoch += 1


# ---------------------------------------------------------------------------- one contender
def train(comm: commlib.Communicator, args: argparse.Namespace, data: tuple, kind: str,
          plan: IndexPlan, delta: float | None = None, period: int | None = None,
          injector: DataInjector | None = None) -> dict[str, Any]:
    """Train one contender; every rank returns the same summary (rank 0's curve)."""
    Xtr, ytr, Xte, yte = data
    flat = FlatModel(make_model(args.width, args.seed), comm.size, args.cap_mb)
    model = flat.model
    local = kind != "bsp"
    if kind == "bsp":
        strategy: Strategy = AllReduce(cap_mb=args.cap_mb)
    elif kind == "selsync":
        strategy = SelSync(AllReduce(cap_mb=args.cap_mb), delta=delta, window=args.window, mode="params",
                           sync_optimizer_state=True)
        strategy.register_state_buffers(flat.momentum)
    else:
        strategy = PeriodicAverage(period or 1, flat.momentum)
    strategy.setup(comm, flat.buckets, flat.params, flat.grads)
    batch = args.batch if injector is None else injected_batch_size(args.batch, args.alpha, args.beta,
                                                                       comm.size)
    stream = batches(plan, batch)
    Xte_t, yte_t = torch.from_numpy(Xte), torch.from_numpy(yte)
    loss_fn = torch.nn.CrossEntropyLoss()
    evals = sorted({max(1, round(args.steps * (i + 1) / args.evals)) for i in range(args.evals)})
    curve: list[dict[str, float]] = []
    samples = 0

    def evaluate() -> float:
        saved = [p.clone() for p in flat.params] if local else None
        if local:
            for p in flat.params:
                comm.allreduce(p, "avg", out=p, tag="eval")
        with torch.no_grad():
            acc = (model(Xte_t).argmax(1) == yte_t).float().mean().item()
        if saved is not None:
            for p, s in zip(flat.params, saved):
                p.copy_(s)
        return 100.0 * acc

    comm.barrier()
    elapsed, t0 = 0.0, time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = next(stream)
        x, y = Xtr[idx], ytr[idx]
        if injector is not None:
            x, y = injector.exchange(step, x, y)
        samples += len(y)
        for b in reversed(range(len(flat.buckets))):
            strategy.before_forward(b)
        model.zero_grad(set_to_none=False)
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        flat.collect_grads()
        for b in range(len(flat.buckets)):
            strategy.bucket_ready(b)
        strategy.before_update()
        flat.sgd(args.lr, args.momentum)
        strategy.after_update()
        if step == args.steps:      # the delivered model: replicas averaged (counted)
            if kind == "selsync":
                strategy.flush()
            elif kind == "fedavg" and args.steps % strategy.period:
                strategy.average()
        if step in evals:
            strategy.flush() if kind != "selsync" else strategy._wait_average()
            comm.barrier()
            elapsed += time.perf_counter() - t0
            acc = evaluate()
            curve.append({"step": step, "time_s": elapsed, "acc": acc, "loss": float(loss.item())})
            comm.barrier()
            t0 = time.perf_counter()
    st = strategy.stats
    syncs = st.get("syncs", args.steps)
    out = {"kind": kind, "final_acc": curve[-1]["acc"], "time_s": elapsed, "curve": curve,
           "syncs": int(syncs), "lssr": (args.steps - syncs) / args.steps, "bytes": float(st["bytes"]),
           "samples_per_rank": samples, "batch": batch, "period": period}
    if kind == "selsync":
        out.update({"bytes_saved": st["bytes_saved"], "consensus_ms_per_step":
                    1e3 * st["consensus_s"] / max(st["consensus_calls"], 1),
                    "observe_ms_per_step": 1e3 * st["observe_s"] / args.steps,
                    "trace": [{"step": s, "norm": n, "ewma": e, "significance": g, "sync": y}
                              for s, n, e, g, y in strategy.trace]})
    # every rank's time: report the slowest
    out["time_s"] = comm.mpi_comm.allreduce(out["time_s"], op=MPI.MAX)
    return out


def time_to(curve: list[dict[str, float]], target: float) -> float | None:
    for pt in curve:
        if pt["acc"] >= target:
            return pt["time_s"]
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    comm = commlib.init()
    data = load_digits(args.seed)
    n = len(data[1])
    nparams = sum(p.numel() for p in make_model(args.width, args.seed).parameters())
    runs: dict[str, dict[str, Any]] = {}
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"selsync benchmark: {comm.size} ranks, CNN {nparams / 1e6:.2f}M parameters, {args.steps} steps, "
        f"batch {args.batch}/rank, delta {args.delta}", flush=True)
    runs["bsp"] = train(comm, args, data, "bsp", DefDP(n, comm.rank, comm.size, seed=args.seed))
    say(f"  bsp      {runs['bsp']['time_s']:.1f} s, accuracy {runs['bsp']['final_acc']:.2f}", flush=True)
    seldp = SelDP(n, comm.rank, comm.size, seed=args.seed)
    runs["selsync"] = train(comm, args, data, "selsync", seldp, delta=args.delta)
    say(f"  selsync  {runs['selsync']['time_s']:.1f} s, accuracy {runs['selsync']['final_acc']:.2f}, "
        f"{runs['selsync']['syncs']} syncs", flush=True)
    period = max(1, round(args.steps / max(runs["selsync"]["syncs"], 1)))
    runs["fedavg"] = train(comm, args, data, "fedavg", SelDP(n, comm.rank, comm.size, seed=args.seed),
                           period=period)
    say(f"  fedavg   {runs['fedavg']['time_s']:.1f} s, accuracy {runs['fedavg']['final_acc']:.2f}, "
        f"every {period} steps", flush=True)
    if args.noniid:
        delta = args.delta if args.noniid_delta is None else args.noniid_delta
        parts = label_shards(data[1], comm.size, shards_per_rank=2, seed=args.seed)
        runs["iid"] = train(comm, args, data, "selsync", DefDP(n, comm.rank, comm.size, seed=args.seed),
                            delta=delta)
        runs["noniid"] = train(comm, args, data, "selsync",
                               DefDP(n, comm.rank, comm.size, seed=args.seed, partition=parts), delta=delta)
        inj = DataInjector(comm, args.alpha, args.beta, seed=args.seed)
        runs["inject"] = train(comm, args, data, "selsync",
                               DefDP(n, comm.rank, comm.size, seed=args.seed, partition=parts), delta=delta,
                               injector=inj)
        inj.close()
        for k in ("iid", "noniid", "inject"):
            say(f"  {k:8s} {runs[k]['time_s']:.1f} s, accuracy {runs[k]['final_acc']:.2f}", flush=True)
    bsp = runs["bsp"]
    target = bsp["final_acc"] - 0.5
    for r in runs.values():
        r["time_to_target_s"] = time_to(r["curve"], target)
        r["speedup"] = bsp["time_s"] / r["time_s"] if r["time_s"] else None
        r["acc_vs_bsp"] = r["final_acc"] - bsp["final_acc"]
    sel = runs["selsync"]
    checks = {"selsync_within_0.5_points": sel["final_acc"] >= bsp["final_acc"] - 0.5,
              "selsync_lssr_at_least_0.7": sel["lssr"] >= 0.7,
              "selsync_2x_less_time": sel["speedup"] is not None and sel["speedup"] >= 2.0}
    if args.noniid:
        lost = runs["iid"]["final_acc"] - runs["noniid"]["final_acc"]
        recovered = runs["inject"]["final_acc"] - runs["noniid"]["final_acc"]
        checks["injection_recovers_half"] = recovered >= 0.5 * lost
        checks["noniid_lost_points"] = round(lost, 2)
        checks["injection_recovered_points"] = round(recovered, 2)
    env = bc.environment(comm.mpi_comm)
    return {"benchmark": "selsync", "command": bc.command_line("selsync"),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "args": vars(args), "params": nparams, "train_samples": n, "test_samples": len(data[3]),
            "target_acc": target, "runs": runs, "checks": checks, "env": env}


# ---------------------------------------------------------------------------- report
def report(doc: dict[str, Any]) -> str:
    a = doc["args"]
    env = doc["env"]
    rate = env.get("cluster_rate_bps")
    lines = [f"# SelSync vs BSP vs FedAvg: {env['ranks']} ranks, CNN {doc['params'] / 1e6:.2f}M parameters, "
             f"digits ({doc['train_samples']} train / {doc['test_samples']} test)", "",
             f"{a['steps']} steps, batch {a['batch']}/rank, lr {a['lr']}, momentum {a['momentum']}, "
             f"delta {a['delta']}, window {a['window']}; links: "
             + (f"{rate / 1e9:g} Gbit/s shaped" if env.get("cluster_shaped") and rate else "unshaped"), ""]
    header = ["run", "final acc %", "vs BSP", "wall s", "speedup", f"time to {doc['target_acc']:.2f}% s",
              "syncs", "LSSR", "MB sent", "MB saved", "flag ms/step"]
    rows = []
    for name, r in doc["runs"].items():
        rows.append([name, r["final_acc"], r["acc_vs_bsp"], r["time_s"], r["speedup"], r["time_to_target_s"],
                     r["syncs"], r["lssr"], r["bytes"] / 1e6, r.get("bytes_saved", 0.0) / 1e6 or None,
                     r.get("consensus_ms_per_step")])
    lines.append(bc.markdown_table(header, rows))
    lines += ["", "MB saved: SelSync's own sync (its parameters' all-reduce) times its local steps, "
              "not against BSP; against BSP, compare MB sent.", ""]
    lines += [f"- {k}: {v}" for k, v in doc["checks"].items()]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    for name in ("bsp", "selsync", "fedavg"):
        c = doc["runs"][name]["curve"]
        ax.plot([p["time_s"] for p in c], [p["acc"] for p in c], marker="o", ms=3, label=name)
    ax.axhline(doc["target_acc"], color="grey", ls=":", lw=1, label="BSP final - 0.5")
    ax.set(xlabel="wall time (s, training only)", ylabel="test accuracy (%)", title="accuracy vs wall time")
    ax.legend()
    ax = axes[1]
    tr = doc["runs"]["selsync"].get("trace", [])
    if tr:
        steps = [t["step"] for t in tr]
        ax.plot(steps, [t["significance"] for t in tr], lw=1, label="significance (rank 0)")
        synced = [t for t in tr if t["sync"]]
        ax.scatter([t["step"] for t in synced], [t["significance"] for t in synced], s=8, color="red",
                   label="sync step", zorder=3)
        ax.axhline(doc["args"]["delta"], color="grey", ls="--", lw=1, label="delta")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_ylim(bottom=0)
    ax.set(xlabel="step", ylabel="relative change of EWMA(|g|)", title="SelSync metric")
    ax.legend()
    ax = axes[2]
    for name in ("iid", "noniid", "inject"):
        if name in doc["runs"]:
            c = doc["runs"][name]["curve"]
            ax.plot([p["step"] for p in c], [p["acc"] for p in c], marker="o", ms=3, label=name)
    ax.set(xlabel="step", ylabel="test accuracy (%)", title="SelSync, DefDP: non-IID and injection")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    return bc.publish(args, run(args), report, plot)


if __name__ == "__main__":
    main()
