"""Sync-Switch policies: when to train synchronously (BSP) and when asynchronously (ASP/SSP).

Sync-Switch (arXiv 2104.08364) trains with BSP first and ASP after, and
switches online while a straggler lasts.  A policy answers, per step and the
same on every rank, which protocol the step uses, and which hyperparameter
changes go with a switch.  :class:`collectives.syncswitch.SyncSwitch` asks it.

* :class:`OfflinePolicy`: BSP for the first fraction ``p`` of ``total_steps``,
  then the asynchronous protocol, scaling the learning rate by ``lr_scale``
  and keeping, resetting or ramping (0 -> 1 over ``ramp_steps``) momentum.
* :class:`StragglerPolicy`: each rank records its compute time per step (not
  the time blocked in communication, which BSP makes equal everywhere).
  Every ``window_k`` steps, in BSP, the ranks' mean times are all-gathered
  (one allgather of one float64 per rank); a rank slower than ``theta`` times
  the median for ``m_windows`` consecutive windows is a straggler, and the
  next step runs asynchronously.  While asynchronous, ranks run at their own
  pace, so a collective would make the fast ones wait for the straggler: each
  rank *publishes* its window mean in the parameter store's board (one-sided)
  and rank 0 judges; after ``m_windows`` of its windows without a straggler it
  posts a command that every rank reads at its next window end, and all
  switch back to BSP together.  Decisions go to :attr:`log` (dicts) and to
  the timeline (``comm.tracer.instant("syncswitch.decision", ...)``).
* :func:`find_bsp_fraction`: the offline ``p`` for a recurring job, by binary
  search over short runs.

Every policy keeps all its state in ``state_dict()`` / ``load_state_dict()``.
Settings are checked at construction (integers are integers, scales finite
and positive), and ``repr(policy)`` shows every one (:meth:`Policy.config`):
bindings compare the strategy's repr, with its policy's, over the ranks when
they wrap the optimizer, so that ranks given different settings fail there.

Example:
    >>> pol = OfflinePolicy(bsp_fraction=0.25, total_steps=1000, lr_scale=0.5, momentum="reset")
    >>> pol.phase(0), pol.phase(250)
    ('bsp', 'asp')
    >>> pol.changes("bsp", "asp", 250)
    {'lr_scale': 0.5, 'momentum': 'reset', 'momentum_scale': 1.0}
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from commlib import Communicator

from .checks import check_choice, check_int, check_real

PHASES = ("bsp", "asp", "ssp")
MOMENTUM_MODES = ("keep", "reset", "ramp")
ASYNC_PHASES = ("asp", "ssp")


def _positive_finite(v: float) -> bool:
    return 0.0 < v < math.inf


class Policy:
    """Base: ``phase(step)`` for the step about to run; ``observe(step, seconds, phase)`` after it.

    ``observe`` returns the phase to switch to (or None); it may run a small
    collective (all ranks call it at the same step while in BSP).
    """

    name = "policy"
    #: a switch may reset or scale the momentum (``changes`` and ``momentum_scale`` say how)
    changes_momentum = False

    def __init__(self) -> None:
        self.log: list[dict[str, Any]] = []
        self.comm: Communicator | None = None     # unbound: one rank, no trace
        self.board: Any = None

    def bind(self, comm: Communicator, board: Any = None) -> None:
        """Give the policy the communicator (and the store whose board it may use)."""
        self.comm, self.board = comm, board

    def config(self) -> dict[str, Any]:
        """The settings the policy was made with, as :meth:`__repr__` shows them.

        A policy whose decisions depend on settings returns every one of them: bindings compare
        ``repr(strategy)`` (a :class:`~collectives.syncswitch.SyncSwitch` shows its policy's repr)
        over the ranks when they wrap the optimizer, so that ranks given different settings fail
        there, on every rank, instead of meeting different collectives at a switch.
        """
        return {}

    def __repr__(self) -> str:
        # deterministic (no object ids; floats by repr): the same text for the same settings in every process
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"

    def phase(self, step: int) -> str:
        raise NotImplementedError

    def observe(self, step: int, seconds: float, phase: str) -> str | None:
        return None

    def switched(self, old: str, new: str, step: int) -> None:
        """Told after every switch (on every rank): windows restart, so that ranks stay aligned."""

    def changes(self, old: str, new: str, step: int) -> dict[str, Any]:
        """Hyperparameter changes at a switch (``lr_scale``, ``momentum``, ``momentum_scale``)."""
        return {}

    def momentum_scale(self, step: int) -> float:
        """Factor on the momentum coefficient at ``step`` (ramps after a switch)."""
        return 1.0

    def _emit(self, event: str, **args: Any) -> None:
        rec = {"event": event, **args}
        self.log.append(rec)
        if self.comm is not None:
            self.comm.tracer.instant("syncswitch." + event, **{k: _plain(v) for k, v in args.items()})

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "log": [dict(r) for r in self.log]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state of policy {state.get('name')!r} given to {self.name!r}")
        self.log = [dict(r) for r in state["log"]]


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


class OfflinePolicy(Policy):
    """BSP for the first ``bsp_fraction`` of ``total_steps``, then ``async_phase`` ("asp" or "ssp").

    At the switch the learning rate is multiplied by ``lr_scale`` (the
    authors scale it down: ASP applies one worker's gradient at a time where
    BSP applied the average of n), and momentum is kept, reset (the
    binding zeroes its buffers) or ramped: its coefficient is multiplied by
    ``min(1, (step - switch) / ramp_steps)``.

    Example:
        >>> pol = OfflinePolicy(0.5, 100, momentum="ramp", ramp_steps=10)
        >>> pol.switch_step, pol.momentum_scale(55)
        (50, 0.5)
        >>> repr(pol)[:49]
        'OfflinePolicy(bsp_fraction=0.5, total_steps=100, '
    """

    name = "offline"

    def __init__(self, bsp_fraction: float, total_steps: int, lr_scale: float = 1.0,
                 momentum: str = "keep", ramp_steps: int = 100, async_phase: str = "asp"):
        super().__init__()
        where = "OfflinePolicy"
        self.bsp_fraction = check_real(where, "bsp_fraction", bsp_fraction, "a fraction in 0..1",
                                       lambda v: 0.0 <= v <= 1.0)
        self.total_steps = check_int(where, "total_steps", total_steps, 0)
        self.lr_scale = check_real(where, "lr_scale", lr_scale, "a finite number > 0", _positive_finite)
        self.momentum = check_choice(where, "momentum", momentum, MOMENTUM_MODES)
        self.ramp_steps = check_int(where, "ramp_steps", ramp_steps, 1)
        self.async_phase = check_choice(where, "async_phase", async_phase, ASYNC_PHASES)

    def config(self) -> dict[str, Any]:
        return {"bsp_fraction": self.bsp_fraction, "total_steps": self.total_steps, "lr_scale": self.lr_scale,
                "momentum": self.momentum, "ramp_steps": self.ramp_steps, "async_phase": self.async_phase}

    @property
    def changes_momentum(self) -> bool:      # type: ignore[override]
        return self.momentum != "keep"

    @property
    def switch_step(self) -> int:
        return int(round(self.bsp_fraction * self.total_steps))

    def phase(self, step: int) -> str:
        # bsp_fraction 1: BSP throughout (find_bsp_fraction's baseline), also past total_steps (it
        # switched after the last step: a store opened, the momentum reset, for nothing)
        return "bsp" if step < self.switch_step or self.bsp_fraction >= 1.0 else self.async_phase

    def changes(self, old: str, new: str, step: int) -> dict[str, Any]:
        if old == "bsp" and new != "bsp":
            return {"lr_scale": self.lr_scale, "momentum": self.momentum,
                    "momentum_scale": self.momentum_scale(step)}
        return {"lr_scale": 1.0, "momentum": "keep", "momentum_scale": 1.0}

    def momentum_scale(self, step: int) -> float:
        if self.momentum != "ramp" or step < self.switch_step:
            return 1.0
        return min(1.0, (step - self.switch_step) / self.ramp_steps)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "bsp_fraction": self.bsp_fraction, "total_steps": self.total_steps,
                "lr_scale": self.lr_scale, "momentum": self.momentum, "ramp_steps": self.ramp_steps,
                "async_phase": self.async_phase}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.bsp_fraction = float(state["bsp_fraction"])
        self.total_steps = int(state["total_steps"])
        self.lr_scale = float(state["lr_scale"])
        self.momentum = state["momentum"]
        self.ramp_steps = int(state["ramp_steps"])
        self.async_phase = state["async_phase"]


class SchedulePolicy(Policy):
    """A fixed schedule: ``[(step, phase), ...]``, each phase from its step on (pure BSP, ASP, SSP, tests).

    Example:
        >>> pol = SchedulePolicy([(0, "bsp"), (5, "asp"), (9, "bsp")])
        >>> [pol.phase(s) for s in (0, 4, 5, 8, 9)]
        ['bsp', 'bsp', 'asp', 'asp', 'bsp']
        >>> SchedulePolicy("ssp").phase(100)
        'ssp'
        >>> SchedulePolicy("asp", lr_scale=0.5)
        SchedulePolicy(schedule=[(0, 'asp')], lr_scale=0.5)

    Steps are integers >= 0, each given once; ``lr_scale`` (finite, > 0)
    multiplies the learning rate in asynchronous phases.
    """

    name = "schedule"

    def __init__(self, schedule: Sequence[tuple[int, str]] | str, lr_scale: float = 1.0):
        super().__init__()
        where = "SchedulePolicy"
        given = schedule
        if isinstance(schedule, str):
            schedule = [(0, schedule)]
        expected = f"(step, phase) pairs, steps integers >= 0 (each once), phases in {PHASES}"
        try:
            pairs = [tuple(x) for x in schedule]
        except TypeError:
            raise TypeError(f"{where}(schedule={given!r}): expected a phase or {expected}") from None
        if not pairs or any(len(x) != 2 for x in pairs):
            raise ValueError(f"{where}(schedule={given!r}): expected a phase or {expected}")
        entries = []
        for s, p in pairs:
            try:
                entries.append((check_int(where, "step", s, 0), check_choice(where, "phase", p, PHASES)))
            except (TypeError, ValueError) as exc:     # named as the schedule's entry
                raise type(exc)(f"{where}(schedule={given!r}): entry {(s, p)!r}: "
                                f"expected {expected}") from None
        steps = [s for s, _ in entries]
        if len(set(steps)) != len(steps):
            raise ValueError(f"{where}(schedule={given!r}): a step given twice; expected {expected}")
        self.schedule = sorted(entries)
        self.lr_scale = check_real(where, "lr_scale", lr_scale, "a finite number > 0", _positive_finite)

    def config(self) -> dict[str, Any]:
        return {"schedule": [tuple(x) for x in self.schedule], "lr_scale": self.lr_scale}

    def phase(self, step: int) -> str:
        cur = "bsp"
        for s, p in self.schedule:
            if s <= step:
                cur = p
        return cur

    def changes(self, old: str, new: str, step: int) -> dict[str, Any]:
        scale = self.lr_scale if new != "bsp" else 1.0
        return {"lr_scale": scale, "momentum": "keep", "momentum_scale": 1.0}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "schedule": [list(x) for x in self.schedule],
                "lr_scale": self.lr_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.schedule = [(int(s), str(p)) for s, p in state["schedule"]]
        self.lr_scale = float(state["lr_scale"])


def judge(means: Sequence[float], theta: float) -> list[int]:
    """Ranks whose mean step time exceeds ``theta`` times the median of all ranks'.

    Example:
        >>> judge([0.1, 0.1, 0.11, 0.4], theta=1.5)
        [3]
    """
    med = statistics.median(means)
    return [r for r, m in enumerate(means) if m > theta * med]


class StragglerPolicy(Policy):
    """Switch to ``async_phase`` while a straggler lasts, back to BSP when it is gone.

    ``theta``: slower than ``theta`` x median is slow.  ``window_k``: steps
    per window (per rank).  ``m_windows``: consecutive slow windows that make
    a straggler, and consecutive clean windows (rank 0's, while asynchronous)
    that end the asynchronous phase.  With two ranks the median is the mean of
    both, so a rank f times slower than the other is flagged when
    ``f > theta (1 + f) / 2``, i.e. ``theta < 2f / (1 + f)`` (< 1.6 for f = 4).

    Example:
        >>> pol = StragglerPolicy(theta=1.5, window_k=10, m_windows=2)
        >>> ss = SyncSwitch(policy=pol)     # doctest: +SKIP
    """

    name = "straggler"

    def __init__(self, theta: float = 1.5, window_k: int = 10, m_windows: int = 2,
                 async_phase: str = "asp"):
        super().__init__()
        where = "StragglerPolicy"
        self.theta = check_real(where, "theta", theta, "a finite number > 1", lambda v: 1.0 < v < math.inf)
        self.window_k = check_int(where, "window_k", window_k, 1)
        self.m_windows = check_int(where, "m_windows", m_windows, 1)
        self.async_phase = check_choice(where, "async_phase", async_phase, ASYNC_PHASES)
        self.current = "bsp"
        self.times: list[float] = []       # this window's step times
        self.slow_counts: list[int] = []   # per rank: consecutive slow windows
        self.clean_windows = 0             # rank 0, asynchronous: consecutive clean windows
        self.windows = 0                   # this rank's completed windows
        self.command = 0                   # return-to-BSP commands posted (rank 0) or seen
        self.applied = 0                   # return-to-BSP commands applied
        self.epochs = 0                    # asynchronous phases begun
        self.stragglers: list[int] = []

    def config(self) -> dict[str, Any]:
        return {"theta": self.theta, "window_k": self.window_k, "m_windows": self.m_windows,
                "async_phase": self.async_phase}

    def phase(self, step: int) -> str:
        return self.current

    def switched(self, old: str, new: str, step: int) -> None:
        # ranks leave an asynchronous phase at different local steps: restart the window
        # everywhere so that BSP windows (and their allgathers) line up again
        self.current = new
        self.times = []

    def observe(self, step: int, seconds: float, phase: str) -> str | None:
        """Record this rank's compute time of ``step``; at a window end decide (see the class doc)."""
        self.current = phase
        self.times.append(float(seconds))
        if len(self.times) < self.window_k:
            return None
        mean = float(np.mean(self.times))
        self.times = []
        self.windows += 1
        if phase == "bsp":
            return self._bsp_window(step, mean)
        return self._async_window(step, mean)

    def _bsp_window(self, step: int, mean: float) -> str | None:
        if self.comm is not None and self.comm.size > 1:
            table = self.comm.allgather(np.array([mean], np.float64), tag="syncswitch.times")
            means = [float(x) for x in np.asarray(table).reshape(-1)]
        else:
            means = [mean]
        if len(self.slow_counts) != len(means):
            self.slow_counts = [0] * len(means)
        slow = set(judge(means, self.theta))
        self.slow_counts = [c + 1 if r in slow else 0 for r, c in enumerate(self.slow_counts)]
        self.stragglers = [r for r, c in enumerate(self.slow_counts) if c >= self.m_windows]
        if self.stragglers:
            self._emit("decision", step=step, switch="bsp->" + self.async_phase, stragglers=self.stragglers,
                       means=means, median=statistics.median(means), theta=self.theta)
            self.slow_counts = [0] * len(means)
            self.clean_windows = 0
            self.epochs += 1
            self.current = self.async_phase
            return self.async_phase
        return None

    def _async_window(self, step: int, mean: float) -> str | None:
        board = self.board
        if board is None:
            raise RuntimeError("StragglerPolicy needs the parameter store's board while asynchronous")
        board.publish([mean, float(self.epochs)])
        if self.comm is None or self.comm.rank == 0:
            table = board.read_board()
            means = [float(m) for m in table[:, 0]]
            # a rank that has not finished a window of this asynchronous phase counts as slow
            fresh = [int(e) == self.epochs for e in table[:, 1]]
            slow = [r for r in range(len(means)) if not fresh[r]]
            if not slow:
                slow = judge(means, self.theta)
            self.clean_windows = 0 if slow else self.clean_windows + 1
            self.stragglers = slow
            if self.clean_windows >= self.m_windows:
                self.command += 1
                board.post_command(float(self.command))
                self._emit("decision", step=step, switch=self.async_phase + "->bsp", means=means,
                           median=statistics.median(means), theta=self.theta, command=self.command)
                self.clean_windows = 0
        seen = int(board.read_command())
        if seen > self.applied:
            self.applied = self.command = seen
            self.current = "bsp"
            self._emit("applied", step=step, switch=self.async_phase + "->bsp", command=seen)
            return "bsp"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "theta": self.theta, "window_k": self.window_k,
                "m_windows": self.m_windows, "async_phase": self.async_phase, "current": self.current,
                "times": list(self.times), "slow_counts": list(self.slow_counts),
                "clean_windows": self.clean_windows, "windows": self.windows, "command": self.command,
                "applied": self.applied, "epochs": self.epochs,
                "stragglers": list(self.stragglers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.theta = float(state["theta"])
        self.window_k = int(state["window_k"])
        self.m_windows = int(state["m_windows"])
        self.async_phase = state["async_phase"]
        self.current = state["current"]
        self.times = [float(t) for t in state["times"]]
        self.slow_counts = [int(c) for c in state["slow_counts"]]
        self.clean_windows = int(state["clean_windows"])
        self.windows = int(state["windows"])
        self.command = int(state["command"])
        self.applied = int(state["applied"])
        self.epochs = int(state["epochs"])
        self.stragglers = [int(r) for r in state["stragglers"]]


@dataclass
class FractionSearch:
    """What :func:`find_bsp_fraction` found: ``p``, the baseline accuracy and every run ``(p, accuracy)``."""

    p: float
    baseline: float
    runs: list[tuple[float, float]] = field(default_factory=list)


def find_bsp_fraction(run_fn: Callable[[float], float],
                      candidates: Sequence[float] = (0.5, 0.25, 0.125, 0.0625),
                      tolerance: float = 0.01) -> FractionSearch:
    """The smallest BSP fraction whose short run reaches BSP's accuracy within ``tolerance``.

    ``run_fn(p)`` trains a short run with BSP for the fraction ``p`` and
    returns its accuracy (``run_fn(1.0)`` is the BSP baseline).  Accuracy is
    assumed to fall as ``p`` falls, so a binary search over the sorted
    candidates needs about ``log2(len(candidates)) + 1`` runs besides the
    baseline.  Returns 1.0 when no candidate is good enough.  ``run_fn`` may
    be collective (every rank calls this with the same arguments and gets the
    same accuracies, e.g. all-reduced).

    Example:
        >>> acc = {1.0: 0.95, 0.5: 0.95, 0.25: 0.945, 0.125: 0.90, 0.0625: 0.85}
        >>> find_bsp_fraction(acc.__getitem__, tolerance=0.01).p
        0.25
    """
    check_real("find_bsp_fraction", "tolerance", tolerance, "a finite number >= 0",
               lambda v: 0.0 <= v < math.inf)
    cands = sorted({float(p) for p in candidates}, reverse=True)
    if not cands or any(not 0.0 <= p <= 1.0 for p in cands):
        raise ValueError(f"candidates {candidates!r}: expected fractions in 0..1")
    result = FractionSearch(p=1.0, baseline=float(run_fn(1.0)))
    result.runs.append((1.0, result.baseline))
    lo, hi = 0, len(cands) - 1            # search the largest index (smallest p) that is good
    best: float | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        acc = float(run_fn(cands[mid]))
        result.runs.append((cands[mid], acc))
        if acc >= result.baseline - tolerance:
            best = cands[mid]
            lo = mid + 1
        else:
            hi = mid - 1
    result.p = 1.0 if best is None else best
    return result
