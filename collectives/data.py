"""Data partitioning for data-parallel training: which samples each rank reads, framework-free.

* :class:`DefDP`: the default, disjoint shards (every sample on one rank per
  epoch), as torch's ``DistributedSampler``.
* :class:`SelDP`: SelSync's partitioning (arXiv 2307.07950): every rank walks
  the *whole* data set each epoch, starting at its own chunk and wrapping
  around (circular), so that local steps see all of the data.
* :class:`DataInjector`: for non-IID data, a fraction ``alpha`` of the ranks
  share a fraction ``beta`` of their batch with every other rank through
  commlib's collectives (one agreement, then an allgatherv); the local batch is shrunk to
  ``b' = b / (1 + alpha * beta * N)`` (:func:`injected_batch_size`, SelSync's rule), so
  that the batch after the exchange, ``b'`` and ``round(beta * b')`` from each other sharer,
  stays near ``b`` (64 at 4 ranks, alpha = beta = 0.75: 20, then 50 on a sharer and 65
  elsewhere; at 2 ranks, both sharing: 30, then 52).
* :func:`label_shards`: a non-IID partition (sorted by label, cut into shards)
  for tests and benchmarks.
* :func:`stop_together`: any loader (an ``IterableDataset`` stream, shards of
  uneven length), cut so that every rank stops at the step where the first
  rank runs out, instead of the others waiting in a collective for ever;
  :func:`batch_census`, the per-batch agreement under it (and under the torch
  binding's ``join``, which goes on until the last rank runs out).

Both partitionings shuffle per epoch from a seed that every rank shares, and
give every rank the same number of samples per epoch (so all ranks take the
same number of steps).  They are plain index iterators: JAX loops use them
directly; :mod:`bindings.torch_data` wraps them as torch samplers.

Example:
    >>> plan = SelDP(10, rank=1, size=2, seed=0, shuffle=False)
    >>> plan.indices(epoch=0).tolist()
    [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    >>> DefDP(10, rank=1, size=2, shuffle=False).indices(0).tolist()
    [5, 6, 7, 8, 9]
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

import commlib
from commlib import Communicator, ValidationError, split_counts
from commlib.side import side_comm

from .checks import check_int, check_real

T = TypeVar("T")


def _is_int(x: Any) -> bool:
    """An integer: ``int``, numpy's integers, any ``numbers.Integral``; not ``bool``, not ``2.0``."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_rank(rank: int, size: int) -> None:
    if not _is_int(size) or size < 1:
        raise ValueError(f"size {size!r}: expected an integer >= 1")
    if not _is_int(rank) or not 0 <= rank < size:
        raise ValueError(f"rank {rank!r}: expected an integer in 0..{size - 1}")


def _seeded(*words: int) -> np.random.Generator:
    """numpy's generator seeded by ``words``, any integers (a negative seed too, as torch's
    ``DistributedSampler`` takes one: numpy's entropy words are not negative).

    Example:
        >>> _seeded(-1, 0).permutation(3)       # the same on every rank
    """
    return np.random.default_rng([int(w) % 2**64 for w in words])


def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return _seeded(seed, epoch, 0x5E15).permutation(n)


class IndexPlan:
    """Base of the partitionings: per-epoch index arrays and batches of them.

    ``n``: the number of samples, any integer >= 0 (numpy's too; 0: an empty
    data set, every rank gets no index, as ``DistributedSampler``).
    ``set_epoch(e)`` chooses the epoch that iteration uses (as torch's samplers);
    ``indices(epoch)`` is this rank's order of sample indices for an epoch;
    ``batches(batch_size)`` cuts it into batches (the last one shorter unless
    ``drop_last``).
    """

    def __init__(self, n: int, rank: int, size: int, seed: int = 0, shuffle: bool = True):
        if not _is_int(n) or n < 0:
            raise ValueError(f"n {n!r}: expected a number of samples (an integer >= 0)")
        _check_rank(rank, size)
        self.n, self.rank, self.size = int(n), int(rank), int(size)
        self.seed = check_int(type(self).__name__, "seed", seed, None)     # not a float truncated
        self.shuffle = bool(shuffle)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_int(f"{type(self).__name__}.set_epoch", "epoch", epoch, None)

    def order(self, epoch: int) -> np.ndarray:
        """The shared order of all samples in ``epoch`` (the same on every rank)."""
        return _permutation(self.n, self.seed, epoch) if self.shuffle else np.arange(self.n)

    def indices(self, epoch: int | None = None) -> np.ndarray:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.indices(self.epoch))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(self.epoch).tolist())

    def batches(self, batch_size: int, epoch: int | None = None, drop_last: bool = True) -> list[np.ndarray]:
        """This rank's batches of ``epoch`` (default: the current one)."""
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size {batch_size!r}: expected an integer >= 1")
        idx = self.indices(epoch)
        stop = len(idx) - len(idx) % batch_size if drop_last else len(idx)
        return [idx[i:i + batch_size] for i in range(0, stop, batch_size)]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.seed = int(state["epoch"]), int(state["seed"])


class DefDP(IndexPlan):
    """Disjoint shards: rank r reads the r-th contiguous chunk of the epoch's shared order.

    Every rank gets ``ceil(n / size)`` indices (the order wraps around to pad
    the short chunks, as ``DistributedSampler``), or ``n // size`` with
    ``drop_last`` (the order's tail is dropped: no index twice).  ``partition``:
    explicit per-rank index sets (e.g. :func:`label_shards` for non-IID data);
    each rank then walks its own set, shuffled per epoch, padded by wrapping to
    the largest set's length, or with ``drop_last`` cut to the smallest set's
    length (an empty set: every rank gets none).

    Example:
        >>> [DefDP(5, r, 2, shuffle=False).indices(0).tolist() for r in range(2)]
        [[0, 1, 2], [3, 4, 0]]
        >>> [DefDP(5, r, 2, shuffle=False, drop_last=True).indices(0).tolist() for r in range(2)]
        [[0, 1], [2, 3]]
        >>> parts = [[0, 1, 2, 3, 4], [5, 6]]
        >>> [DefDP(7, r, 2, shuffle=False, partition=parts).indices(0).tolist() for r in range(2)]
        [[0, 1, 2, 3, 4], [5, 6, 5, 6, 5]]
        >>> [DefDP(7, r, 2, shuffle=False, partition=parts, drop_last=True).indices(0).tolist()
        ...  for r in range(2)]
        [[0, 1], [5, 6]]
    """

    def __init__(self, n: int, rank: int, size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, partition: Sequence[Sequence[int]] | None = None):
        super().__init__(n, rank, size, seed, shuffle)
        self.drop_last = bool(drop_last)
        self.partition = None
        if partition is not None:
            if len(partition) != size:
                raise ValueError(f"partition has {len(partition)} index sets for {size} ranks")
            parts = []
            for r, p in enumerate(partition):
                a = np.asarray(p)
                if a.ndim != 1 or (a.size and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() >= n)):
                    raise ValueError(f"partition[{r}]: expected a set of integer indices in 0..{n - 1}")
                parts.append(a.astype(np.int64))
            empty = [r for r, a in enumerate(parts) if len(a) == 0]
            if empty and len(empty) < size and not self.drop_last:
                raise ValueError(f"partition[{empty[0]}] is empty: nothing to pad it to the longest set's "
                                 f"length with (drop_last=True cuts every set to the shortest's instead)")
            self.partition = parts

    def indices(self, epoch: int | None = None) -> np.ndarray:
        epoch = self.epoch if epoch is None else int(epoch)
        if self.partition is not None:
            mine = self.partition[self.rank]
            if self.shuffle:
                rng = _seeded(self.seed, epoch, self.rank, 0xDEF)
                mine = mine[rng.permutation(len(mine))]
            if self.drop_last:       # every rank: its own set's first (shortest set's length) indices
                return mine[:min(len(p) for p in self.partition)].copy()
            return np.resize(mine, max(len(p) for p in self.partition))    # wrap around to pad
        order = self.order(epoch)
        per = self.n // self.size if self.drop_last else -(-self.n // self.size)
        if not self.drop_last and per * self.size > self.n:
            order = np.resize(order, per * self.size)    # wrap around to pad
        return order[self.rank * per:(self.rank + 1) * per].copy()


class SelDP(IndexPlan):
    """Every rank walks the whole data set, starting at its own chunk (circular).

    The epoch's shared order is cut into ``size`` chunks
    (:func:`commlib.split_counts`); rank r reads chunk r, r+1, ... and wraps
    around to chunk r-1, so every rank sees every sample once per epoch while
    the ranks read different samples at any moment.

    Example:
        >>> [SelDP(4, r, 2, shuffle=False).indices(0).tolist() for r in range(2)]
        [[0, 1, 2, 3], [2, 3, 0, 1]]
    """

    def start(self) -> int:
        """Where this rank starts in the epoch's order."""
        return int(sum(split_counts(self.n, self.size)[:self.rank]))

    def indices(self, epoch: int | None = None) -> np.ndarray:
        epoch = self.epoch if epoch is None else int(epoch)
        return np.roll(self.order(epoch), -self.start())


def label_shards(labels: Sequence[int], size: int, shards_per_rank: int = 2,
                 seed: int = 0) -> list[np.ndarray]:
    """A non-IID partition: indices sorted by label, cut into ``size * shards_per_rank``
    shards, dealt to the ranks in a seeded random order (each rank sees few labels).

    Example:
        >>> parts = label_shards([0, 0, 1, 1, 2, 2, 3, 3], size=2, shards_per_rank=2, seed=0)
        >>> sorted(np.concatenate(parts).tolist()) == list(range(8))
        True
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) < size * shards_per_rank:
        raise ValueError(f"need at least {size * shards_per_rank} labels for {size} ranks x "
                         f"{shards_per_rank} shards, got {len(labels)}")
    order = np.argsort(labels, kind="stable")
    shards = np.array_split(order, size * shards_per_rank)
    deal = _seeded(seed, 0x11D).permutation(len(shards))
    return [np.sort(np.concatenate([shards[j] for j in deal[r::size]])) for r in range(size)]


def stop_together(batches: Iterable[T], comm: Communicator | None = None) -> Iterator[T]:
    """``batches`` until any rank runs out: every rank stops at the same step.

    For loaders whose length differs across ranks (a streamed ``IterableDataset``,
    files of uneven size per rank): without it the ranks with more batches enter
    the next step's collectives alone and wait there until the timeout.  The
    batches a longer rank has left are dropped, as ``drop_last`` drops a short
    one.  Costs one all-reduce of 4 bytes per rank per batch (:func:`batch_census`), on
    a communicator split once from ``comm`` (default: the world) so that it never waits
    behind the step's communication in flight (DeAR's all-gathers).  Call it on every rank, once per
    epoch, around the loader; a ``break`` out of the loop is fine where every rank
    breaks at the same step.

    Example:
        >>> for x, y in stop_together(loader):    # loader: this rank's shard, any length
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """
    it = iter(batches)      # not iterable: TypeError here, on the rank that passed it, before any collective
    comm = comm if comm is not None else commlib.init()
    return it if comm.size == 1 else _stop_together(it, comm)


def _stop_together(it: Iterator[T], comm: Communicator) -> Iterator[T]:
    for item, having in batch_census(it, comm):
        if len(having) < comm.size:      # some rank has no batch left
            return
        yield item


def batch_census(batches: Iterable[T],
                 comm: Communicator | None = None) -> Iterator[tuple[T | None, list[int]]]:
    """This rank's next batch (``None`` once it has run out) and the ranks that have one, until none has.

    Each step costs one all-reduce of ``4 * size`` bytes on a communicator split once from
    ``comm`` (default: the world), so that it never waits behind the step's communication in
    flight (DeAR's all-gathers).  Every rank sees the same list at the same step.  Call it on
    every rank; what to do with a rank that ran out is the caller's (:func:`stop_together`
    stops every rank, the torch binding's ``join`` repeats its last batch).

    Example:
        >>> for batch, having in batch_census(loader):
        ...     if len(having) < comm.size: break       # stop_together's rule
    """
    it = iter(batches)
    comm = comm if comm is not None else commlib.init()
    rank, size = comm.rank, comm.size
    side = side_comm(comm, "batches") if size > 1 else None
    end = object()
    row = np.zeros(size, np.int32)
    while True:
        item = next(it, end)
        row[rank] = item is not end
        having = np.flatnonzero(row if side is None else side.allreduce(row, "max", tag="batches")).tolist()
        if not having:
            return
        yield (None if item is end else item), having


def _fractions(where: str, alpha: Any, beta: Any) -> tuple[float, float]:
    """``alpha`` and ``beta`` as fractions in [0, 1], else an error naming ``where(name=value)``."""
    a, b = (check_real(where, name, v, "a fraction in [0, 1]", lambda f: 0 <= f <= 1)
            for name, v in (("alpha", alpha), ("beta", beta)))
    return a, b


def injected_batch_size(batch_size: int, alpha: float, beta: float, size: int) -> int:
    """The local batch ``b' = b / (1 + alpha * beta * N)``, rounded, at least 1.

    Example:
        >>> injected_batch_size(64, 0.75, 0.75, 4)
        20
    """
    batch_size = check_int("injected_batch_size", "batch_size", batch_size, 1)
    size = check_int("injected_batch_size", "size", size, 1)
    alpha, beta = _fractions("injected_batch_size", alpha, beta)
    return max(1, int(round(batch_size / (1.0 + alpha * beta * size))))


class DataInjector:
    """Non-IID data injection: chosen ranks send part of their batch to every other rank.

    Each step ``sharers(step)`` picks ``round(alpha * size)`` ranks (the same on
    every rank: a seeded draw per step); a sharer sends the first
    ``round(beta * len(batch))`` samples of its local batch to every other rank
    (a shorter last batch works).  A rank's batch after :meth:`exchange` is its
    own, then the shared samples in rank order.  Every rank calls :meth:`exchange`
    at the same step with arrays of the same dtypes and sample shapes (checked:
    the same ``ValidationError`` on every rank otherwise); it runs over commlib's
    communicator, so a rank that does not come (uneven data, an exception) is
    named at once or at the timeout, as in any operation.

    ``comm``: a :class:`commlib.Communicator`, or an mpi4py communicator (a
    Communicator is made of it: a collective, and :meth:`close` closes it).

    Example:
        >>> inj = DataInjector(comm, alpha=0.75, beta=0.75, seed=0)
        >>> b_local = injected_batch_size(64, 0.75, 0.75, comm.size)
        >>> x, y = inj.exchange(step, x_local, y_local)     # 4 ranks: 50 or 65 samples
    """

    def __init__(self, comm: Any, alpha: float, beta: float, seed: int = 0):
        alpha, beta = _fractions("DataInjector", alpha, beta)
        seed = check_int("DataInjector", "seed", seed, None)
        self._own = not isinstance(comm, Communicator)
        if self._own:
            comm = commlib.init(comm=comm)
        self.comm: Communicator = comm
        self.rank, self.size = comm.rank, comm.size
        self.alpha, self.beta, self.seed = float(alpha), float(beta), int(seed)
        self.count = int(round(self.alpha * self.size))
        self.stats = {"sent_samples": 0, "received_samples": 0, "bytes_sent": 0}

    def sharers(self, step: int) -> list[int]:
        """The ranks that share at ``step`` (sorted; the same on every rank)."""
        rng = _seeded(self.seed, step, 0x1E).permutation(self.size)
        return sorted(int(r) for r in rng[:self.count])

    def shared_count(self, batch_len: int) -> int:
        return int(round(self.beta * batch_len))

    def exchange(self, step: int, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        """Exchange the shared part of this step's batch; return the grown arrays.

        ``arrays``: the local batch's arrays (e.g. inputs and labels), numpy,
        all with the same first dimension; received samples are appended.  One
        small agreement (step, dtypes, sample shapes, counts), then one
        ``allgatherv`` per array of the sharers' samples as bytes.
        """
        scalar = any(np.ndim(a) == 0 for a in arrays)     # (ascontiguousarray makes a 0-d array 1-d)
        arrays = tuple(np.ascontiguousarray(a) for a in arrays)
        n = len(arrays[0]) if arrays and not scalar else 0
        problem = ""
        if not arrays or scalar:
            problem = "give at least one array of samples"
        elif any(len(a) != n for a in arrays):
            problem = f"arrays differ in length: {[len(a) for a in arrays]}"
        elif any(a.dtype.hasobject for a in arrays):
            problem = "object arrays cannot be sent"
        m = self.shared_count(n) if self.rank in self.sharers(step) and not problem else 0
        layout = [(a.dtype.str, a.shape[1:]) for a in arrays]
        settings = (self.alpha, self.beta, self.seed)     # the sharers' draw: the same on every rank
        table = self.comm.allgather_object((problem, int(step), layout, m, settings),
                                           label="DataInjector.exchange")
        problems = [f"rank {r}: {p}" for r, (p, *_) in enumerate(table) if p]
        if not problems:
            first = table[0][1:3]
            problems = [f"rank {r} exchanges step {st} with arrays {lay}, rank 0 step {first[0]} with "
                        f"{first[1]}" for r, (_, st, lay, _, _) in enumerate(table) if (st, lay) != first]
            problems += [f"rank {r} has (alpha, beta, seed) {s}, rank 0 {table[0][4]}"
                         for r, (*_, s) in enumerate(table) if s != table[0][4]]
        if problems:        # every rank read the same table: every rank raises alike
            raise ValidationError("DataInjector.exchange: " + "; ".join(problems))
        counts = [row[3] for row in table]
        if m:
            self.stats["sent_samples"] += m * (self.size - 1)
            self.stats["bytes_sent"] += sum(a[:m].nbytes for a in arrays) * (self.size - 1)
        if not any(counts):         # nobody shares (every rank knows): nothing moves
            return arrays
        grown = []
        for a in arrays:
            per = a.dtype.itemsize * math.prod(a.shape[1:])        # bytes a sample
            sizes = [c * per for c in counts]
            padded = [-(-b // 4) * 4 for b in sizes]                # as int32: a dtype MPI moves
            mine = np.zeros(padded[self.rank], np.uint8)
            mine[:sizes[self.rank]] = a[:m].reshape(-1).view(np.uint8)
            flat = self.comm.allgatherv(mine.view(np.int32), [p // 4 for p in padded]).view(np.uint8)
            offsets = np.cumsum([0, *padded])
            got = [flat[offsets[r]:offsets[r] + sizes[r]].view(a.dtype).reshape(counts[r], *a.shape[1:])
                   for r in range(self.size) if r != self.rank and counts[r]]
            grown.append(np.concatenate([a, *got]))
        self.stats["received_samples"] += sum(c for r, c in enumerate(counts) if r != self.rank)
        return tuple(grown)

    def close(self) -> None:
        """Close the communicator made of an mpi4py one (collective); nothing for a Communicator."""
        if self._own:
            self.comm.close()
            self._own = False
