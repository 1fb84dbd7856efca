"""Baseline selectors behind the same interface as :class:`~sparsify.ExDyna`.

=================  ==========================================================  ===============
selector           what each rank does per step                                 union
=================  ==========================================================  ===============
``TopK``           exact top-k of its whole ``|acc|``; indices all-gathered,    up to n k
                   deduplicated (the "gradient build-up")
``RandomK``        k indices from a seed shared by all ranks (no index traffic)  k
``HardThreshold``  ``|acc| >= threshold`` over the whole vector (fixed)          uncontrolled
``CLTK``           a rotating leader's exact top-k indices, broadcast            k
``MiCRO``          threshold inside one of n equal, rotating slices            about k
``Dense``          all-reduce of everything (the reference point)              N
=================  ==========================================================  ===============

Every index-based selector averages each rank's own ``acc`` at the union
(exact on the union) and clears the union from the residual.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from commlib.collectives.checks import check_int, check_real

from .base import Reduced, Selector
from .exchange import Traffic, average_at, exchange_records, gather_indices
from .exdyna import MiCRO
from .kernels import threshold_scan, top_k
from .threshold import INIT_FRACTIONS, FixedThreshold, sample_tail, solve_initial

__all__ = ["TopK", "RandomK", "HardThreshold", "CLTK", "MiCRO", "Dense"]


class TopK(Selector):
    """Exact top-k on every rank over the whole vector, union of the ranks' indices.

    Costs an ``argpartition`` of N elements per rank per step, and the union
    grows up to ``n k`` when the ranks disagree (``stats.buildup``).
    """

    name = "topk"

    def _reduce(self, acc: Any, problem: str | None, traffic: Traffic) -> Reduced:
        comm, xp = self.comm, self.xp
        t0 = time.perf_counter()
        idx = top_k(xp, acc, self.k, self.index_dtype) if problem is None else None
        select_s = time.perf_counter() - t0
        table = exchange_records(comm, [int(self.k)], 2, problem, self.name, traffic)
        counts = [int(c) for c in table[:, 1]]
        gathered = gather_indices(comm, idx, counts, self.name, traffic)
        union = xp.unique(gathered).astype(self.index_dtype, copy=False)
        values = average_at(comm, acc, union, self.name, traffic)
        stats = self._stats(idx.size, union.size, sum(counts), select_s)
        return Reduced(union, values, idx, stats)


class RandomK(Selector):
    """k indices drawn without replacement from a seed shared by all ranks (``seed``, step):
    no index traffic, no selection cost, but the values are random ones."""

    name = "randomk"

    def __init__(self, density: float = 0.01, seed: int = 0):
        super().__init__(density)
        self.seed = check_int("RandomK", "seed", seed, 0)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "seed": self.seed}

    def _reduce(self, acc: Any, problem: str | None, traffic: Traffic) -> Reduced:
        comm, xp = self.comm, self.xp
        t0 = time.perf_counter()
        idx = None
        if problem is None:
            rng = np.random.default_rng([self.seed, self.step])
            host = np.sort(rng.choice(self.numel, self.k, replace=False)).astype(self.index_dtype)
            idx = host if xp is np else xp.asarray(host)
        select_s = time.perf_counter() - t0
        exchange_records(comm, [], 1, problem, self.name, traffic)
        values = average_at(comm, acc, idx, self.name, traffic)
        stats = self._stats(idx.size, idx.size, idx.size * comm.size, select_s)
        return Reduced(idx, values, idx, stats)


class HardThreshold(Selector):
    """``|acc| >= threshold`` over the whole vector on every rank; the union of the indices.

    ``threshold``: a fixed value, or ``None`` for the first step's estimate
    of the value at which each rank would select ``density`` of its vector
    (then frozen): the density drifts as training goes on.
    """

    name = "threshold"

    def __init__(self, density: float = 0.01, threshold: float | None = None):
        super().__init__(density)
        self.fixed = None if threshold is None else check_real(
            "HardThreshold", "threshold", threshold, "a finite number > 0", lambda v: 0 < v < math.inf)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "threshold": self.fixed}

    def _setup(self) -> None:
        self.policy = FixedThreshold(self.fixed)

    @property
    def threshold(self) -> float | None:
        return self.policy.threshold

    def _reduce(self, acc: Any, problem: str | None, traffic: Traffic) -> Reduced:
        comm, xp = self.comm, self.xp
        if self.policy.needs_init:
            fields = [] if problem else [sample_tail(xp, acc, self.density)]
            table = exchange_records(comm, fields, 2 + len(INIT_FRACTIONS), problem,
                                     f"{self.name}:init", traffic, dtype="float64")
            problem = None
            # every rank scans the whole vector: n k selections in all
            self.policy.threshold = solve_initial(table[:, 1:], self.density, float(self.k * comm.size))
        thr = self.policy.threshold
        t0 = time.perf_counter()
        idx = None
        if problem is None:
            pos, _ = threshold_scan(xp, acc, thr)
            idx = pos.astype(self.index_dtype, copy=False)
        select_s = time.perf_counter() - t0
        table = exchange_records(comm, [0 if idx is None else int(idx.size)], 2, problem,
                                 self.name, traffic)
        counts = [int(c) for c in table[:, 1]]
        gathered = gather_indices(comm, idx, counts, self.name, traffic)
        union = xp.unique(gathered).astype(self.index_dtype, copy=False)
        values = average_at(comm, acc, union, self.name, traffic)
        stats = self._stats(idx.size, union.size, sum(counts), select_s, threshold=thr)
        return Reduced(union, values, idx, stats)

    def rescale(self, factor: float) -> None:
        self.policy.rescale(factor)      # a given threshold too: it is in the first step's units

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "threshold": self.policy.state_dict()}

    def check_state(self, state: dict[str, Any], same_world: bool = True) -> None:
        super().check_state(state, same_world)
        self.policy.check_state(state["threshold"])

    def load_state_dict(self, state: dict[str, Any], same_world: bool = True) -> None:
        super().load_state_dict(state, same_world)
        self.policy.load_state_dict(state["threshold"])


class CLTK(Selector):
    """CLT-k: the leader (rank ``step % n``) picks its exact top-k and broadcasts the indices;
    every rank's values there are averaged.  No build-up; one rank pays the top-k."""

    name = "cltk"

    def _reduce(self, acc: Any, problem: str | None, traffic: Traffic) -> Reduced:
        comm, xp = self.comm, self.xp
        leader = self.step % comm.size
        t0 = time.perf_counter()
        idx = None
        if problem is None:
            if comm.rank == leader:
                idx = top_k(xp, acc, self.k, self.index_dtype)
            else:
                idx = xp.empty(self.k, dtype=self.index_dtype)
        select_s = time.perf_counter() - t0
        exchange_records(comm, [], 1, problem, self.name, traffic)
        idx = comm.broadcast(idx, leader, tag=f"{self.name}:indices")     # in place
        traffic.broadcast(idx.nbytes)
        values = average_at(comm, acc, idx, self.name, traffic)
        mine = self.k if comm.rank == leader else 0
        stats = self._stats(mine, self.k, self.k, select_s, extra={"leader": leader})
        return Reduced(idx, values, idx if mine else idx[:0], stats)


class Dense(Selector):
    """Everything, all-reduced (``avg``): the reference the sparse selectors are measured against."""

    name = "dense"

    def __init__(self, density: float = 1.0):
        super().__init__(density)
        if self.density != 1.0:         # it sends everything: its stats would report another target
            raise ValueError(f"Dense(density={density!r}): Dense sends every element (density 1.0); "
                             "for a density below 1 use a sparse selector (ExDyna, TopK, ...)")

    def _reduce(self, acc: Any, problem: str | None, traffic: Traffic) -> Reduced:
        return self._reduce_dense(acc, problem, traffic)
