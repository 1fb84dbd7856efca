"""Stragglers, seen from inside the ranks.

Compute stragglers: the launcher's ``--straggler-compute RANK:SECONDS[:START[:STOP]]``
(repeatable) sets ``COMMLIB_STRAGGLER_COMPUTE``; a training loop makes one
:class:`Straggler` (``Straggler.from_env()``) and calls ``maybe_delay(step)`` once
per step, and the chosen rank sleeps ``SECONDS`` extra in steps ``START <= step < STOP``.

Link stragglers are the launcher's (it owns ``tc``): on a time schedule
(``--straggler-link``, see :mod:`.control`), or on request from a rank, at a
step, through :func:`request_link` (``COMMLIB_CLUSTER_CONTROL``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

NEVER = 2**62


def my_rank() -> int:
    """This process's rank from the launcher's environment (``COMMLIB_CLUSTER_RANK``, ``PMI_RANK``).

    Example:
        >>> isinstance(my_rank(), int)
        True
    """
    for key in ("COMMLIB_CLUSTER_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


@dataclass(frozen=True)
class ComputeDelay:
    """One compute straggler: rank ``rank`` takes ``seconds`` longer per step in ``[start, stop)``.

    Example:
        >>> s = ComputeDelay.parse("1:0.05:10:60")
        >>> s.delay_for(step=20, rank=1), s.delay_for(step=20, rank=0), s.delay_for(step=60, rank=1)
        (0.05, 0.0, 0.0)
    """

    rank: int
    seconds: float
    start: int = 0
    stop: int = NEVER

    @classmethod
    def parse(cls, text: str) -> ComputeDelay:
        """``RANK:SECONDS[:START[:STOP]]``.

        Example:
            >>> ComputeDelay.parse("2:0.1:5")
            ComputeDelay(rank=2, seconds=0.1, start=5, stop=4611686018427387904)
        """
        parts = text.strip().split(":")
        if not 2 <= len(parts) <= 4:
            raise ValueError(f"straggler {text!r}: expected RANK:SECONDS[:START[:STOP]]")
        try:
            s = cls(int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) > 2 else 0,
                    int(parts[3]) if len(parts) > 3 else NEVER)
        except ValueError:
            raise ValueError(f"straggler {text!r}: expected RANK:SECONDS[:START[:STOP]]") from None
        if s.rank < 0 or s.seconds < 0 or s.stop < s.start:
            raise ValueError(f"straggler {text!r}: negative rank or seconds, or STOP < START")
        return s

    def delay_for(self, step: int, rank: int | None = None) -> float:
        """Extra seconds for ``rank`` (default: this process's) at ``step``.

        Example:
            >>> ComputeDelay(1, 0.5, 10, 20).delay_for(step=10, rank=1)
            0.5
        """
        rank = my_rank() if rank is None else rank
        return self.seconds if rank == self.rank and self.start <= step < self.stop else 0.0


class Straggler:
    """The compute stragglers of a run (``COMMLIB_STRAGGLER_COMPUTE``: comma-separated specs).

    Example:
        >>> s = Straggler.parse("1:0.05:10:20,3:0.2")
        >>> s.delay_for(step=15, rank=1), s.delay_for(step=0, rank=3), s.delay_for(step=15, rank=0)
        (0.05, 0.2, 0.0)
        >>> Straggler.from_env().maybe_delay(step=3)   # doctest: +SKIP
        0.0
    """

    def __init__(self, delays: list[ComputeDelay] | None = None) -> None:
        self.delays = list(delays or [])

    @classmethod
    def parse(cls, text: str) -> Straggler:
        """Comma-separated ``RANK:SECONDS[:START[:STOP]]`` specs.

        Example:
            >>> len(Straggler.parse("1:0.05,2:0.1:5:9").delays)
            2
        """
        return cls([ComputeDelay.parse(t) for t in text.split(",") if t.strip()])

    @classmethod
    def from_env(cls) -> Straggler:
        """What the launcher set (none when ``COMMLIB_STRAGGLER_COMPUTE`` is unset).

        Example:
            >>> bool(Straggler.from_env()) == bool(os.environ.get("COMMLIB_STRAGGLER_COMPUTE"))
            True
        """
        return cls.parse(os.environ.get("COMMLIB_STRAGGLER_COMPUTE", ""))

    def __repr__(self) -> str:
        return f"Straggler({self.delays!r})"

    def __bool__(self) -> bool:
        return bool(self.delays)

    def delay_for(self, step: int, rank: int | None = None) -> float:
        """Total extra seconds for ``rank`` (default: this process's) at ``step``.

        Example:
            >>> Straggler.parse("1:0.05,1:0.1:5").delay_for(step=7, rank=1)
            0.15000000000000002
        """
        rank = my_rank() if rank is None else rank
        return sum(s.delay_for(step, rank) for s in self.delays)

    def maybe_delay(self, step: int, rank: int | None = None) -> float:
        """Sleep this rank's extra time for ``step``; return it (0.0 for most ranks and steps).

        Example:
            >>> Straggler.parse("3:0.01").maybe_delay(step=0, rank=1)
            0.0
        """
        d = self.delay_for(step, rank)
        if d > 0:
            time.sleep(d)
        return d


def request_link(rank: int, rate_bps: float | None = None, delay_ms: float | None = None,
                 timeout: float = 10.0) -> bool:
    """Ask the launcher to change ``rank``'s link now; ``None`` restores the configured value.

    Blocks until the change is applied.  Returns ``False`` (and changes
    nothing) on unshaped ranks; raises ``RuntimeError`` when the launcher
    refuses (e.g. a delay without netem) or does not answer in ``timeout`` s.

    Example:
        >>> if step == 100 and comm.rank == 0:                 # doctest: +SKIP
        ...     request_link(2, rate_bps=250e6)   # rank 2's link becomes 4x slower
        >>> request_link(2)                                      # doctest: +SKIP
        True
    """
    ctl = os.environ.get("COMMLIB_CLUSTER_CONTROL")
    if not ctl or os.environ.get("COMMLIB_CLUSTER_SHAPED") != "1":
        return False
    name = f"req-{os.getpid()}-{time.monotonic_ns()}"
    tmp = os.path.join(ctl, f".{name}")
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "rate_bps": rate_bps, "delay_ms": delay_ms}, f)
    os.rename(tmp, os.path.join(ctl, f"{name}.json"))  # the launcher sees it whole or not at all
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for suffix in (".ok", ".err"):
            path = os.path.join(ctl, name + suffix)
            if os.path.exists(path):
                with open(path) as f:
                    msg = f.read()
                os.unlink(path)
                if suffix == ".err":
                    raise RuntimeError(f"link change for rank {rank} refused: {msg}")
                return True
        time.sleep(0.002)
    raise RuntimeError(f"link change for rank {rank}: no answer from the launcher in {timeout} s")
