"""torch samplers over :mod:`collectives.data`: ``SelDPSampler`` and ``DefDPSampler``.

Pass one to a ``DataLoader`` and call ``set_epoch(e)`` at the start of each
epoch (as with ``DistributedSampler``); every rank must use the same seed.

Example:
    >>> from commlib.bindings.torch_data import SelDPSampler
    >>> sampler = SelDPSampler(dataset, seed=0)            # rank and size from commlib.world()
    >>> loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    >>> for epoch in range(epochs):
    ...     sampler.set_epoch(epoch)
    ...     for x, y in loader: ...
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

from commlib.collectives.data import DefDP, IndexPlan, SelDP


def _length(data: Any) -> int:
    """``data``'s number of samples: ``data`` itself where an integer (numpy's too), else ``len(data)``."""
    if isinstance(data, numbers.Integral):
        return data             # type: ignore[return-value]  # the plan refuses bool and negatives
    try:
        return len(data)
    except TypeError:
        raise TypeError(f"data: expected a dataset (anything with len) or its length (an integer), "
                        f"got {type(data).__name__}") from None


def _resolve(data: Any, rank: int | None, size: int | None, comm: Any) -> tuple[int, int, int]:
    n = _length(data)
    if rank is None or size is None:
        if comm is None:
            import commlib
            comm = commlib.world()
        rank = comm.rank if rank is None else rank
        size = comm.size if size is None else size
    return n, rank, size


class _PlanSampler(Sampler[int]):
    plan: IndexPlan

    def __iter__(self) -> Iterator[int]:
        return iter(self.plan)

    def __len__(self) -> int:
        return len(self.plan)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (its shuffle); call on every rank with the same value."""
        self.plan.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.plan.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plan.load_state_dict(state)


class SelDPSampler(_PlanSampler):
    """SelSync's sampler: every rank walks the whole data set from its own chunk (circular).

    ``data``: a dataset (anything with ``len``) or its length (any integer >= 0,
    numpy's too; an empty data set yields nothing, as ``DistributedSampler``);
    ``rank``/``size``: default from ``comm`` (default ``commlib.world()``).

    Example:
        >>> list(SelDPSampler(4, rank=1, size=2, shuffle=False))
        [2, 3, 0, 1]
    """

    def __init__(self, data: Any, rank: int | None = None, size: int | None = None, seed: int = 0,
                 shuffle: bool = True, comm: Any = None):
        n, rank, size = _resolve(data, rank, size, comm)
        self.plan = SelDP(n, rank, size, seed=seed, shuffle=shuffle)


class DefDPSampler(_PlanSampler):
    """Disjoint shards (as ``DistributedSampler``), or explicit per-rank ``partition`` (non-IID).

    ``data``, ``rank``, ``size``, ``comm``: as :class:`SelDPSampler`.  Every rank
    gets ``ceil(n / size)`` indices, the epoch's order repeated from its start to
    pad, or with ``drop_last`` ``n // size`` (the tail dropped, no index twice):
    ``DistributedSampler``'s counts, rank r reading the r-th contiguous chunk
    rather than every size-th index;
    with ``partition``, each rank its own set padded to the longest set's length,
    or with ``drop_last`` cut to the shortest's (:class:`collectives.data.DefDP`).

    Example:
        >>> [list(DefDPSampler(5, rank=r, size=2, shuffle=False)) for r in range(2)]
        [[0, 1, 2], [3, 4, 0]]
        >>> [list(DefDPSampler(5, rank=r, size=2, shuffle=False, drop_last=True)) for r in range(2)]
        [[0, 1], [2, 3]]
    """

    def __init__(self, data: Any, rank: int | None = None, size: int | None = None, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False,
                 partition: Sequence[Sequence[int]] | None = None, comm: Any = None):
        n, rank, size = _resolve(data, rank, size, comm)
        self.plan = DefDP(n, rank, size, seed=seed, shuffle=shuffle, drop_last=drop_last,
                          partition=partition)
