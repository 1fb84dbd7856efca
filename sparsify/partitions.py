"""Exclusive partitions of a flat vector: ExDyna's blocks with movable boundaries, and MiCRO's equal slices.

Every rank selects inside one partition per step and the partitions are
disjoint, so the ranks' selections never overlap and the union needs no
deduplication.  A partition table is pure bookkeeping: every rank holds the
same table and changes it only from globally known counts, so the ranks
never disagree and never talk about it.

ExDyna's layout (:class:`BlockPartitions`): the vector of ``numel`` elements
is cut into ``num_blocks`` blocks (1024 by default) of ``block_size`` =
``numel // num_blocks`` rounded down to a multiple of ``align`` (32); the
remainder joins the last block, hence the last partition.  Vectors too small
for that get blocks of ``max(1, numel // num_blocks)`` elements (and fewer
blocks when ``numel < num_blocks``).  Partition ``p`` holds the contiguous
blocks ``[bounds[p], bounds[p+1])``; initially the first ``num_blocks % n``
partitions get one block more.

Example:
    >>> parts = BlockPartitions(25_000_000, 4)
    >>> parts.block_size, parts.bounds, parts.range(3)
    (24384, [0, 256, 512, 768, 1024], (18726912, 25000000))
    >>> parts.rebalance([900, 1000, 1000, 1100])     # partition 3 busy, 0 idle: no neighbours
    0
    >>> parts.rebalance([1200, 800, 1000, 1000]), parts.bounds
    (1, [0, 255, 512, 768, 1024])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: a partition counts as over (under) its share when above ``balance`` (below ``1/balance``) times the mean
DEFAULT_BALANCE = 1.05


def imbalance(counts: Sequence[int]) -> float:
    """``max(count) * n / total - 1``: the extra traffic a padded all-gather would pay (0 when balanced).

    Example:
        >>> imbalance([10, 10, 10, 10]), imbalance([20, 10, 5, 5])
        (0.0, 1.0)
    """
    total = sum(int(c) for c in counts)
    if total <= 0:
        return 0.0
    return max(int(c) for c in counts) * len(counts) / total - 1.0


class Partitions:
    """Base: ``n`` contiguous, disjoint partitions covering ``[0, numel)``."""

    def __init__(self, numel: int, n: int):
        if int(numel) < 1:
            raise ValueError(f"numel {numel!r}: expected >= 1 element")
        if int(n) < 1:
            raise ValueError(f"n {n!r}: expected >= 1 partition")
        self.numel = int(numel)
        self.n = int(n)

    def range(self, p: int) -> tuple[int, int]:
        """Element range ``[lo, hi)`` of partition ``p``."""
        raise NotImplementedError

    def ranges(self) -> list[tuple[int, int]]:
        return [self.range(p) for p in range(self.n)]

    def largest(self) -> int:
        """An upper bound of any partition's element count, now and after any moves."""
        raise NotImplementedError

    def rebalance(self, counts: Sequence[int]) -> int:
        """Move boundaries given each partition's selected count; returns the number of moves."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise unless :meth:`load_state_dict` takes ``state`` (changing nothing)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class EqualPartitions(Partitions):
    """MiCRO's layout: ``n`` fixed slices of ``numel // n`` elements, the first ``numel % n`` one longer.

    Example:
        >>> EqualPartitions(10, 4).ranges()
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """

    def __init__(self, numel: int, n: int):
        super().__init__(numel, n)
        q, r = divmod(self.numel, self.n)
        self._starts = [p * q + min(p, r) for p in range(self.n + 1)]

    def range(self, p: int) -> tuple[int, int]:
        return self._starts[p], self._starts[p + 1]

    def largest(self) -> int:
        return -(-self.numel // self.n)


class BlockPartitions(Partitions):
    """ExDyna's layout: blocks of a fixed size, partitions of contiguous blocks, movable boundaries.

    ``num_blocks``: blocks in the vector (1024); ``align``: block sizes are a
    multiple of it when the vector is large enough (32); ``balance``: the
    over/under factor that triggers a move (1.05); ``min_blocks``: the
    smallest partition, in blocks (default ``num_blocks // (4 n)``, at least 1).
    """

    def __init__(self, numel: int, n: int, num_blocks: int = 1024, align: int = 32,
                 balance: float = DEFAULT_BALANCE, min_blocks: int | None = None):
        super().__init__(numel, n)
        if int(num_blocks) < 1:
            raise ValueError(f"num_blocks {num_blocks!r}: expected >= 1")
        if int(align) < 1:
            raise ValueError(f"align {align!r}: expected >= 1")
        if not balance > 1.0:
            raise ValueError(f"balance {balance!r}: expected > 1")
        size = self.numel // int(num_blocks)
        if size >= align:
            size -= size % int(align)
        self.block_size = max(1, size)
        self.num_blocks = min(int(num_blocks), self.numel // self.block_size)
        self.remainder = self.numel - self.num_blocks * self.block_size
        self.balance = float(balance)
        if min_blocks is None:
            min_blocks = self.num_blocks // (4 * self.n)
        # with at least one block per partition available, no partition may vanish
        floor = 1 if self.num_blocks >= self.n else 0
        self.min_blocks = min(max(int(min_blocks), floor), self.num_blocks // self.n)
        q, r = divmod(self.num_blocks, self.n)
        self.bounds = [p * q + min(p, r) for p in range(self.n + 1)]

    # ------------------------------------------------------------------ geometry
    def sizes(self) -> list[int]:
        """Blocks per partition."""
        return [self.bounds[p + 1] - self.bounds[p] for p in range(self.n)]

    def range(self, p: int) -> tuple[int, int]:
        lo = self.bounds[p] * self.block_size
        hi = self.numel if p == self.n - 1 else self.bounds[p + 1] * self.block_size
        return lo, hi

    def largest(self) -> int:
        most = self.num_blocks - (self.n - 1) * self.min_blocks
        return most * self.block_size + self.remainder

    def check(self) -> None:
        """Raise ``AssertionError`` unless the partitions cover ``[0, numel)``, each >= the minimum."""
        b = self.bounds
        assert len(b) == self.n + 1 and b[0] == 0 and b[-1] == self.num_blocks, b
        assert all(b[p + 1] - b[p] >= self.min_blocks for p in range(self.n)), (b, self.min_blocks)
        r = self.ranges()
        assert r[0][0] == 0 and r[-1][1] == self.numel
        assert all(r[p][1] == r[p + 1][0] for p in range(self.n - 1))

    # ------------------------------------------------------------------ moves
    def rebalance(self, counts: Sequence[int]) -> int:
        """One left-to-right sweep over the boundaries given each partition's selected count.

        Where partition ``i`` holds more than ``balance`` times the mean count
        and ``i + 1`` less than ``1 / balance`` times it, the last block of
        ``i`` moves to ``i + 1`` (the mirror case moves the first block of
        ``i + 1`` to ``i``), never below ``min_blocks``; the moved block's
        estimated count (the giver's count per block) then moves between the
        estimates so that later boundaries see the effect.  Returns the moves.
        """
        if len(counts) != self.n:
            raise ValueError(f"rebalance: {len(counts)} counts for {self.n} partitions")
        est = [float(c) for c in counts]
        total = sum(est)
        if self.n < 2 or total <= 0:
            return 0
        mean = total / self.n
        hi, lo = self.balance * mean, mean / self.balance
        moves = 0
        for i in range(self.n - 1):
            size_i = self.bounds[i + 1] - self.bounds[i]
            size_j = self.bounds[i + 2] - self.bounds[i + 1]
            if est[i] > hi and est[i + 1] < lo and size_i > self.min_blocks:
                moved = est[i] / size_i
                self.bounds[i + 1] -= 1
                est[i] -= moved
                est[i + 1] += moved
                moves += 1
            elif est[i] < lo and est[i + 1] > hi and size_j > self.min_blocks:
                moved = est[i + 1] / size_j
                self.bounds[i + 1] += 1
                est[i] += moved
                est[i + 1] -= moved
                moves += 1
        return moves

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "numel": self.numel, "n": self.n,
                "num_blocks": self.num_blocks, "block_size": self.block_size}

    def check_state(self, state: dict[str, Any]) -> None:
        want = (self.numel, self.n, self.num_blocks, self.block_size)
        got = (state["numel"], state["n"], state["num_blocks"], state["block_size"])
        if tuple(int(v) for v in got) != want:
            raise ValueError(f"partition state for (numel, ranks, blocks, block size) {got} "
                             f"given to a layout of {want}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.bounds = [int(b) for b in state["bounds"]]
        self.check()
