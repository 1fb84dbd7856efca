"""The Chrome-trace timeline parses and holds queued / running / waiting phases."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib.tracing import Tracer, timeline_problem


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
    phases = {(e["args"]["op"], e["cat"]) for e in events + queued_slices(doc)}
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


def queued_slices(doc: dict) -> list[dict]:
    """The async ``queued`` slices of a timeline, their begin and end paired by ``id``: one
    event each, with its ``dur``."""
    begins = {e["id"]: e for e in doc["traceEvents"] if e["ph"] == "b"}
    ends = {e["id"]: e for e in doc["traceEvents"] if e["ph"] == "e"}
    assert begins.keys() == ends.keys()
    return [{**b, "dur": ends[k]["ts"] - b["ts"]} for k, b in begins.items()]


@pytest.mark.mpi(min_size=1)
def test_timeline_tracks_nest_with_a_split_and_operations_in_flight(tmp_path_factory):
    """Several nonblocking operations in flight on a communicator and its split: every track's
    complete slices nest (the trace format's rule: Perfetto drops the others), each communicator
    has tracks of its own, named, and every queued slice is an async one with its tag and bytes
    (they overlapped on the one engine track, both communicators' slices on it)."""
    base = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("tl4")) if MPI.COMM_WORLD.rank == 0
                                else None)
    a = commlib.init(comm=MPI.COMM_WORLD, timeline=base + os.sep)
    b = a.split(0)
    x = np.ones(1 << 15)
    for _ in range(3):
        works = [c.iallreduce(x, tag=f"{name}{i}") for i in range(3) for name, c in (("a", a), ("b", b))]
        for w in works:
            w.wait()
    b.close()
    a.close()
    with open(os.path.join(base, f"rank{MPI.COMM_WORLD.rank}.json")) as f:
        doc = json.load(f)
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    by_tid: dict[int, list[dict]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            by_tid.setdefault(e["tid"], []).append(e)
    for tid, events in by_tid.items():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[float] = []
        for e in events:
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1] + 1e-3, (names[tid], e)
            open_ends.append(e["ts"] + e["dur"])
    running = {names[e["tid"]]: e["args"]["tag"][0] for e in doc["traceEvents"]
               if e["ph"] == "X" and e["cat"] == "running" and "tag" in e["args"]}
    assert running == {"engine": "a", "engine (communicator 1)": "b"}, running
    queued = queued_slices(doc)
    assert {q["args"]["tag"][0] for q in queued} == {"a", "b"} and len(queued) >= 6
    assert all(q["args"]["nbytes"] == x.nbytes and q["dur"] >= 0 for q in queued)


def test_tracer_timeline_path_and_nvtx_off(tmp_path):
    cfg = commlib.Config.from_env(timeline=str(tmp_path / "t-{rank}.json"))
    assert cfg.timeline_path(3) == str(tmp_path / "t-3.json")
    assert commlib.Config.from_env(timeline=str(tmp_path / "t.json")).timeline_path(1) == \
        str(tmp_path / "t.rank1.json")
    for folder in (str(tmp_path) + os.sep, str(tmp_path), str(tmp_path / "n{rank}") + os.sep):
        assert commlib.Config.from_env(timeline=folder).timeline_path(2) == \
            os.path.join(folder.replace("{rank}", "2"), "rank2.json")
    assert "not writable" in timeline_problem("/proc/t.json")     # as root too (os.access said yes)
    tr = Tracer(rank=0, path=str(tmp_path / "x.json"), nvtx=False)
    with tr.span("running", "allreduce", "engine", seq=1, nbytes=8):
        pass
    tr.instant("switch", reason="test")
    doc = json.loads(open(tr.write()).read())
    names = [e["name"] for e in doc["traceEvents"]]
    assert "allreduce running" in names and "switch" in names


@pytest.mark.mpi(min_size=1)
def test_two_communicators_of_one_timeline_write_both(tmp_path_factory):
    """Two communicators from ``init()`` (the second with another setting) under one
    ``COMMLIB_TIMELINE``: the file holds both's events (each wrote its own at exit, the last one
    replacing the other's)."""
    base = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("tl2")) if MPI.COMM_WORLD.rank == 0
                                else None)
    path = os.path.join(base, "t.json")
    a = commlib.init(comm=MPI.COMM_WORLD, timeline=path)
    b = commlib.init(comm=MPI.COMM_WORLD, timeline=path, timeout=600)
    a.allreduce(np.ones(4), tag="on_a")
    b.allgather(np.ones(4), tag="on_b")
    b.close()
    a.close()
    with open(os.path.join(base, f"t.rank{MPI.COMM_WORLD.rank}.json")) as f:
        tags = {e["args"].get("tag") for e in json.load(f)["traceEvents"] if e["ph"] == "X"}
    assert {"on_a", "on_b"} <= tags, tags


@pytest.mark.mpi(min_size=2)
def test_a_timeline_one_rank_cannot_write_fails_init_on_every_rank(tmp_path_factory):
    """Rank 1's timeline folder is a file: ``init()`` raises on every rank, naming it (it used to
    start, and at exit rank 1's failed write skipped the collective frees its peers waited in:
    the job never ended)."""
    base = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("tl3")) if MPI.COMM_WORLD.rank == 0
                                else None)
    if MPI.COMM_WORLD.rank == 0:
        open(os.path.join(base, "r1"), "w").close()
    MPI.COMM_WORLD.Barrier()
    with pytest.raises(commlib.ValidationError, match=r"COMMLIB_TIMELINE: rank 1: timeline .*r1/t\.json"):
        commlib.init(comm=MPI.COMM_WORLD, timeline=os.path.join(base, "r{rank}", "t.json"))
    c = commlib.init(comm=MPI.COMM_WORLD, timeline=os.path.join(base, "ok{rank}", "t.json"))
    assert c.allreduce(np.ones(2))[0] == c.size
    c.close()
    assert os.path.exists(os.path.join(base, f"ok{c.rank}", "t.json"))


def test_nvtx_force_is_a_keyword_as_it_is_a_variable(monkeypatch):
    """``init(nvtx="force")`` forces the ranges as ``COMMLIB_NVTX=force`` does (the keyword was read
    as 1: ranges only with a tool attached); 1 without a tool attached emits none."""
    pytest.importorskip("nvtx")
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("COMMLIB_NVTX", raising=False)
    cfg = commlib.Config.from_env(nvtx="force")
    assert cfg.nvtx == "force" and Tracer(0, None, cfg.nvtx).nvtx
    assert not Tracer(0, None, commlib.Config.from_env(nvtx=1).nvtx).nvtx
    monkeypatch.setenv("COMMLIB_NVTX", "force")
    assert not Tracer(0, None, commlib.Config.from_env(nvtx=0).nvtx).nvtx    # the keyword wins
    assert Tracer(0, None, commlib.Config.from_env().nvtx).nvtx
    with pytest.raises(commlib.ValidationError, match="expected 0, 1 or force"):
        commlib.Config.from_env(nvtx="sometimes")
