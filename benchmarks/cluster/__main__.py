"""CLI: ``python -m benchmarks.cluster --ranks 4 --rate 1gbit [options] -- COMMAND ...``.

Builds the namespaces, runs the self-check (unless ``--no-selfcheck``), runs
COMMAND as the ranks, and tears everything down, also on Ctrl-C, failure or
timeout.  Where namespaces cannot be made, it says so and runs COMMAND as
plain unshaped ranks (``COMMLIB_CLUSTER_SHAPED=0``).
"""

from __future__ import annotations

import argparse
import signal
import sys

from .launch import run_ranks
from .netns import Cluster, ClusterUnavailable, available, parse_rate
from .straggler import Straggler


def _link_schedule(specs: list[str], rate: float) -> list[tuple[float, int, float]]:
    """``RANK:SLOWDOWN:AT_S[:UNTIL_S]`` -> (time, rank, rate) changes of the link rate."""
    out = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (3, 4):
            raise SystemExit(f"--straggler-link {spec!r}: expected RANK:SLOWDOWN:AT_S[:UNTIL_S]")
        rank, slowdown, at = int(parts[0]), float(parts[1]), float(parts[2])
        out.append((at, rank, rate / slowdown))
        if len(parts) == 4:
            out.append((float(parts[3]), rank, rate))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="link rate, e.g. 1gbit, 500mbit")
    p.add_argument("--delay", type=float, default=0.0, help="one-way link delay, ms")
    p.add_argument("--jitter", type=float, default=0.0, help="delay jitter, ms")
    p.add_argument("--timeout", type=float, default=None, help="kill the ranks after this many s")
    p.add_argument("--no-selfcheck", action="store_true")
    p.add_argument("--straggler-link", action="append", default=[],
                   metavar="RANK:SLOWDOWN:AT_S[:UNTIL_S]",
                   help="divide RANK's link rate by SLOWDOWN from AT_S (until UNTIL_S) seconds")
    p.add_argument("--straggler-compute", metavar="RANK:SECONDS[:START[:STOP]]",
                   help="sets COMMLIB_STRAGGLER_COMPUTE for the ranks")
    p.add_argument("--prefix", default="cl", help="name prefix of namespaces and links")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command given (put it after --)")
    if args.straggler_compute:
        Straggler.parse(args.straggler_compute)  # validate before anything starts
        import os
        os.environ["COMMLIB_STRAGGLER_COMPUTE"] = args.straggler_compute
    rate = parse_rate(args.rate)
    schedule = _link_schedule(args.straggler_link, rate)
    # SIGTERM ends like Ctrl-C, so the finally clauses tear the cluster down
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    why = available()
    if why:
        print(f"cluster: cannot create network namespaces ({why}); running {args.ranks} UNSHAPED "
              "ranks: every figure is marked unshaped", file=sys.stderr)
        return run_ranks(cmd, args.ranks, None, args.timeout)
    try:
        with Cluster(args.ranks, rate, args.delay, args.jitter, args.prefix) as cluster:
            print(f"cluster: {args.ranks} ranks in namespaces {args.prefix}0..{args.prefix}"
                  f"{args.ranks - 1}, links {rate / 1e9:g} Gbit/s, delay {args.delay} ms",
                  file=sys.stderr, flush=True)
            if not args.no_selfcheck:
                check = "from benchmarks.cluster.selfcheck import main; main()"
                rc = run_ranks([sys.executable, "-c", check], args.ranks, cluster, timeout=120)
                if rc != 0:
                    print("cluster: self-check failed; no figures will be reported", file=sys.stderr)
                    return rc
            return run_ranks(cmd, args.ranks, cluster, args.timeout, schedule)
    except ClusterUnavailable as exc:  # pragma: no cover - raced with available()
        print(f"cluster: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cluster: interrupted; torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
