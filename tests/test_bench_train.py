"""The training benchmark runs end to end under MPI; bounds and target checks follow the issue."""

from __future__ import annotations

import json
import os

import pytest
from mpi4py import MPI

pytest.importorskip("torch")

from benchmarks import train, train_pieces, train_report  # noqa: E402


def test_bounds_are_the_overlap_formulas():
    p = {"t_fwd": 1.0, "t_bwd": 2.0, "t_update": 0.4, "t_update_shard": 0.1, "t_allreduce": 5.0,
         "t_reduce_scatter": 2.5, "t_allgather": 0.5, "t_allreduce_gloo": None}
    b = train_pieces.bounds(p)
    assert b["allreduce"] == pytest.approx(1.0 + 5.0 + 0.4)          # t_fwd + max(t_bwd, t_ar) + t_upd
    assert b["dear"] == pytest.approx(1.0 + 2.5 + 0.1)               # max(fwd, ag) + max(bwd, rs) + upd
    assert b["local"] == pytest.approx(3.4)
    assert "ddp" not in b
    assert train_pieces.ring_s(1 << 20, 4, 1e9, "reduce_scatter") == pytest.approx(0.75 * 8 * (1 << 20) / 1e9)


def test_targets_pick_the_rate_where_dear_gains_most():
    def point(rate, ar, dear, ddp):
        c = {"allreduce": {"step_s": ar, "vs_bound": 1.0}, "dear": {"step_s": dear, "vs_bound": 1.2},
             "ddp": {"step_s": ddp, "vs_bound": 1.1}}
        return {"model": "m", "rate_bps": rate, "contenders": c}
    doc = {"targets": train.TARGETS, "models": {"m": {}},
           "points": [point(1e8, 1.0, 0.95, 1.0), point(5e8, 1.0, 0.8, 0.9)]}
    checks = {name.split(": ")[1].split(" ")[0]: (met, detail) for name, met, detail in
              train_report.check_targets(doc)}
    assert checks["DeAR/allreduce"] == (True, "1.25x at 500 Mbit/s")
    assert checks["DeAR/ddp"] == (True, "1.12x at 500 Mbit/s")
    met, detail = checks["every"]
    assert not met and "dear 1.20x at 100 Mbit/s" in detail and "allreduce" not in detail


@pytest.mark.mpi(min_size=2)
def test_train_benchmark_quick_run(tmp_path_factory):
    world = MPI.COMM_WORLD
    base = world.bcast(str(tmp_path_factory.mktemp("train")) if world.rank == 0 else None)
    path, png = os.path.join(base, "t.json"), os.path.join(base, "t.png")
    train.main(["--quick", "--json", path, "--plot", png, "--contenders", *train.CONTENDERS[:5]])
    world.Barrier()
    doc = json.load(open(path))
    assert doc["env"]["ranks"] == world.size
    (pt,) = doc["points"]
    assert {"local", "allreduce", "dear", "syncswitch-dear"} <= set(pt["contenders"])
    for name, row in pt["contenders"].items():
        assert row["step_s"] > 0 and row["fwd_s"] >= row["wait_fwd_s"] >= 0
        assert row["vs_bound"] == pytest.approx(row["step_s"] / pt["bounds"][name])
    for key in ("t_fwd", "t_bwd", "t_update_shard", "t_allreduce", "t_reduce_scatter", "t_allgather",
                "mpi4py_allreduce"):
        assert pt["pieces"][key] > 0
    assert os.path.getsize(png) > 0
    assert [m for _, m, _ in train_report.check_targets(doc)]
