"""Link stragglers, applied by the launcher while the command runs.

Two ways in, one thread (:class:`LinkController`) that changes ``tc``:

- a schedule, in seconds after the command started:
  ``--straggler-link RANK:CHANGE:AT_S[:UNTIL_S]``, where ``CHANGE`` is ``x4``
  (the configured rate divided by 4), a rate (``250mbit``) or a one-way delay
  (``5ms``, needs ``netem``); at ``UNTIL_S`` the link goes back to the
  configured one;
- requests from the ranks, at a step of their choosing:
  :func:`benchmarks.cluster.straggler.request_link` drops a JSON file into
  the directory ``COMMLIB_CLUSTER_CONTROL``; the thread applies it and answers
  with ``<name>.ok`` or ``<name>.err`` (it polls every 5 ms).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass

from .netns import Cluster, parse_rate


@dataclass(frozen=True)
class LinkChange:
    """At ``at_s`` (after the command started) set ``rank``'s link; ``None`` fields: configured.

    Example:
        >>> slow, back = LinkChange.parse("2:x4:10:20", 1e9)
        >>> slow
        LinkChange(at_s=10.0, rank=2, rate_bps=250000000.0, delay_ms=None)
        >>> back.describe()
        'rank 2 link: back to the configured link'
        >>> LinkChange.parse("1:5ms:3", 1e9)
        [LinkChange(at_s=3.0, rank=1, rate_bps=None, delay_ms=5.0)]
    """

    at_s: float
    rank: int
    rate_bps: float | None = None
    delay_ms: float | None = None

    @classmethod
    def parse(cls, spec: str, rate_bps: float) -> list[LinkChange]:
        """``RANK:CHANGE:AT_S[:UNTIL_S]`` -> the change and, with ``UNTIL_S``, its undoing.

        Example:
            >>> [c.rate_bps for c in LinkChange.parse("0:100mbit:1:2", 1e9)]
            [100000000.0, None]
        """
        usage = (f"--straggler-link {spec!r}: expected RANK:CHANGE:AT_S[:UNTIL_S], CHANGE one "
                 "of x4 (rate / 4), 250mbit (a rate), 5ms (a delay)")
        parts = spec.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(usage)
        try:
            rank, change, at = int(parts[0]), parts[1].strip().lower(), float(parts[2])
            until = float(parts[3]) if len(parts) == 4 else None
            if m := re.fullmatch(r"([0-9.]+)\s*(ms|us|s)", change):
                scale = {"ms": 1.0, "us": 1e-3, "s": 1e3}[m.group(2)]
                first = cls(at, rank, delay_ms=float(m.group(1)) * scale)
            elif change.startswith(("x", "/")):
                first = cls(at, rank, rate_bps=rate_bps / float(change[1:]))
            else:
                first = cls(at, rank, rate_bps=parse_rate(change))
        except (ValueError, ZeroDivisionError):
            raise ValueError(usage) from None
        if until is not None and until <= at:
            raise ValueError(f"{usage}: UNTIL_S must come after AT_S")
        return [first] + ([cls(until, rank)] if until is not None else [])

    def describe(self) -> str:
        """Say what this change does.

        Example:
            >>> LinkChange(1.0, 2, rate_bps=2.5e8).describe()
            'rank 2 link: 250 Mbit/s'
        """
        what = []
        if self.rate_bps is not None:
            what.append(f"{self.rate_bps / 1e6:g} Mbit/s")
        if self.delay_ms is not None:
            what.append(f"delay {self.delay_ms:g} ms")
        return f"rank {self.rank} link: " + (", ".join(what) or "back to the configured link")


class LinkController:
    """Applies a schedule of :class:`LinkChange` and the ranks' requests (a context manager).

    Example:
        >>> with Cluster(4, 1e9) as cl, LinkController(cl, LinkChange.parse("1:x4:2:5", 1e9),
        ...                                            control_dir) as ctl:   # doctest: +SKIP
        ...     run_ranks(cmd, 4, cl, env=ctl.env())
    """

    def __init__(self, cluster: Cluster, schedule: list[LinkChange], control_dir: str,
                 poll_s: float = 0.005) -> None:
        for ch in schedule:
            if not 0 <= ch.rank < cluster.ranks:
                raise ValueError(f"{ch.describe()}: the cluster has ranks 0..{cluster.ranks - 1}")
        self.cluster = cluster
        self.schedule = sorted(schedule, key=lambda c: c.at_s)
        self.control_dir = control_dir
        self.poll_s = poll_s
        self.applied: list[tuple[float, LinkChange]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cluster-links", daemon=True)
        self._t0 = 0.0

    def env(self) -> dict[str, str]:
        """What the ranks need to send requests: ``COMMLIB_CLUSTER_CONTROL``.

        Example:
            >>> ctl.env()   # doctest: +SKIP
            {'COMMLIB_CLUSTER_CONTROL': '/tmp/commlib-cluster-x1y2/control'}
        """
        return {"COMMLIB_CLUSTER_CONTROL": self.control_dir}

    def __enter__(self) -> LinkController:
        os.makedirs(self.control_dir, exist_ok=True)
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _apply(self, change: LinkChange) -> None:
        self.cluster.set_link(change.rank, rate_bps=change.rate_bps, delay_ms=change.delay_ms)
        t = time.monotonic() - self._t0
        self.applied.append((t, change))
        print(f"cluster: t={t:.2f}s {change.describe()}", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        todo = list(self.schedule)
        while not self._stop.is_set():
            now = time.monotonic() - self._t0
            while todo and todo[0].at_s <= now:
                change = todo.pop(0)
                try:
                    self._apply(change)
                except Exception as exc:  # report, keep serving: the command decides its fate
                    self.errors.append(f"{change.describe()}: {exc}")
                    print(f"cluster: {change.describe()} FAILED: {exc}", file=sys.stderr, flush=True)
            self._serve_requests()
            self._stop.wait(self.poll_s)

    def _serve_requests(self) -> None:
        try:
            names = sorted(n for n in os.listdir(self.control_dir)
                           if n.startswith("req-") and n.endswith(".json"))
        except OSError:
            return
        for name in names:
            path = os.path.join(self.control_dir, name)
            base = path[: -len(".json")]
            try:
                try:
                    with open(path) as f:
                        req = json.load(f)
                finally:
                    os.unlink(path)
                self._apply(LinkChange(time.monotonic() - self._t0, int(req["rank"]),
                                       req.get("rate_bps"), req.get("delay_ms")))
                answer, text = ".ok", "applied"
            except Exception as exc:  # the requesting rank raises it
                answer, text = ".err", str(exc)
                self.errors.append(f"request {name}: {exc}")
            with open(base + answer + ".tmp", "w") as f:
                f.write(text)
            os.rename(base + answer + ".tmp", base + answer)
