"""Online tuning of the bucket cap by Bayesian optimisation (as DeAR and Horovod's autotune do).

Rank 0 fits a Gaussian process to (log2 cap, step time) and proposes the next
cap by expected improvement (the ``bayesian-optimization`` package); every
rank gets the proposal by one small broadcast at the end of a trial window,
so all ranks re-plan their buckets at the same step.  A trial skips its first
steps after a re-plan (allocation, first-touch), then averages ``window``
step times.  The user's cap is the first trial; after ``trials`` trials the
best cap is kept for the rest of training.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from commlib import Communicator

from .buckets import MiB


def _bayes_opt() -> tuple[Any, Any]:
    """``bayes_opt``'s optimizer class and acquisition module, or a clear ImportError."""
    try:
        from bayes_opt import BayesianOptimization, acquisition
    except ImportError as exc:
        raise ImportError("bucket-cap tuning needs the 'bayesian-optimization' package "
                          "(pip install commlib[tune])") from exc
    return BayesianOptimization, acquisition


class CapTuner:
    """Search the bucket cap in ``[low_mb, high_mb]`` MiB over ``trials`` trials of ``window`` steps.

    ``observe(step_seconds)`` is called by the binding after every step on
    every rank and returns a new cap in bytes when the buckets must be
    re-planned, else ``None``.

    Example:
        >>> tuner = CapTuner(comm, first_cap_bytes=25 << 20, trials=10, window=5)
        >>> new = tuner.observe(0.31)      # after each step; None while a trial runs
    """

    def __init__(self, comm: Communicator, first_cap_bytes: int, low_mb: float = 1.0, high_mb: float = 256.0,
                 trials: int = 10, window: int = 5, skip: int = 1, seed: int = 0):
        if not 0 < low_mb < high_mb:
            raise ValueError(f"cap range [{low_mb}, {high_mb}] MiB: expected 0 < low < high")
        if trials < 1 or window < 1 or skip < 0:
            raise ValueError("trials and window must be >= 1, skip >= 0")
        self.comm = comm
        self.bounds = (math.log2(low_mb), math.log2(high_mb))
        self.trials, self.window, self.skip, self.seed = trials, window, skip, seed
        self.cap = int(first_cap_bytes)
        self.history: list[tuple[int, float]] = []     # (cap bytes, mean step seconds)
        self.done = False
        self._times: list[float | None] = []
        self._seen = 0
        self._loaded = False     # a load's first step: counted though untimed (the run went on timing it)
        _bayes_opt()     # on every rank, now: not on rank 0 alone, mid-training, with peers waiting

    def _optimizer(self) -> Any:
        BayesianOptimization, acquisition = _bayes_opt()
        bo = BayesianOptimization(f=None, pbounds={"log2_mb": self.bounds}, random_state=self.seed,
                                  acquisition_function=acquisition.ExpectedImprovement(xi=0.01),
                                  verbose=0, allow_duplicate_points=True)
        for cap, t in self.history:
            bo.register(params={"log2_mb": self._x(cap)}, target=-t)
        return bo

    def _x(self, cap: int) -> float:
        return min(max(math.log2(cap / MiB), self.bounds[0]), self.bounds[1])

    def observe(self, step_s: float | None) -> int | None:
        """Record one step's time; at the end of a trial window, agree on the next cap.

        ``None``: a step the binding could not time (the first it sees: no step before it).  Not
        counted on a fresh start; counted, untimed, as the first step after :meth:`load_state_dict`,
        so that a resumed run re-plans at the same steps as the run that went on."""
        if self.done or (step_s is None and not self._loaded):
            return None
        self._loaded = False
        self._seen += 1
        if self._seen <= self.skip:
            return None
        self._times.append(None if step_s is None else float(step_s))
        timed = [t for t in self._times if t is not None]
        if len(self._times) < self.window or not timed:
            return None
        mean = float(np.mean(timed))
        self._times, self._seen = [], 0
        nxt = np.zeros(3, np.float64)            # (next cap bytes, done, rank 0's mean)
        if self.comm.rank == 0:
            self.history.append((self.cap, mean))
            if len(self.history) >= self.trials:
                nxt[:2] = (self.best_cap, 1.0)
            else:
                x = float(self._optimizer().suggest()["log2_mb"])
                nxt[:2] = (int(round(2 ** x * MiB)), 0.0)
            nxt[2] = mean
        self.comm.broadcast(nxt, 0, tag="tune")
        if self.comm.rank != 0:
            self.history.append((self.cap, float(nxt[2])))   # rank 0's figure: one history everywhere
        self.done = bool(nxt[1])
        new = int(nxt[0])
        if new == self.cap:
            return None
        self.cap = new
        return new

    @property
    def best_cap(self) -> int:
        return min(self.history, key=lambda h: h[1])[0] if self.history else self.cap

    def state_dict(self) -> dict[str, Any]:
        return {"cap": self.cap, "history": list(self.history), "done": self.done,
                "times": list(self._times), "seen": self._seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cap, self.done = int(state["cap"]), bool(state["done"])
        self.history = [(int(c), float(t)) for c, t in state["history"]]
        self._times, self._seen = list(state["times"]), int(state["seen"])
        self._loaded = True
