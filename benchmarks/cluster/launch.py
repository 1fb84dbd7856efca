"""Launch a command as MPI ranks, one per namespace, under the mpich wheel's mpiexec.

Hydra's proxy runs in the root namespace and execs, per rank, a small
wrapper (hydra has set ``PMI_RANK``, ``PMI_SIZE`` and ``PMI_FD``).  The
wrapper enters the rank's namespace with ``ip netns exec`` and forces MPICH
onto the shaped TCP link:

- ``MPIR_CVAR_NOLOCAL=1``: without it MPICH sees one host (one hostname) and
  silently moves every byte through shared memory, across namespaces; the
  shaping then does nothing (measured: 4 MiB allreduce on 2 ranks in 2.6 ms
  at "1 Gbit/s", 0 bytes through ``tc``);
- ``MPIR_CVAR_CH4_NETMOD=ofi``, ``FI_PROVIDER=tcp``, ``FI_TCP_IFACE=eth0``:
  libfabric's TCP provider, bound to the rank's veth.

The PMI connection to the proxy is the inherited socket ``PMI_FD``, which
keeps working inside the namespace; nothing of hydra's needs the loopback.
Hydra gives its proxy and every rank a session of their own, so ending the
ranks takes more than a signal to mpiexec's process group: :func:`kill_tree`.

Ranks see :func:`rank_env` plus, from the wrapper, ``COMMLIB_CLUSTER_RANK``,
``COMMLIB_CLUSTER_NETNS`` and ``COMMLIB_CLUSTER_ADDR``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence

from .netns import SUBNET, Cluster, signals_blocked

#: environment variable that marks every process of one run (its value is the run's id)
RUN_MARKER = "COMMLIB_CLUSTER_RUN_ID"

#: what forces MPICH onto the shaped links (exported by the wrapper, inside the namespace)
MPICH_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi",
             "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}

_WRAPPER = """#!/bin/sh
# one rank of an emulated cluster: hydra's proxy execs this in the root namespace
{exports}
export COMMLIB_CLUSTER_RANK="$PMI_RANK" COMMLIB_CLUSTER_NETNS="{prefix}$PMI_RANK"
export COMMLIB_CLUSTER_ADDR="{subnet}.$((PMI_RANK + 1))"
exec {ip} netns exec "{prefix}$PMI_RANK" "$@"
"""


def mpiexec_path() -> str:
    """The mpich wheel's ``mpiexec`` beside this interpreter (else the one on PATH).

    Example:
        >>> mpiexec_path().endswith("mpiexec")
        True
    """
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else (shutil.which("mpiexec") or "mpiexec")


def rank_env(ranks: int, cluster: Cluster | None) -> dict[str, str]:
    """The ``COMMLIB_CLUSTER_*`` variables every rank sees.

    ``COMMLIB_CLUSTER_SHAPED`` is ``1`` inside shaped namespaces and ``0`` for
    plain, unshaped ranks (figures must then say so); ``COMMLIB_CLUSTER_RATE``
    (bits/s) is set only when shaped.

    Example:
        >>> rank_env(4, None)
        {'COMMLIB_CLUSTER_RANKS': '4', 'COMMLIB_CLUSTER_SHAPED': '0'}
    """
    env = {"COMMLIB_CLUSTER_RANKS": str(ranks), "COMMLIB_CLUSTER_SHAPED": "0"}
    if cluster is not None:
        env.update(COMMLIB_CLUSTER_SHAPED="1", COMMLIB_CLUSTER_RATE=str(int(cluster.rate_bps)),
                   COMMLIB_CLUSTER_DELAY_MS=f"{cluster.delay_ms:g}",
                   COMMLIB_CLUSTER_JITTER_MS=f"{cluster.jitter_ms:g}",
                   COMMLIB_CLUSTER_PREFIX=cluster.prefix)
    return env


def run_ranks(cmd: Sequence[str], ranks: int, cluster: Cluster | None,
              timeout: float | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run ``cmd`` as ``ranks`` MPI ranks, in ``cluster``'s namespaces when given.

    Returns the exit status: the command's, or 124 after ``timeout`` seconds
    (every rank killed).  On any exception (Ctrl-C included) every rank is
    killed before it propagates.  ``env`` is added to the ranks' environment.

    Example:
        >>> run_ranks(["python", "-c", "pass"], 2, None, timeout=60)   # doctest: +SKIP
        0
    """
    # not ours to pass on: a surrounding run's cluster and PMI variables (a nested launch
    # would talk to the outer hydra); the wrapper overrides MPICH_ENV in shaped ranks
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("COMMLIB_CLUSTER_", "PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL"))}
    full_env.update(rank_env(ranks, cluster))
    full_env.update(env or {})
    # every process of this run inherits the marker, so that none escapes kill_tree
    full_env[RUN_MARKER] = uuid.uuid4().hex
    argv = [mpiexec_path(), "-n", str(ranks)]
    with tempfile.TemporaryDirectory(prefix="commlib-cluster-") as tmp:
        if cluster is not None:
            wrapper = os.path.join(tmp, "rank.sh")
            exports = "\n".join(f"export {k}={v}" for k, v in MPICH_ENV.items())
            with open(wrapper, "w") as f:
                f.write(_WRAPPER.format(exports=exports, prefix=cluster.prefix, subnet=SUBNET,
                                        ip=shutil.which("ip") or "ip"))
            os.chmod(wrapper, 0o755)
            argv.append(wrapper)
        # a session of its own: a terminal's Ctrl-C reaches only us, and we end the ranks
        proc = subprocess.Popen([*argv, *cmd], env=full_env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"cluster: time limit ({timeout:.1f} s) reached; killing every rank",
                  file=sys.stderr, flush=True)
            kill_tree(proc, full_env[RUN_MARKER])
            return 124
        except BaseException:
            with signals_blocked():
                kill_tree(proc, full_env[RUN_MARKER])
            raise
        kill_tree(proc, full_env[RUN_MARKER])  # whatever of the run is still alive has no business
        return rc


def _stat(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()   # [state, ppid, ..., starttime at 19]


def marked(run_id: str) -> list[tuple[int, int]]:
    """``(pid, start time)`` of every process whose environment carries ``run_id``.

    Example:
        >>> marked("no-such-run")
        []
    """
    needle = f"{RUN_MARKER}={run_id}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append((int(name), int(_stat(name)[19])))
        except (OSError, IndexError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[tuple[int, int]]:
    """``(pid, start time)`` of every process below ``pid`` now.

    Example:
        >>> descendants(os.getpid())   # doctest: +SKIP
        []
    """
    children: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                st = _stat(name)
                children.setdefault(int(st[1]), []).append((int(name), int(st[19])))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def _kill_exact(procs: Sequence[tuple[int, int]]) -> None:
    """SIGKILL each (pid, start time) that is still that very process (no pid reuse)."""
    for pid, start in procs:
        try:
            if int(_stat(pid)[19]) == start:
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


def kill_tree(proc: subprocess.Popen, run_id: str | None = None, grace_s: float = 3.0) -> None:
    """End mpiexec and every process of its run.

    SIGTERM to mpiexec (hydra then ends its proxy and ranks); after
    ``grace_s`` SIGKILL to whatever is left of mpiexec's process tree and of
    the processes whose environment carries ``run_id`` (hydra's proxy and
    ranks run in sessions of their own, and outlive a killed mpiexec).

    Example:
        >>> kill_tree(subprocess.Popen(["sleep", "60"]))   # doctest: +SKIP
    """
    tree = set(descendants(proc.pid))
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            tree.update(descendants(proc.pid))
            time.sleep(0.05)
        tree.update(descendants(proc.pid))
        if proc.poll() is None:
            proc.kill()
    if run_id:
        tree.update(marked(run_id))
    _kill_exact(sorted(tree))
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
        pass
