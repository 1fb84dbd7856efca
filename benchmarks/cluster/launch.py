"""Launch a command as MPI ranks, one per namespace, under the mpich wheel's mpiexec.

Each rank is started through a small wrapper that hydra execs (it sets
``PMI_RANK``): the wrapper enters the rank's namespace with ``ip netns exec``
and forces MPICH onto the shaped TCP link with ``MPIR_CVAR_NOLOCAL=1``
(without it MPICH silently uses shared memory across namespaces and the
shaping does nothing), ``MPIR_CVAR_CH4_NETMOD=ofi``, ``FI_PROVIDER=tcp`` and
``FI_TCP_IFACE=eth0``; it also selects MPICH's ring algorithms for allreduce
and allgather unless the caller set them.  The PMI connection to hydra's proxy is an inherited
file descriptor, so it keeps working inside the namespace.

Ranks see ``COMMLIB_CLUSTER_SHAPED`` (1 or 0), ``COMMLIB_CLUSTER_RATE``
(bits/s, only when shaped), ``COMMLIB_CLUSTER_RANKS`` and
``COMMLIB_CLUSTER_DELAY_MS``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence

from .netns import Cluster

_WRAPPER = """#!/bin/sh
export MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0
exec ip netns exec {prefix}"$PMI_RANK" "$@"
"""


_RING = {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring",
         "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "tsp_ring",
         "MPIR_CVAR_ALLGATHER_INTRA_ALGORITHM": "ring",
         "MPIR_CVAR_IALLGATHER_INTRA_ALGORITHM": "tsp_ring"}


def mpiexec_path() -> str:
    """The mpich wheel's mpiexec beside this interpreter (falls back to PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else "mpiexec"


def run_ranks(cmd: Sequence[str], ranks: int, cluster: Cluster | None,
              timeout: float | None = None,
              schedule: Sequence[tuple[float, int, float]] = ()) -> int:
    """Run ``cmd`` as ``ranks`` MPI ranks; inside ``cluster``'s namespaces when given.

    ``schedule``: (seconds after start, rank, rate_bps) link-rate changes,
    applied while the command runs (slow-link straggler injection).  Returns the exit
    code (124 on timeout, after killing every rank).

    Example:
        >>> run_ranks(["python", "-c", "print(1)"], 2, None)   # doctest: +SKIP
        0
    """
    env = dict(os.environ, COMMLIB_CLUSTER_RANKS=str(ranks))
    argv = [mpiexec_path(), "-n", str(ranks)]
    with tempfile.TemporaryDirectory(prefix="commlib-cluster-") as tmp:
        if cluster is not None:
            wrapper = os.path.join(tmp, "rank.sh")
            with open(wrapper, "w") as f:
                f.write(_WRAPPER.format(prefix=cluster.prefix))
            os.chmod(wrapper, 0o755)
            argv.append(wrapper)
            env.update(COMMLIB_CLUSTER_SHAPED="1", COMMLIB_CLUSTER_RATE=str(int(cluster.rate_bps)),
                       COMMLIB_CLUSTER_DELAY_MS=str(cluster.delay_ms))
            # Links are the bottleneck here: MPICH's bandwidth-optimal ring algorithms
            # (its defaults are tuned for shared memory; 16 MiB allreduce on 4 ranks at
            # 1 Gbit/s: 1.19x the ring bound by default, 1.03x with ring).  Set yours to override.
            for cvar, value in _RING.items():
                env.setdefault(cvar, value)
        else:
            env.update(COMMLIB_CLUSTER_SHAPED="0")
            env.pop("COMMLIB_CLUSTER_RATE", None)
        proc = subprocess.Popen([*argv, *cmd], env=env, start_new_session=True)
        timers = [threading.Timer(t, cluster.set_rate, (r, b)) for t, r, b in schedule] \
            if cluster is not None else []
        for t in timers:
            t.daemon = True
            t.start()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"cluster: command still running after {timeout} s; killing every rank",
                  file=sys.stderr)
            _kill(proc)
            return 124
        except BaseException:
            _kill(proc)
            raise
        finally:
            for t in timers:
                t.cancel()


def _kill(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue
