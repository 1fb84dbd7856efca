"""The collective benchmark runs end to end under MPI and writes a JSON others can read."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from mpi4py import MPI

from benchmarks import collectives, instructions

from conftest import ranks_at_most


@pytest.mark.mpi(min_size=2)
def test_collectives_benchmark_quick_run(tmp_path_factory):
    world = MPI.COMM_WORLD
    base = world.bcast(str(tmp_path_factory.mktemp("bench")) if world.rank == 0 else None)
    path = os.path.join(base, "c.json")
    collectives.main(["--quick", "--no-torch", "--max-bytes", "65536", "--ops", "allreduce", "rs+ag",
                      "--contenders", "mpi4py", "commlib", "commlib-nb", "commlib-t0", "commlib-torch",
                      "jax-eager", "--json", path])
    world.Barrier()
    doc = json.load(open(path))
    assert doc["env"]["ranks"] == world.size
    rows = doc["results"]
    assert {r["op"] for r in rows} == {"allreduce", "rs+ag"}
    for r in rows:
        jax = {"jax-eager"} if r["op"] == "allreduce" else set()       # allreduce and allgather only
        assert set(r["time_s"]) == {"mpi4py", "commlib", "commlib-nb", "commlib-t0", "commlib-torch", *jax}
        assert all(t > 0 for t in r["time_s"].values())
        assert r["ratio"]["commlib/mpi4py"] == r["time_s"]["commlib"] / r["time_s"]["mpi4py"]
        assert r["ratio"]["torch/numpy"] == r["time_s"]["commlib-torch"] / r["time_s"]["commlib"]
        if jax:
            assert r["ratio"]["jax-eager/numpy"] == r["time_s"]["jax-eager"] / r["time_s"]["commlib"]
        else:
            assert "allreduce and allgather only" in r["skipped"]["jax-eager"]
    ov = doc["engine"]["overlap"]   # torch is installed: the figure runs (1 MiB with --quick)
    assert ov["bytes"] == 1 << 20 and ov["allreduce_alone_s"] > 0 and ov["matmul_alone_s"] > 0
    assert ov["allreduce_cpu_s"] >= 0
    t_mm, t_ar = ov["matmul_alone_s"], ov["allreduce_alone_s"]
    if ov["cores_per_rank"] <= 1:
        floor = (t_mm + ov["allreduce_cpu_s"]) / max(t_mm, t_ar) - 1
        assert ov["floor_larger_slowdown"] == pytest.approx(floor)
    figures = {c["figure"] for c in doc["engine_checks"]}
    assert {"overlap: allreduce slowdown", "overlap: matmul slowdown"} <= figures
    assert collectives.ring_bound_s(1 << 20, 4, 1e9) == pytest.approx(2 * 3 / 4 * 8 * (1 << 20) / 1e9)


def quick_run(tmp_path_factory, main, *args: str) -> dict:
    """``main(["--quick", *args, "--json", PATH])`` on every rank; the JSON rank 0 wrote."""
    world = MPI.COMM_WORLD
    base = world.bcast(str(tmp_path_factory.mktemp("bench")) if world.rank == 0 else None)
    path = os.path.join(base, "out.json")
    main(["--quick", *args, "--json", path])
    world.Barrier()
    doc = json.load(open(path))
    assert doc["ranks"] == world.size
    return doc


@pytest.mark.mpi(min_size=2)
def test_syncbn_benchmark_quick_run(tmp_path_factory):
    pytest.importorskip("torch")
    from benchmarks import syncbn

    doc = quick_run(tmp_path_factory, syncbn.main, "--width", "4", "--image", "8", "--batch", "4")
    assert [r["shape"][1] for r in doc["layer"]] == [16, 32, 64, 128]
    for r in doc["layer"]:
        assert min(r["bn_us"], r["mpi_us"], r["syncbn_us"]) > 0
        assert r["syncbn_over_bound"] == pytest.approx(r["syncbn_us"] / (r["bn_us"] + r["mpi_us"]))
    step = doc["step"]
    assert step["layers"] == 20      # ResNet-18's BatchNorm layers, every one converted
    assert step["syncbn_over_rendezvous"] == pytest.approx(step["syncbn_s"] / step["rendezvous_s"])


@pytest.mark.mpi(min_size=2)
@ranks_at_most(2, "make bench runs the jax steps benchmark at 2 ranks; at 4 its XLA compiles "
                  "took 40 s of CI's suite")
def test_jax_steps_benchmark_quick_run(tmp_path_factory):
    pytest.importorskip("jax")
    from benchmarks import jax_steps

    doc = quick_run(tmp_path_factory, jax_steps.main)
    assert set(doc["step_s"]) == set(jax_steps.CONTENDERS) and all(t > 0 for t in doc["step_s"].values())
    assert doc["over_average"]["average"] == doc["over_average"]["average-jit"] == 1.0


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed here")
def test_instructions_benchmark_counts_the_same_every_time(tmp_path):
    """The instruction counts come from valgrind and do not move between runs: two counts of
    the same loop are equal, and the quick run's table is made of such counts."""
    path = tmp_path / "instr.json"
    assert instructions.main(["--quick", "--json", str(path)]) == 0
    doc = json.load(open(path))
    again = instructions.count(instructions.NOOP, doc["calls"], shutil.which("valgrind"))
    assert again == doc["loop_instructions"] * doc["calls"]
    (row,) = doc["rows"]
    assert row["op"] == "allreduce" and doc["calls"] == 500 and doc["loop_instructions"] > 0
    assert 0 < row["mpi4py"] < row["commlib"]      # commlib's call wraps the raw one
    assert row["overhead"] == pytest.approx(row["commlib"] - row["mpi4py"])
    assert row["ratio"] == pytest.approx(row["commlib"] / row["mpi4py"])


def test_instructions_benchmark_without_valgrind_says_so(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert instructions.main(["--quick"]) == 0
    assert "valgrind is not on PATH" in capsys.readouterr().err
