"""Instructions per call, counted by valgrind: commlib's blocking calls against raw mpi4py's.

A figure that does not scatter.  The per-call overhead in microseconds
(``benchmarks.engine_figures``) moves 2x between runs on a shared VM, and so
do the small-message ratios it drives (4 ranks on 2 cores: each microsecond of
a rank's Python adds two to three to the operation); the number of
instructions a call executes does not move at all.  Each contender runs in a
child process of one rank (``MPI.COMM_SELF``, 16 float32) under
``valgrind --tool=callgrind``, which counts only inside the measured loop
(``--toggle-collect`` on the C function that drives it:
``deque(starmap(call, repeat((), N)), maxlen=0)``), on the calling thread,
with ``PYTHONHASHSEED=0``.  The loop's own cost (calling the C builtin ``int``)
is subtracted, and so is what a run of 0 calls counts (imports that call the
same C function: torch's, once, 140M instructions).  The ``allreduce torch``
row runs commlib's call on CPU torch tensors against mpi4py's on numpy.
Two runs of the same tree give the same figures, or within
0.1 % (a few tens of instructions: addresses differ between processes); a
change that removes work shows up as fewer instructions whatever the
machine's mood.

Example:
    python -m benchmarks.instructions --json instr.json            # 4 operations, 5000 calls each
    python -m benchmarks.instructions --quick                       # allreduce only, 500 calls

Needs ``valgrind`` on PATH (Debian: ``apt install valgrind``); without it the
benchmark says so and exits 0 with no figures, so ``make bench`` goes on.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks import _common as bc

#: the row that needs torch (left out, saying so, where it is not installed)
TORCH_OP = "allreduce torch"
#: operation -> (raw mpi4py call, commlib call), as source run by the child
OPS: dict[str, tuple[str, str]] = {
    "allreduce": ("raw.Allreduce(x, y)", "c.allreduce(x, out=y)"),
    "iallreduce+wait": ("raw.Iallreduce(x, y).Wait()", "c.iallreduce(x, out=y).wait()"),
    "broadcast": ("raw.Bcast(y, 0)", "c.broadcast(y, 0)"),
    "barrier": ("raw.Barrier()", "c.barrier()"),
    # a CPU torch tensor against mpi4py on numpy: what the tensor's path adds (its numpy alias)
    TORCH_OP: ("raw.Allreduce(x, y)", "c.allreduce(tx, out=ty)"),
}
#: the loop's own cost: a C builtin called with no arguments
NOOP = "int()"
_TOGGLE = "deque_extend"     # CPython's C function behind deque(iterable): the measured loop
_COLLECTED = re.compile(r"Collected : (\d+)")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(call: str, calls: int) -> None:
    """Run ``call`` (source, see :data:`OPS`) ``calls`` times inside the measured loop.

    Example:
        >>> child("int()", 10)   # under valgrind, only the loop's instructions are counted
    """
    import collections
    import itertools

    if call == NOOP:        # the loop alone: what the calls run in is not counted (nor waited for)
        collections.deque(itertools.starmap(int, itertools.repeat((), calls)), maxlen=0)
        return
    import numpy as np
    from mpi4py import MPI

    import commlib

    x = np.ones(16, np.float32)
    y = np.empty_like(x)
    raw = MPI.COMM_SELF.Dup()
    c = commlib.init(comm=MPI.COMM_SELF)
    names = {"raw": raw, "c": c, "x": x, "y": y}
    if "tx" in call:
        import torch

        names.update(tx=torch.ones(16), ty=torch.empty(16))
    # a contender's call, a lambda (the baseline, above, is the builtin itself: no lambda frame)
    fn: Callable[[], Any] = eval(f"lambda: {call}", names)  # noqa: S307
    for _ in range(200):        # warm: caches, the allocator, commlib's first-call paths
        fn()
    collections.deque(itertools.starmap(fn, itertools.repeat((), calls)), maxlen=0)
    c.close()
    raw.Free()


def count(call: str, calls: int, valgrind: str) -> int:
    """Instructions valgrind counted inside the measured loop of ``call`` (all ``calls`` calls),
    and wherever else the child's thread ran the loop's C function (an import's
    ``deque(iterable)``): :func:`measure` takes off the count of a run of 0 calls.

    Example:
        >>> count("c.allreduce(x, out=y)", 1000, "valgrind")   # doctest: +SKIP
        33161000
    """
    cmd = [valgrind, "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={_TOGGLE}",
           "--callgrind-out-file=/dev/null", sys.executable, "-m", "benchmarks.instructions",
           "--child", call, "--calls", str(calls)]
    # not the launcher's (under mpiexec: the child would join its PMI job, and fail at MPI_Init)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_"))}
    env["PYTHONHASHSEED"] = "0"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False,
                          cwd=_REPO)      # where ``-m benchmarks.instructions`` is found
    found = _COLLECTED.findall(proc.stderr)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"valgrind run of {call!r} failed (exit {proc.returncode}):\n"
                           + proc.stderr[-2000:])
    return int(found[-1])


def measure(ops: list[str], calls: int, valgrind: str) -> dict[str, Any]:
    """Instructions per call of each op's raw and commlib call, the loop's cost subtracted.

    Example:
        >>> measure(["allreduce"], 500, "valgrind")["rows"][0]["op"]   # doctest: +SKIP
        'allreduce'
    """
    sources = list(dict.fromkeys([NOOP] + [src for op in ops for src in OPS[op]]))
    # each source also with an empty loop: what the child collects outside the calls (an import's
    # own deque(iterable), as torch's, toggles collection on; 140M instructions, once) is taken off
    jobs = [(src, n) for src in sources for n in (calls, 0)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        counted = dict(zip(jobs, pool.map(lambda job: count(job[0], job[1], valgrind), jobs)))
    per_call = {src: (counted[src, calls] - counted[src, 0]) / calls for src in sources}
    loop = per_call[NOOP]
    rows = []
    for op in ops:
        raw_src, ours_src = OPS[op]
        raw, ours = per_call[raw_src] - loop, per_call[ours_src] - loop
        rows.append({"op": op, "mpi4py": raw, "commlib": ours, "overhead": ours - raw,
                     "ratio": ours / raw, "mpi4py_call": raw_src, "commlib_call": ours_src})
    return {"calls": calls, "loop_instructions": loop, "rows": rows}


def report(doc: dict[str, Any]) -> str:
    """The markdown table of :func:`measure`'s rows.

    Example:
        >>> print(report({"calls": 10, "loop_instructions": 900.0, "rows": [{"op": "barrier",
        ...     "mpi4py": 1000.0, "commlib": 9000.0, "overhead": 8000.0, "ratio": 9.0}]}).splitlines()[-1])
        | barrier | 1000 | 9000 | 8000 | 9 |
    """
    head = (f"Instructions per call on one rank (valgrind callgrind, {doc['calls']} calls each, "
            f"16 float32, the loop's {doc['loop_instructions']:.0f} per call subtracted). "
            "Ratio > 1: commlib executes more.")
    rows = [[r["op"], round(r["mpi4py"]), round(r["commlib"]), round(r["overhead"]), round(r["ratio"], 2)]
            for r in doc["rows"]]
    header = ["op", "mpi4py", "commlib", "commlib - mpi4py", "commlib/mpi4py"]
    return head + "\n\n" + bc.markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    """The CLI: measure, print the table, write ``--json``; 0 (also without valgrind: skipped).

    Example:
        >>> main(["--quick"])   # doctest: +SKIP
        0
    """
    p = bc.base_parser("Instructions per call (valgrind): commlib against raw mpi4py, one rank.")
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    p.add_argument("--calls", type=bc.non_negative_int, default=5000,
                   help="calls in each measured loop (5000)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = bc.parse_quick(p, argv, ops=["allreduce"], calls=500)   # given options win over --quick
    if args.child:      # 0 calls: the child's count outside its calls
        child(args.child, args.calls)
        return 0
    if args.calls == 0:
        p.error("--calls must be at least 1")
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("instructions: valgrind is not on PATH (Debian: apt install valgrind); no figures",
              file=sys.stderr)
        return 0
    from mpi4py import MPI

    ops, calls = args.ops, args.calls
    if importlib.util.find_spec("torch") is None and TORCH_OP in ops:
        print(f"instructions: torch is not installed; no {TORCH_OP!r} row", file=sys.stderr)
        ops = [op for op in ops if op != TORCH_OP]
    doc = {"benchmark": "instructions", "environment": bc.environment(MPI.COMM_SELF),
           "valgrind": subprocess.run([valgrind, "--version"], capture_output=True, text=True,
                                      check=False).stdout.strip(),
           **measure(ops, calls, valgrind)}
    bc.publish(args, doc, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
