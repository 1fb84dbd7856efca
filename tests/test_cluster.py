"""The emulated cluster (benchmarks/cluster): setup, shaped runs, link stragglers, teardown.

The tests that build namespaces need root and iproute2 and skip elsewhere;
each launches the CLI as a subprocess, as the Makefile does, with a prefix of
its own, and checks that no namespace, link or process is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from benchmarks.cluster import (
    Cluster,
    ClusterBusy,
    LinkChange,
    SelfCheckFailed,
    Straggler,
    available,
    parse_ms,
    parse_rate,
    ring_bound_s,
    selfcheck,
    tbf_params,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
needs_netns = pytest.mark.skipif(available() is not None,
                                 reason=f"cannot make network namespaces here: {available()}")

# 2 ranks: 4 steps (rank 1 straggles by 0.3 s in steps 1 and 2), a 4 MiB allreduce, then
# rank 0 asks the launcher to slow rank 1's link to 50 Mbit/s, a 1 MiB allreduce, the link
# back, another 1 MiB allreduce; rank 0 prints what it saw
SNIPPET = """
import json, os, time, numpy as np
from mpi4py import MPI
from benchmarks.cluster import Straggler, request_link
c = MPI.COMM_WORLD
straggler, t0 = Straggler.from_env(), time.perf_counter()
for step in range(4):
    straggler.maybe_delay(step)
    c.Barrier()
out = {"steps": time.perf_counter() - t0}
def allreduce_s(nbytes):
    a = np.ones(nbytes // 4, np.float32); b = np.empty_like(a)
    c.Allreduce(a, b); c.Allreduce(a, b)
    ts = []
    for _ in range(3):
        c.Barrier(); t = time.perf_counter(); c.Allreduce(a, b)
        ts.append(c.allreduce(time.perf_counter() - t, op=MPI.MAX))
    return sorted(ts)[1]
out["fast"] = allreduce_s(4 << 20)
if c.rank == 0: request_link(1, rate_bps=50e6)
c.Barrier(); out["slow"] = allreduce_s(1 << 20)
if c.rank == 0: request_link(1)
c.Barrier(); out["back"] = allreduce_s(1 << 20)
if c.rank == 0:
    out.update({k: v for k, v in os.environ.items() if k.startswith("COMMLIB_")})
    print("RESULT", json.dumps(out), flush=True)
"""


def _cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.cluster", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return f"{pid} (gone)"


def _alive(token: str) -> list[int]:
    """Pids whose command line carries ``token``."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    pids.append(int(name))
        except (OSError, ValueError):
            continue
    return pids


def test_parsers_bounds_and_straggler_specs():
    assert parse_rate("1gbit") == 1e9 and parse_rate("250mbit") == 250e6 and parse_rate(5e8) == 5e8
    assert parse_ms("1ms") == 1.0 and parse_ms("100us") == pytest.approx(0.1) and parse_ms("2") == 2
    for bad in ("fast", "1 gbit/s"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    assert ring_bound_s(4 << 20, 2, 1e9) == pytest.approx(4 * 8 * (1 << 20) / 1e9)
    assert ring_bound_s(4 << 20, 4, 1e9) == pytest.approx(1.5 * 4 * 8 * (1 << 20) / 1e9)
    assert tbf_params(1e9)["burst"] > 65536  # a whole GSO packet, or tbf segments in software
    s = Straggler.parse("2:0.5:10:20,0:0.1")
    assert s.delay_for(step=10, rank=2) == 0.5 and s.delay_for(step=20, rank=2) == 0
    assert s.delay_for(step=15, rank=1) == 0 and s.delay_for(step=3, rank=0) == 0.1
    slow, back = LinkChange.parse("1:x4:2:5", 1e9)
    assert (slow.rank, slow.at_s, slow.rate_bps, back.at_s, back.rate_bps) == (1, 2, 250e6, 5, None)
    assert LinkChange.parse("3:2ms:1", 1e9)[0].delay_ms == 2.0
    for bad in ("1:x4", "1:fast:2", "1:x4:5:2", "a:x4:1"):
        with pytest.raises(ValueError):
            LinkChange.parse(bad, 1e9)


def test_unshaped_fallback_marks_every_figure():
    proc = _cli("--ranks", "2", "--unshaped", "--timeout", "60", "--", sys.executable, "-c",
                # one write per rank: print's pieces interleave across ranks when unbuffered
                "import os, sys; sys.stdout.write('SHAPED %s %s\\n' % (os.environ['COMMLIB_CLUSTER_SHAPED'], "
                "'RATE' in os.environ.get('COMMLIB_CLUSTER_RATE', 'RATE')))")
    assert proc.returncode == 0, proc.stderr
    assert "NOT SHAPED" in proc.stderr
    assert proc.stdout.count("SHAPED 0 True") == 2


@pytest.mark.mpi(min_size=2)
def test_selfcheck_measures_a_slow_host_again_and_refuses_a_bypass_at_once():
    """Plain ranks against a configured rate: far too fast a rate for this host is measured
    ``attempts`` times, then refused on every rank with each measurement in the message; far too
    slow a rate (traffic not going through any shaper) is refused after one measurement."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    small = {"nbytes": 64 << 10, "iters": 1, "settle_s": 0.0}
    with pytest.raises(SelfCheckFailed, match=r"measurement 3; before: \S+x, \S+x\): the links are"):
        selfcheck(comm, rate_bps=1e15, attempts=3, **small)
    with pytest.raises(SelfCheckFailed, match="bypasses") as bypass:
        selfcheck(comm, rate_bps=1e3, attempts=3, **small)
    assert "measurement" not in str(bypass.value)
    measured = selfcheck(comm, **small)  # no rate: measured once, never refused
    assert measured["ok"] and measured["link_bps"] > 0 and "attempts" not in measured
    with pytest.raises(ValueError, match="attempts"):
        selfcheck(comm, rate_bps=1e9, attempts=0, **small)


@needs_netns
def test_cli_runs_shaped_ranks_with_a_link_straggler_and_cleans_up():
    """2 ranks at 200 Mbit/s: near the ring bound, far slower than shared memory; the slowed
    link is 4x slower again; nothing is left afterwards."""
    prefix = "clt-"
    # a loose self-check: this test is not timed (the benchmarks keep 0.15); an unshaped link,
    # many times faster, still fails it
    proc = _cli("--ranks", "2", "--rate", "200mbit", "--prefix", prefix, "--timeout", "80",
                "--tolerance", "0.4",
                "--straggler-compute", "1:0.3:1:3", "--straggler-link", "1:x2:0:0.1", "--",
                sys.executable, "-c", SNIPPET)
    assert proc.returncode == 0, proc.stderr
    assert "selfcheck ok" in proc.stderr
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[7:])
    assert res["COMMLIB_CLUSTER_SHAPED"] == "1" and float(res["COMMLIB_CLUSTER_RATE"]) == 200e6
    assert res["COMMLIB_CLUSTER_RANKS"] == "2" and res["COMMLIB_CLUSTER_NETNS"] == f"{prefix}0"
    assert json.loads(res["COMMLIB_CLUSTER_SELFCHECK"])["ok"]
    bound = ring_bound_s(4 << 20, 2, 200e6)
    assert 0.9 * bound < res["fast"] < 1.5 * bound, (res["fast"], bound)
    assert res["slow"] > 2.5 * res["back"], res  # 50 vs 200 Mbit/s: 4x in theory
    assert "rank 1 link: 50 Mbit/s" in proc.stderr  # requested by rank 0
    assert "rank 1 link: 100 Mbit/s" in proc.stderr  # the schedule, and back at 0.1 s
    assert proc.stderr.count("rank 1 link: back to the configured link") == 2
    assert 0.6 < res["steps"] < 1.5, res  # the compute straggler held everyone twice
    assert Cluster(2, 200e6, prefix=prefix).leftovers() == []


@needs_netns
def test_timeout_kills_every_rank_and_tears_down():
    token = f"tok-{uuid.uuid4().hex[:12]}"
    t0 = time.monotonic()
    proc = _cli("--ranks", "3", "--prefix", "clt-", "--no-selfcheck", "--timeout", "5", "--",
                sys.executable, "-c", f"import time; time.sleep(600)  # {token}")
    assert proc.returncode == 124, proc.stderr
    assert time.monotonic() - t0 < 30
    assert _alive(token) == []
    assert Cluster(3, 1e9, prefix="clt-").leftovers() == []


@needs_netns
def test_sigterm_to_the_launcher_tears_down():
    token = f"tok-{uuid.uuid4().hex[:12]}"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.cluster", "--ranks", "2", "--prefix", "clt-",
         "--no-selfcheck", "--", sys.executable, "-c", f"import time; time.sleep(600)  # {token}"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60      # the namespaces and links first: slow on a loaded machine
        while len(_alive(token)) < 4 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.1)                     # launcher, mpiexec, 2 ranks
        seen = _alive(token)
        state = "alive" if launcher.poll() is None else f"exited {launcher.returncode}"
        assert len(seen) >= 4, (f"{len(seen)} of the 4 processes within 60 s (launcher {state}): "
                                + " | ".join(_cmdline(pid) for pid in seen))
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, err
    assert _alive(token) == []
    assert Cluster(2, 1e9, prefix="clt-").leftovers() == []


@needs_netns
def test_a_crashed_runs_leftovers_do_not_block_the_next_run():
    crashed = Cluster(2, 1e9, prefix="clx-")
    crashed.__enter__()
    crashed._release_lock()  # never exited, as after a kill -9; the kernel drops the lock
    assert len(crashed.leftovers()) == 5  # 2 namespaces, 2 veth peers, 1 bridge
    orphan = subprocess.Popen(["ip", "netns", "exec", "clx-0", "sleep", "600"])
    try:
        with Cluster(3, 1e9, prefix="clx-") as again:
            assert orphan.wait(timeout=10) == -signal.SIGKILL  # the crashed run's rank
            assert len(again.leftovers()) == 7
            with pytest.raises(ClusterBusy):
                Cluster(2, 1e9, prefix="clx-").__enter__()
            again.set_link(1, rate_bps=100e6)  # slow-link straggler and back
            assert "rate 100Mbit" in subprocess.run(["tc", "qdisc", "show", "dev", "clx-v1"],
                                                    capture_output=True, text=True).stdout
            again.set_link(1)
            assert again.stats(1)["uplink"]["dropped"] == 0
    finally:
        if orphan.poll() is None:
            orphan.kill()
    assert Cluster(3, 1e9, prefix="clx-").leftovers() == []
