"""Jobs where one rank's program reaches its end apart from its peers, run by
tests/test_comm_exit.py under ``mpiexec``: one raises with a second communicator open, one
closes after its peers gave up waiting.  Every rank writes ``DIR/ok.RANK`` when its checks
passed.

Usage: mpiexec -n 2 python tests/jobs/ends.py CASE DIR
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import numpy as np
from mpi4py import MPI

import commlib


def ok() -> None:
    with open(os.path.join(sys.argv[2], f"ok.{MPI.COMM_WORLD.rank}"), "w") as f:
        f.write(sys.argv[1])


def raised_with_a_split() -> None:
    """Rank 1 raises at its third step with a split of the world open (SyncBatchNorm's,
    stop_together's, a jitted path's): its exit closes the split first, and waited there, for
    the others' close, the whole timeout while they waited for it in the world's all-reduce.
    Now every rank shows itself closing at once: the others fail at once, naming it."""
    c = commlib.init(comm=MPI.COMM_WORLD, timeout=60)
    side = c.split(0)
    side.allreduce(np.ones(2))
    for step in range(3):
        if step == 2 and c.rank == 1:
            ok()
            raise RuntimeError("rank 1's step failed")
        t0 = time.monotonic()
        try:
            c.allreduce(np.ones(4))
        except commlib.MismatchError as exc:
            assert step == 2 and "rank 1 closed the communicator after #2" in str(exc), exc
            assert time.monotonic() - t0 < 30, "must not wait for the timeout"
            break
    ok()
    until = time.monotonic() + 10       # every rank reports before this one's exit ends the job
    while time.monotonic() < until and not all(
            os.path.exists(os.path.join(sys.argv[2], f"ok.{r}")) for r in range(c.size) if r != 1):
        time.sleep(0.01)
    sys.exit(0)


def closed_after_the_timeout() -> None:
    """Rank 0 closes a communicator 3 s after its peers, whose close gives up after its 1 s
    timeout (a last checkpoint or evaluation on rank 0): every rank's close returns, the peers
    warn that nothing was freed, and the world communicator goes on.  Rank 0 waited in the
    collective frees for good: its peers' slots read closing.  (1.5 s was too close: with 3 ranks
    on 2 cores beside another test worker a peer reached its close late and had not given up.)"""
    c = commlib.init(comm=MPI.COMM_WORLD, timeout=60)
    side = c.split(0)
    side.timeout = 1.0
    side.allreduce(np.ones(2))
    if c.rank == 0:
        time.sleep(3.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        side.close()
        took = time.monotonic() - t0
    gave_up = [str(w.message) for w in seen if issubclass(w.category, commlib.CommStallWarning)]
    if c.rank == 0:
        assert took < 0.5 and not gave_up, (took, gave_up)
    else:
        assert 0.9 < took < 2.5, took
        assert len(gave_up) == 1 and "gave up closing" in gave_up[0], gave_up
    np.testing.assert_array_equal(c.allreduce(np.ones(3)), np.full(3, c.size))
    ok()
    c.close()


CASES = {f.__name__: f for f in (raised_with_a_split, closed_after_the_timeout)}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
