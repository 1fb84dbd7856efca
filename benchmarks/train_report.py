"""Report, target check and plot of ``benchmarks.train`` (rank 0, from the run's JSON document).

Example:
    >>> rate_label(2.5e8), rate_label(1e9), rate_label(None)
    ('250 Mbit/s', '1000 Mbit/s', 'unshaped')
"""

from __future__ import annotations

from typing import Any

from benchmarks import _common as bc

ORDER = ("local", "ddp", "allreduce", "dear", "syncswitch-dear", "allreduce-join", "dear-join", "exdyna",
         "topk")
#: contenders whose steps are DeAR's (update on this rank's shard)
DEAR_STEPS = ("dear", "syncswitch-dear", "dear-join")


def rate_label(rate: float | None) -> str:
    return f"{rate / 1e6:g} Mbit/s" if rate else "unshaped"


def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None or v != v else f"{v:.{digits}f}x"


def speedups(pt: dict[str, Any]) -> dict[str, float | None]:
    """DeAR's speedups at one point (``None`` where a contender is missing)."""
    c = pt["contenders"]
    d = c.get("dear", {}).get("step_s")
    return {base: (c[base]["step_s"] / d if d and base in c else None) for base in ("allreduce", "ddp")}


def exposed_by_bound(pt: dict[str, Any], name: str) -> float | None:
    """Seconds of communication the bound leaves exposed for ``name`` (what it may wait)."""
    p = pt["pieces"]
    if name in ("allreduce", "allreduce-join"):
        return max(0.0, p["t_allreduce"] - p["t_bwd"])
    if name in DEAR_STEPS:
        return max(0.0, p["t_allgather"] - p["t_fwd"]) + max(0.0, p["t_reduce_scatter"] - p["t_bwd"])
    return None


def compute_in_step(pt: dict[str, Any], name: str) -> tuple[float, float] | None:
    """(compute seconds in ``name``'s step: wall minus waits, the same compute measured alone)."""
    r, p = pt["contenders"][name], pt["pieces"]
    if name in ("ddp",) or name not in pt["bounds"]:
        return None
    upd = p["t_update_shard"] if name in DEAR_STEPS else p["t_update"]
    busy = sum(r[f"{ph}_s"] - r[f"wait_{ph}_s"] for ph in ("fwd", "bwd", "opt"))
    return busy, p["t_fwd"] + p["t_bwd"] + upd


def check_targets(doc: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(target, met, detail) per target of :data:`benchmarks.train.TARGETS`."""
    out = []
    tg = doc["targets"]
    for model in doc["models"]:
        pts = [p for p in doc["points"] if p["model"] == model]
        for base in ("allreduce", "ddp"):
            vals = [(speedups(p)[base], p) for p in pts if speedups(p)[base] is not None]
            if vals:
                v, p = max(vals, key=lambda t: t[0])
                lim = tg[f"dear/{base}"]
                out.append((f"{model}: DeAR/{base} >= {lim:.2f} (best rate)", v >= lim,
                            f"{v:.2f}x at {rate_label(p['rate_bps'])}"))
        worst = [(r["vs_bound"], c, p) for p in pts for c, r in p["contenders"].items()
                 if "vs_bound" in r]
        lim = tg["step/bound"]
        misses = [f"{c} {v:.2f}x at {rate_label(p['rate_bps'])}" for v, c, p in worst if v > lim]
        if worst:
            out.append((f"{model}: every contender within {lim:.2f}x of its bound", not misses,
                        "; ".join(misses) or f"worst {max(worst, key=lambda t: t[0])[0]:.2f}x"))
    return out


def report(doc: dict[str, Any]) -> str:
    env, args = doc["env"], doc["args"]
    rates = sorted({p["rate_bps"] or 0 for p in doc["points"]})
    where = ", ".join(rate_label(r or None) for r in rates)
    where = (("links swept " if len(rates) > 1 else "links ") + where
             if env.get("cluster_shaped") else "no link shaping")
    lines = [f"# Training steps against their overlap bounds, {env['ranks']} ranks, {where}", "",
             f"Batch {args['batch']} per rank, SGD momentum 0.9, bucket cap {args['cap_mb']:g} MiB "
             f"(DDP too), one torch thread per rank; step = median of {args['rounds']} rounds of "
             f"{args['steps']} steps (slowest rank); pieces: median of {args['piece_reps']}, alone, "
             "same link, same run. Cells: step seconds (step / own overlap bound); `DeAR/AllReduce` and "
             "`DeAR/DDP`: DeAR's speedup, the other's step over DeAR's (> 1: DeAR is faster).", "",
             "Bounds: WFBP (AllReduce, DDP with gloo's allreduce) `t_fwd + max(t_bwd, t_allreduce) + "
             "t_update`; DeAR `max(t_fwd, t_allgather) + max(t_bwd, t_reduce_scatter) + t_update_shard` "
             "(its ZeRO-1 update of 1/n of the parameters); local `t_fwd + t_bwd + t_update`, with "
             "t_fwd, t_bwd, t_update from the local contender's own rounds.", ""]
    for model, info in doc["models"].items():
        pts = [p for p in doc["points"] if p["model"] == model]
        names = [c for c in ORDER if c in pts[0]["contenders"]]
        kw = ", ".join(f"{k} {v}" for k, v in info["kwargs"].items())
        lines += [f"## {model} ({info['params'] / 1e6:.1f}M parameters{', ' + kw if kw else ''})", ""]
        table = []
        for p in pts:
            c, s = p["contenders"], speedups(p)
            table.append([rate_label(p["rate_bps"])]
                         + [f"{c[n]['step_s']:.3f} ({_x(c[n].get('vs_bound'))})" for n in names]
                         + [_x(s["allreduce"]), _x(s["ddp"])])
        lines += [bc.markdown_table(["rate"] + names + ["DeAR/AllReduce", "DeAR/DDP"], table), ""]
        keys = ("t_fwd", "t_bwd", "t_update", "t_update_shard", "t_allreduce", "t_reduce_scatter",
                "t_allgather", "t_allreduce_gloo", "mpi4py_allreduce", "mpi4py_reduce_scatter",
                "mpi4py_allgather")
        lines += ["Pieces, measured alone (s); `line AR/RS/AG`: ring at line rate for the plan's bytes:", ""]
        table = [[rate_label(p["rate_bps"])] + [p["pieces"].get(k) for k in keys]
                 + ["/".join(f"{p['line_rate_s'][o]:.3f}" for o in ("allreduce", "reduce_scatter",
                                                                     "allgather"))
                    if p["line_rate_s"] else "-"]
                 for p in pts]
        lines += [bc.markdown_table(["rate", "fwd", "bwd", "update", "update 1/n", "AR", "RS", "AG",
                                     "gloo AR", "mpi4py AR", "mpi4py RS", "mpi4py AG",
                                     "line AR/RS/AG"], table), ""]
        lines += ["Where the step goes (s per step; `w` = blocked waiting on communication; compute = "
                  "wall minus waits, against the same compute alone; waits against what the bound "
                  "leaves exposed; CPU: seconds per step of the main thread and of all other threads, "
                  "commlib's engine and gloo's among them, on the slowest rank):", ""]
        table = []
        for p in pts:
            for n in names:
                r = p["contenders"][n]
                ci, ex = compute_in_step(p, n), exposed_by_bound(p, n)
                waits = r["wait_fwd_s"] + r["wait_bwd_s"] + r["wait_opt_s"]
                table.append([rate_label(p["rate_bps"]), n,
                              f"{r['fwd_s']:.3f} (w {r['wait_fwd_s']:.3f})",
                              f"{r['bwd_s']:.3f} (w {r['wait_bwd_s']:.3f})",
                              f"{r['opt_s']:.3f} (w {r['wait_opt_s']:.3f})",
                              f"{ci[0]:.3f} / {ci[1]:.3f}" if ci else "-",
                              f"{waits:.3f} / {ex:.3f}" if ex is not None else "-",
                              f"{r.get('cpu_main_s', 0):.3f} / {r.get('cpu_other_s', 0):.3f}"])
        lines += [bc.markdown_table(["rate", "contender", "forward", "backward", "optimizer step",
                                     "compute in step / alone", "waits / exposed by bound",
                                     "CPU main / other threads"], table), ""]
    for key, plan in doc["plans"].items():
        if key.endswith("/dear") or key.endswith("/allreduce"):
            sizes = [bc.size_label(b["bytes"]) for b in plan]
            lines.append(f"- fusion plan {key}: {len(plan)} buckets: {', '.join(sizes)}")
    for c, why in doc["skipped"].items():
        if c in args["contenders"]:
            lines.append(f"- {c} skipped: {why}")
    lines += ["", "Targets (issue 12, stated for 2 ranks):", ""]
    for name, met, detail in check_targets(doc):
        lines.append(f"- {'met' if met else 'MISSED'}: {name}: {detail}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    """Step time against link rate per contender (bounds dashed), and step/bound with DeAR's speedups."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(doc["models"])
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.6 * len(models)), squeeze=False)
    colors = {"local": "grey", "ddp": "tab:blue", "allreduce": "tab:orange", "dear": "tab:green",
              "syncswitch-dear": "tab:olive", "allreduce-join": "tab:brown", "dear-join": "tab:cyan",
              "exdyna": "tab:red", "topk": "tab:purple"}
    for row, model in zip(axes, models):
        pts = [p for p in doc["points"] if p["model"] == model]
        xs = [(p["rate_bps"] or 0) / 1e6 for p in pts]
        ax = row[0]
        for n in [c for c in ORDER if c in pts[0]["contenders"]]:
            ax.plot(xs, [p["contenders"][n]["step_s"] for p in pts], marker="o", color=colors[n], label=n)
            if n in pts[0]["bounds"]:
                ax.plot(xs, [p["bounds"][n] for p in pts], ls="--", lw=1, color=colors[n])
        ax.set(xlabel="link rate (Mbit/s)", ylabel="step time (s)",
               title=f"{model}, {doc['env']['ranks']} ranks: step (solid) and overlap bound (dashed)")
        if all(xs):
            ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend()
        ax = row[1]
        for n in [c for c in ORDER if c in pts[0]["bounds"] and c in pts[0]["contenders"]]:
            ax.plot(xs, [p["contenders"][n]["vs_bound"] for p in pts], marker="o", color=colors[n],
                    label=f"{n} step/bound")
        for base, ls in (("allreduce", "-."), ("ddp", ":")):
            ys = [speedups(p)[base] for p in pts]
            if any(y is not None for y in ys):
                ax.plot(xs, [y if y is not None else float("nan") for y in ys], ls=ls, marker="s",
                        color="black", label=f"DeAR/{base} speedup")
        ax.axhline(doc["targets"]["step/bound"], color="grey", lw=1, ls="--")
        ax.axhline(doc["targets"]["dear/allreduce"], color="grey", lw=1, ls=":")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set(xlabel="link rate (Mbit/s)", ylabel="ratio", title="step/bound; DeAR speedups")
        if all(xs):
            ax.set_xscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
