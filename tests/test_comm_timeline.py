"""The Chrome-trace timeline parses and holds queued / running / waiting phases."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib.tracing import Tracer


@pytest.mark.mpi(min_size=1)
def test_timeline_file_holds_every_phase(tmp_path_factory):
    base = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("tl")) if MPI.COMM_WORLD.rank == 0
                                else None)
    c = commlib.init(comm=MPI.COMM_WORLD, timeline=os.path.join(base, "trace.json"))
    x = np.ones(1 << 16, np.float32)
    works = [c.iallreduce(x, tag=f"bucket{i}") for i in range(3)]
    for w in works:
        w.wait()
    c.reduce_scatter(x, tag="rs")
    c.close()
    path = os.path.join(base, f"trace.rank{MPI.COMM_WORLD.rank}.json")
    with open(path) as f:
        doc = json.load(f)
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    phases = {(e["args"]["op"], e["cat"]) for e in events}
    assert {("allreduce", "queued"), ("allreduce", "running"), ("reduce_scatter", "running")} <= phases
    if c.size > 1:   # on one rank an operation completes when it is posted: nothing to wait for
        assert ("allreduce", "waiting") in phases
    running = [e for e in events if e["cat"] == "running" and e["args"]["op"] == "allreduce"]
    assert [e["args"]["tag"] for e in running] == ["bucket0", "bucket1", "bucket2"]
    assert [e["args"]["seq"] for e in running] == [1, 2, 3]
    assert all(e["args"]["nbytes"] == x.nbytes and e["dur"] >= 0 for e in running)
    # operations run in submission order: each starts after the previous ends
    for a, b in zip(running, running[1:]):
        assert b["ts"] >= a["ts"] + a["dur"] - 1.0
    assert all(e["pid"] == MPI.COMM_WORLD.rank for e in events)


def test_tracer_timeline_path_and_nvtx_off(tmp_path):
    cfg = commlib.Config.from_env(timeline=str(tmp_path / "t-{rank}.json"))
    assert cfg.timeline_path(3) == str(tmp_path / "t-3.json")
    assert commlib.Config.from_env(timeline=str(tmp_path / "t.json")).timeline_path(1) == \
        str(tmp_path / "t.rank1.json")
    tr = Tracer(rank=0, path=str(tmp_path / "x.json"), nvtx=False)
    with tr.span("running", "allreduce", "engine", seq=1, nbytes=8):
        pass
    tr.instant("switch", reason="test")
    doc = json.loads(open(tr.write()).read())
    names = [e["name"] for e in doc["traceEvents"]]
    assert "allreduce running" in names and "switch" in names
