"""Run a command as MPI ranks over shaped links: ``python -m benchmarks.cluster [options] -- COMMAND``.

Builds one network namespace per rank behind tbf-shaped veth links, runs the
self-check (refuses to go on when the links are more than --tolerance off
the rate), runs COMMAND as the ranks, and tears everything down, also on
Ctrl-C, SIGTERM, failure or --timeout.  Where namespaces cannot be made it
says so and runs COMMAND as plain, unshaped ranks (COMMLIB_CLUSTER_SHAPED=0).

Examples:
    python -m benchmarks.cluster --ranks 4 --rate 1gbit -- python -m benchmarks.collectives
    python -m benchmarks.cluster --selfcheck-only --sizes 4,16,64 --iters 10
    python -m benchmarks.cluster --straggler-link 2:x4:10:20 --straggler-compute 1:0.05:100:200 -- CMD

Exit status: COMMAND's; 124 on --timeout; 130 on Ctrl-C/SIGTERM; 3 when the
self-check fails; 2 when the cluster cannot be built as asked.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

from .control import LinkChange, LinkController
from .launch import run_ranks
from .netns import (
    SUBNET,
    Cluster,
    ClusterBusy,
    ClusterUnavailable,
    available,
    parse_ms,
    parse_rate,
    tbf_params,
)
from .straggler import Straggler

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _say(msg: str) -> None:
    print(f"cluster: {msg}", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.cluster``.

    Example:
        >>> parser().parse_args(["--ranks", "2", "--", "true"]).command
        ['--', 'true']
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="MPI ranks, one namespace each (4)")
    p.add_argument("--rate", default="1gbit", help="link rate each way: 1gbit, 500mbit, ... (1gbit)")
    p.add_argument("--delay", default="0", help="one-way link delay (1ms, 100us); needs netem")
    p.add_argument("--jitter", default="0", help="delay jitter (0.1ms); needs netem")
    p.add_argument("--burst", type=int, default=None,
                   help="tbf bucket, bytes (default: a GSO packet or 0.5 ms of the rate)")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill every rank and tear down after this many seconds in all")
    check = p.add_mutually_exclusive_group()
    check.add_argument("--no-selfcheck", action="store_true", help="skip the link self-check")
    check.add_argument("--selfcheck-only", action="store_true",
                       help="run only the self-check (with --sizes: an allreduce table) and exit")
    p.add_argument("--tolerance", type=float, default=0.15,
                   help="self-check: largest allowed relative error of the rate (0.15)")
    p.add_argument("--sizes", default="", help="--selfcheck-only: allreduce sizes, MiB (4,16,64)")
    p.add_argument("--iters", type=int, default=5, help="self-check: timed repetitions (5)")
    p.add_argument("--attempts", type=int, default=3,
                   help="self-check: measurements before a too-slow host is refused (3)")
    p.add_argument("--straggler-link", action="append", default=[],
                   metavar="RANK:CHANGE:AT_S[:UNTIL_S]",
                   help="from AT_S s after COMMAND starts, change RANK's link: x4 (rate/4), "
                        "100mbit, or 5ms (delay, needs netem); back at UNTIL_S (repeatable)")
    p.add_argument("--straggler-compute", action="append", default=[],
                   metavar="RANK:SECONDS[:START[:STOP]]",
                   help="RANK sleeps SECONDS more per step in [START, STOP) of Straggler."
                        "maybe_delay(step) (COMMLIB_STRAGGLER_COMPUTE; repeatable)")
    p.add_argument("--unshaped", action="store_true",
                   help="plain mpiexec, no namespaces (figures are marked unshaped)")
    p.add_argument("--prefix", default="cl-", help="name prefix of namespaces and links (cl-)")
    p.add_argument("--teardown", action="store_true",
                   help="only remove what a crashed run with --prefix left behind")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return p


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status.

    Example:
        >>> main(["--ranks", "4", "--rate", "1gbit", "--", "python", "-c", "pass"])  # doctest: +SKIP
        0
    """
    p = parser()
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd and not (args.selfcheck_only or args.teardown):
        p.error("no command given (put it after --)")
    try:
        rate = parse_rate(args.rate)
        delay, jitter = parse_ms(args.delay), parse_ms(args.jitter)
        schedule = [c for s in args.straggler_link for c in LinkChange.parse(s, rate)]
        compute = ",".join(args.straggler_compute)
        Straggler.parse(compute)  # validate before anything starts
    except ValueError as exc:
        p.error(str(exc))
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    if args.attempts < 1:
        p.error("--attempts must be at least 1")
    if bad := [c.describe() for c in schedule if not 0 <= c.rank < args.ranks]:
        p.error(f"--straggler-link: {bad[0]}, but the ranks are 0..{args.ranks - 1}")
    deadline = time.monotonic() + args.timeout if args.timeout else None
    for sig in (signal.SIGTERM, signal.SIGHUP):  # end like Ctrl-C: finally clauses tear down
        signal.signal(sig, _interrupt)
    env = {"COMMLIB_STRAGGLER_COMPUTE": compute} if compute else {}
    try:
        if args.teardown:
            why = available()
            if why:
                _say(f"nothing to tear down: {why}")
                return 0
            Cluster(1, rate, prefix=args.prefix).teardown()
            _say(f"removed everything with prefix {args.prefix!r}")
            return 0
        why = "--unshaped" if args.unshaped else available()
        if why:
            return _unshaped(args, cmd, why, env, deadline)
        return _shaped(args, cmd, rate, delay, jitter, schedule, env, deadline)
    except (ClusterUnavailable, ClusterBusy, ValueError) as exc:
        _say(f"cannot build the cluster: {exc}")
        return 2
    except RuntimeError as exc:  # an ip/tc command failed; everything made is torn down
        _say(f"failed: {exc}")
        return 2
    except KeyboardInterrupt as exc:
        _say(f"interrupted ({str(exc) or 'SIGINT'}); every rank killed, everything torn down")
        return 130


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _selfcheck(args: argparse.Namespace, cluster: Cluster | None, tmp: str,
               deadline: float | None) -> tuple[int, dict[str, Any] | None]:
    out = os.path.join(tmp, "selfcheck.json")
    entry = "import sys; from benchmarks.cluster.selfcheck import main; sys.exit(main())"
    cmd = [sys.executable, "-c", entry, "--json", out,
           "--tolerance", str(args.tolerance), "--iters", str(args.iters),
           "--attempts", str(args.attempts)]
    if args.sizes:
        cmd += ["--sizes", args.sizes]
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    left = _left(deadline)
    rc = run_ranks(cmd, args.ranks, cluster, timeout=min(left or 600.0, 600.0),
                   env={"PYTHONPATH": pythonpath})
    if rc == 124 and (left is None or left > 600):
        _say("the self-check hung for 600 s")
    res = None
    if rc == 0 and os.path.exists(out):
        with open(out) as f:
            res = json.load(f)
    return rc, res


def _unshaped(args: argparse.Namespace, cmd: list[str], why: str, env: dict[str, str],
              deadline: float | None) -> int:
    _say(f"NOT SHAPED: {why}. Running {args.ranks} plain ranks under mpiexec, on this host's "
         "shared memory and loopback; every figure of this run is marked unshaped "
         "(COMMLIB_CLUSTER_SHAPED=0)")
    ignored = [f for f, on in (("--delay", parse_ms(args.delay)), ("--jitter", parse_ms(args.jitter)),
                               ("--straggler-link", args.straggler_link)) if on]
    if ignored:
        _say(f"ignored without namespaces: {', '.join(ignored)}")
    with tempfile.TemporaryDirectory(prefix="commlib-cluster-") as tmp:
        try:
            if args.selfcheck_only:
                return _selfcheck(args, None, tmp, deadline)[0]
            return run_ranks(cmd, args.ranks, None, timeout=_left(deadline), env=env)
        except TimeoutError:
            _say("--timeout reached")
            return 124


def _shaped(args: argparse.Namespace, cmd: list[str], rate: float, delay: float, jitter: float,
            schedule: list[LinkChange], env: dict[str, str], deadline: float | None) -> int:
    tbf = tbf_params(rate, burst=args.burst)
    built = False
    try:
        with tempfile.TemporaryDirectory(prefix="commlib-cluster-") as tmp, \
                Cluster(args.ranks, rate, delay, jitter, args.prefix, burst=args.burst,
                        netem=any(c.delay_ms is not None for c in schedule)) as cluster:
            built = True
            _say(f"{args.ranks} ranks in namespaces {cluster.ns(0)}..{cluster.ns(args.ranks - 1)} "
                 f"({SUBNET}.1-{args.ranks}) on bridge {cluster.bridge}; every link "
                 f"{rate / 1e9:g} Gbit/s each way (tbf burst {tbf['burst']} B, limit "
                 f"{tbf['limit']} B, mtu {cluster.mtu})"
                 + (f", delay {delay:g} ms, jitter {jitter:g} ms" if delay or jitter else ""))
            if not args.no_selfcheck:
                rc, res = _selfcheck(args, cluster, tmp, deadline)
                if rc == 124:
                    return 124
                if rc != 0 or res is None:
                    _say("self-check failed: refusing to run the command, no figures")
                    return 3 if rc in (0, 3) else rc
                env["COMMLIB_CLUSTER_SELFCHECK"] = json.dumps(
                    {k: v for k, v in res.items() if k != "table"})
                if args.selfcheck_only:
                    return 0
            with LinkController(cluster, schedule, os.path.join(tmp, "control")) as ctl:
                return run_ranks(cmd, args.ranks, cluster, timeout=_left(deadline),
                                 env={**env, **ctl.env()})
    except TimeoutError:
        _say("--timeout reached")
        return 124
    finally:
        if built:
            _say(f"torn down: namespaces {args.prefix}*, links and bridge removed")


if __name__ == "__main__":
    sys.exit(main())
