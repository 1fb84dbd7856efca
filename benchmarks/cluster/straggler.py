"""Compute stragglers, injected inside the ranks on a step schedule.

The launcher's ``--straggler-compute RANK:SECONDS:START:STOP`` sets
``COMMLIB_STRAGGLER_COMPUTE``; a training loop calls ``maybe_delay(step)``
once per step and the chosen rank sleeps ``SECONDS`` extra in steps
``START <= step < STOP``.  (Link stragglers are the launcher's job:
``--straggler-link RANK:SLOWDOWN:AT_S[:UNTIL_S]`` lowers that rank's link rate.)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Straggler:
    """Rank ``rank`` takes ``seconds`` longer per step in ``[start, stop)``.

    Example:
        >>> s = Straggler.parse("1:0.05:10:60")
        >>> s.delay_for(rank=1, step=20), s.delay_for(rank=0, step=20)
        (0.05, 0.0)
    """

    rank: int
    seconds: float
    start: int = 0
    stop: int = 2**62

    @classmethod
    def parse(cls, text: str) -> Straggler:
        parts = text.split(":")
        if not 2 <= len(parts) <= 4:
            raise ValueError(f"straggler {text!r}: expected RANK:SECONDS[:START[:STOP]]")
        rank, seconds = int(parts[0]), float(parts[1])
        start = int(parts[2]) if len(parts) > 2 else 0
        stop = int(parts[3]) if len(parts) > 3 else 2**62
        return cls(rank, seconds, start, stop)

    @classmethod
    def from_env(cls) -> Straggler | None:
        raw = os.environ.get("COMMLIB_STRAGGLER_COMPUTE")
        return cls.parse(raw) if raw else None

    def delay_for(self, rank: int, step: int) -> float:
        return self.seconds if rank == self.rank and self.start <= step < self.stop else 0.0

    def maybe_delay(self, rank: int, step: int) -> float:
        """Sleep this rank's extra time for ``step``; return it."""
        d = self.delay_for(rank, step)
        if d:
            time.sleep(d)
        return d
