"""The emulated cluster: setup, a shaped run, teardown, and recovery after a crash."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.cluster import Cluster, Straggler, available, parse_rate, ring_bound_s

needs_netns = pytest.mark.skipif(available() is not None, reason=f"no namespaces here: {available()}")

AR = """
import time, numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
a = np.ones(1 << 20, np.float32); b = np.empty_like(a)
c.Allreduce(a, b); c.Barrier(); t = time.perf_counter(); c.Allreduce(a, b)
t = c.allreduce(time.perf_counter() - t, op=MPI.MAX)
if c.rank == 0:
    import os
    print("ALLREDUCE_MS", t * 1e3, os.environ["COMMLIB_CLUSTER_SHAPED"], os.environ["COMMLIB_CLUSTER_RATE"])
"""


def test_parsers_and_bounds():
    assert parse_rate("1gbit") == 1e9 and parse_rate("250mbit") == 250e6 and parse_rate(5e8) == 5e8
    with pytest.raises(ValueError):
        parse_rate("fast")
    assert ring_bound_s(4 << 20, 2, 1e9) == pytest.approx(4 * 8 * (1 << 20) / 1e9)
    s = Straggler.parse("2:0.5:10:20")
    assert s.delay_for(2, 10) == 0.5 and s.delay_for(2, 20) == 0 and s.delay_for(1, 15) == 0


@needs_netns
def test_cli_runs_shaped_ranks_and_cleans_up():
    """4 MiB allreduce on 2 ranks at 200 Mbit/s: near the ring bound (168 ms), far above shared memory."""
    prefix = "clt"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster", "--ranks", "2", "--rate", "200mbit",
         "--prefix", prefix, "--timeout", "60", "--", sys.executable, "-c", AR],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "selfcheck ok" in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ALLREDUCE_MS"))
    ms, shaped, rate = float(line.split()[1]), line.split()[2], float(line.split()[3])
    bound = ring_bound_s(4 << 20, 2, 200e6) * 1e3
    assert shaped == "1" and rate == 200e6
    assert 0.9 * bound < ms < 1.5 * bound, (ms, bound)
    assert Cluster(2, 200e6, prefix=prefix).leftovers() == []


@needs_netns
def test_a_crashed_runs_leftovers_do_not_block_the_next_run():
    crashed = Cluster(2, 1e9, prefix="clx")
    crashed.__enter__()  # never exited, as after a kill -9
    assert len(crashed.leftovers()) == 5   # 2 namespaces, 2 veth peers, 1 bridge
    with Cluster(3, 1e9, prefix="clx") as again:
        assert len(again.leftovers()) == 7
        again.set_rate(1, 1e8)             # slow-link straggler and back
        again.set_rate(1, 1e9)
    assert Cluster(3, 1e9, prefix="clx").leftovers() == []
