"""ExDyna (arXiv 2402.13781): exclusive partitions of blocks, dynamic boundaries, one scaled threshold.

Per step ``t`` on rank ``r`` of ``n``:

1. partition ``p = (t + r) % n`` of the flat accumulated gradient (the
   partitions are contiguous runs of blocks, :class:`~sparsify.partitions.BlockPartitions`);
2. select ``|acc| >= threshold`` inside it (one pass; :mod:`sparsify.kernels`);
3. exchange (:mod:`sparsify.exchange`): the counts record (count plus the
   threshold rule's histogram), the indices by ``allgatherv`` (no padding),
   then the average over ranks of each rank's own ``acc`` at the union; the
   partitions are disjoint, so the union has no duplicates and the build-up
   factor is 1;
4. from the all-gathered counts, identically on every rank: the next
   threshold (:class:`~sparsify.threshold.CountCurveThreshold`) and one-block
   boundary moves toward balanced counts.

:class:`MiCRO` is the same pipeline over ``n`` fixed equal slices with the
prototype's threshold rule (the baseline ExDyna improves on).

Example (under ``mpiexec -n 4``):
    >>> sel = ExDyna(density=0.01).setup(comm, grad.size)
    >>> fb = ErrorFeedback(grad.size)
    >>> out = sel.reduce(fb.accumulate(grad))      # collective
    >>> fb.settle(out)                               # residual: acc with the union cleared
    >>> out.stats.density, out.stats.buildup, out.stats.imbalance
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

from commlib.collectives.checks import check_bool, check_int, check_real

from .base import Reduced, Selector
from .exchange import Traffic, average_at, exchange_records, gather_indices
from .kernels import Scan, scan_binned, take_scan, threshold_scan
from .partitions import DEFAULT_BALANCE, BlockPartitions, EqualPartitions, Partitions, imbalance
from .threshold import INIT_FRACTIONS, ThresholdPolicy, make_policy, sample_tail, solve_initial


def scan_partition(xp: Any, seg: Any, policy: ThresholdPolicy) -> tuple[Scan, list[Any]]:
    """One rank's candidates in its partition ``seg`` under ``policy``'s window, and its counts record.

    Returns ``(scan, fields)``: histogram rules bin the candidates and their
    histogram is the record (one pass on the GPU, keeping the candidates from
    the policy's :meth:`~sparsify.threshold.ThresholdPolicy.store_from` bin up;
    :func:`~sparsify.kernels.scan_binned`); plain rules record the count
    (``scan.bins`` and ``scan.hist`` are ``None``).

    Example:
        >>> scan, fields = scan_partition(np, acc[lo:hi], sel.policy)
    """
    floor, _ = policy.window()
    if policy.record_len > 0:
        scan = scan_binned(xp, seg, floor, *policy.grid(), policy.record_len, policy.store_from())
        return scan, [scan.hist]
    pos, mags = threshold_scan(xp, seg, floor)
    return Scan(pos, mags, None, None, seg, floor, 0.0, 0, 0), [int(pos.size)]


def take_chosen(xp: Any, policy: ThresholdPolicy, k: int, table: Any, rank: int,
                scan: Scan) -> tuple[Any, list[int], float, int | None, Any]:
    """From every rank's counts record (``table``, all-gathered), what rank ``rank`` keeps of the
    candidates of its :func:`scan_partition`, identically decided on every rank.

    Returns ``(positions kept, every rank's count, threshold, boundary bin, summed histogram)``;
    plain rules keep every candidate (boundary and histogram ``None``).

    Example:
        >>> kept, counts, thr, chosen, hist = take_chosen(np, sel.policy, sel.k, table, 0, scan)
    """
    if policy.record_len == 0:
        return scan.pos, [int(c) for c in table[:, 1]], policy.window()[1], None, None
    hists = table[:, 1:]                      # every rank: the same boundary, every rank's count
    chosen, take = policy.choose(k, hists)
    kept = take_scan(xp, scan, chosen, take[rank])         # (queued first: the GPU works meanwhile)
    counts = [int(c) + t for c, t in zip(hists[:, chosen + 1:].sum(axis=1), take)]
    return kept, counts, policy.grid_threshold(chosen), chosen, hists.sum(axis=0)


class PartitionedThreshold(Selector):
    """Threshold selection inside one exclusive, rotating partition per rank (ExDyna, MiCRO)."""

    name = "partitioned"
    rebalance = False

    def __init__(self, density: float = 0.01, threshold: str | float | ThresholdPolicy = "auto"):
        super().__init__(density)
        self._threshold_spec = threshold
        make_policy(threshold)            # reject a bad spec now, on every rank
        self.policy: ThresholdPolicy | None = None
        self.partitions: Partitions | None = None

    def config(self) -> dict[str, Any]:
        return {**super().config(), "threshold": self._threshold_spec}

    def _make_partitions(self) -> Partitions:
        raise NotImplementedError

    def _setup(self) -> None:
        self.partitions = self._make_partitions()
        spec = self._threshold_spec           # a fresh policy per setup, never a shared one
        self.policy = copy.deepcopy(spec) if isinstance(spec, ThresholdPolicy) else make_policy(spec)
        self.policy.start(self.k, period=self.comm.size)     # the partitions rotate over the ranks

    @property
    def threshold(self) -> float | None:
        """The threshold the next step uses (identical on every rank)."""
        return None if self.policy is None else self.policy.threshold

    def partition_of(self, rank: int, step: int | None = None) -> int:
        """The partition ``rank`` selects from at ``step`` (default: the next step)."""
        step = self.step if step is None else step
        return (step + rank) % self.comm.size

    # ------------------------------------------------------------------ the step
    def _first_threshold(self, acc: Any, problem: str | None, traffic: Traffic) -> None:
        """Step 0 only: one tiny all-gather of each rank's sampled tail; every rank solves the same."""
        comm = self.comm
        length = 1 + 1 + len(INIT_FRACTIONS)
        fields: list[Any] = []
        if problem is None:
            lo, hi = self.partitions.range(self.partition_of(comm.rank))
            fields = [sample_tail(self.xp, acc[lo:hi], self.density)]
        table = exchange_records(comm, fields, length, problem, f"{self.name}:init",
                                 traffic, dtype="float64")
        self.policy.threshold = solve_initial(table[:, 1:], self.density, float(self.k))

    def _reduce(self, acc: Any, problem: str | None, traffic: Traffic) -> Reduced:
        if self.k >= self.numel:
            return self._reduce_dense(acc, problem, traffic)
        comm, xp, policy = self.comm, self.xp, self.policy
        n = comm.size
        if policy.needs_init:
            self._first_threshold(acc, problem, traffic)
            problem = None                     # raised above on every rank otherwise
        p = self.partition_of(comm.rank)
        lo, hi = self.partitions.range(p)
        t0 = time.perf_counter()
        scan = None
        fields: list[Any] = []
        if problem is None:
            scan, fields = scan_partition(xp, acc[lo:hi], policy)
        select_s = time.perf_counter() - t0
        table = exchange_records(comm, fields, 1 + max(policy.record_len, 1), problem,
                                 self.name, traffic)
        t0 = time.perf_counter()
        pos, counts, thr, chosen, hist = take_chosen(xp, policy, self.k, table, comm.rank, scan)
        pos += lo
        idx = pos.astype(self.index_dtype, copy=False)
        select_s += time.perf_counter() - t0
        union = gather_indices(comm, idx, counts, self.name, traffic)
        values = average_at(comm, acc, union, self.name, traffic)

        total = sum(counts)
        by_partition = [0] * n
        for r, c in enumerate(counts):
            by_partition[(self.step + r) % n] = c
        policy.update(self.k, total, hist, chosen)
        moves = self.partitions.rebalance(by_partition) if self.rebalance else 0
        stats = self._stats(idx.size, total, total, select_s, threshold=thr,
                            imbalance=imbalance(by_partition),
                            extra={"partition": p, "moves": moves, "next_threshold": policy.threshold,
                                   "boundary": chosen, "rescanned": chosen is not None
                                   and not scan.kept(chosen)})
        return Reduced(union, values, idx, stats)

    def rescale(self, factor: float) -> None:
        if self.policy is not None:
            self.policy.rescale(factor)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "threshold": self.policy.state_dict(),
                "partitions": self.partitions.state_dict()}

    def check_state(self, state: dict[str, Any], same_world: bool = True) -> None:
        super().check_state(state, same_world)
        self.policy.check_state(state["threshold"])
        if same_world:
            self.partitions.check_state(state["partitions"])

    def load_state_dict(self, state: dict[str, Any], same_world: bool = True) -> None:
        super().load_state_dict(state, same_world)
        self.policy.load_state_dict(state["threshold"])
        if same_world:
            self.partitions.load_state_dict(state["partitions"])


class ExDyna(PartitionedThreshold):
    """ExDyna: block partitions with dynamic boundaries and our online threshold scaling.

    ``density``: target fraction exchanged per step; ``num_blocks`` (1024)
    and ``align`` (32): the block layout; ``balance`` (1.05): the
    over/under factor that moves a boundary; ``rebalance``: move boundaries
    at all; ``threshold``: ``"auto"`` (:class:`~sparsify.threshold.CountCurveThreshold`),
    ``"reference"`` (the prototype's rule), a number (fixed) or a policy.

    Tuning: 1024 blocks suit up to a few hundred ranks (the minimum partition
    is ``num_blocks / (4 n)`` blocks); the threshold rule needs nothing.

    Example:
        >>> strategy = SparseAllReduce(selector=ExDyna(density=0.01))
    """

    name = "exdyna"
    rebalance = True

    def __init__(self, density: float = 0.01, num_blocks: int = 1024, align: int = 32,
                 balance: float = DEFAULT_BALANCE, rebalance: bool = True,
                 threshold: str | float | ThresholdPolicy = "auto"):
        super().__init__(density, threshold)
        self.num_blocks = check_int("ExDyna", "num_blocks", num_blocks, 1)
        self.align = check_int("ExDyna", "align", align, 1)
        self.balance = check_real("ExDyna", "balance", balance, "a finite number > 1",
                                  lambda v: 1 < v < math.inf)
        self.rebalance = check_bool("ExDyna", "rebalance", rebalance)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "num_blocks": self.num_blocks, "align": self.align,
                "balance": self.balance, "rebalance": self.rebalance}

    def _make_partitions(self) -> Partitions:
        return BlockPartitions(self.numel, self.comm.size, self.num_blocks, self.align, self.balance)


class MiCRO(PartitionedThreshold):
    """MiCRO: ``n`` fixed equal partitions (no blocks, no moves), rotating, with the prototype's
    threshold rule (``threshold="reference"``; pass ``"auto"`` for ours)."""

    name = "micro"

    def __init__(self, density: float = 0.01, threshold: str | float | ThresholdPolicy = "reference"):
        super().__init__(density, threshold)

    def _make_partitions(self) -> Partitions:
        return EqualPartitions(self.numel, self.comm.size)
