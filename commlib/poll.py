"""Waiting for a posted operation: poll, yield the core, back off, check peers now and then."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

#: how often a waiting rank looks at the status board and the clock's deadline
CHECK_EVERY_S = 0.002
#: the longest sleep between polls once a wait backs off
MAX_NAP_S = 1e-3


def poll_until(test: Callable[[], bool], spin: float, check: Callable[..., None],
               args: tuple = ()) -> None:
    """Call ``test()`` until it returns true.

    For ``spin`` seconds the loop polls flat out, yielding the core every 8
    polls (ranks may share cores) and reading the clock only every 32 polls,
    so that polling costs what a blocking MPI call costs (MPI's own wait loop
    polls and yields the same way).  After that it sleeps between polls,
    doubling from 20 us to 1 ms, for device-stream operations whose progress
    does not need the host (NCCL); MPI waits pass ``spin=math.inf``.
    ``check(now, *args)`` runs every :data:`CHECK_EVERY_S` and may raise to give up
    (its arguments travel separately, so a wait that ends early builds no closure).

    Example:
        >>> import time
        >>> t_end = time.monotonic() + 0.01
        >>> poll_until(lambda: time.monotonic() > t_end, spin=0.001, check=lambda now: None)
    """
    if test():
        return
    now = time.monotonic()
    look = now + CHECK_EVERY_S
    relax = now + spin if spin < math.inf else math.inf
    nap = 0.0
    yield_ = os.sched_yield
    while True:
        if nap:
            if test():
                return
            time.sleep(nap)
        else:
            for i in range(32):
                if test():
                    return
                if i & 7 == 7:
                    yield_()
        now = time.monotonic()
        if now >= relax:
            nap = min(2 * nap or 2e-5, MAX_NAP_S)
        if now >= look:
            look = now + CHECK_EVERY_S
            check(now, *args)
