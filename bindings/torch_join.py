"""Uneven inputs: :meth:`DistributedOptimizer.join` (DDP's ``model.join()``, Horovod's ``hvd.join()``).

When ranks hold different numbers of batches, the rank that runs out first
would leave the others waiting in their next gradient all-reduce.  ``join``
iterates a rank's loader until *every* rank has run out: a rank whose loader
is exhausted repeats its last batch while the others still train, and that
repeated batch counts for nothing:

* its gradients are dropped before they reach the buckets (zeros go in, as
  from a rank that never saw the parameters) and the average is taken over
  the ranks that had a batch, so each step's update is the single-process
  one on the batches of the ranks still training (``divide_by_initial_world_size``:
  over every rank, DDP's default);
* the ranks that had a batch decide which parameters were used; ``SyncBatchNorm``
  takes its statistics (and the sums of its backward) from their batches only,
  and plain norm layers' running statistics come from the lowest of them;
* the loop body runs on every rank alike, so anything in it that
  communicates (``clip_grad_norm_``, a GradScaler, an evaluation every N steps,
  a logged all-reduce of the loss) meets its peers: nothing to change in the
  loop.  :attr:`Join.repeating` tells a rank that its batch is a repeat (leave
  it out of metrics: ``DistributedOptimizer.repeating`` says the same).

One small all-reduce per batch agrees on who still has one (``batch_census``,
under ``stop_together`` too: on a communicator of its own, so that it never
waits behind DeAR's all-gathers in flight).  The joined
ranks run the same update as the others, so replicas and optimizer state stay
identical (DDP's joined ranks skip the update and get the final model by
broadcast).  For strategies that average each step: ``AllReduce`` and ``DeAR``
(SelSync and Sync-Switch let replicas drift, sparse ones send residuals: refused).

Example:
    >>> for epoch in range(epochs):
    ...     for x, y in opt.join(loader):          # ranks may hold different numbers of batches
    ...         opt.zero_grad()
    ...         loss = loss_fn(model(x), y)
    ...         loss.backward()
    ...         opt.step()
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

import commlib
from commlib.collectives.data import batch_census

__all__ = ["Join", "Joining", "repeating"]

#: ids of the communicators on which this process now repeats a batch (read by SyncBatchNorm)
_REPEATING: set[int] = set()


def repeating(comm: commlib.Communicator) -> bool:
    """Whether this rank's batch is a repeat in a :class:`Join` over ``comm`` (it counts for nothing)."""
    return id(comm) in _REPEATING


class Join:
    """The batches of ``loader`` on this rank, then repeats of its last one while another rank still has
    batches (see the module).  Made by :meth:`DistributedOptimizer.join`; an iterable, like ``loader``.

    ``opt`` is the :class:`~bindings.torch.DistributedOptimizer` (its gradients are weighted by the ranks
    that had a batch at each pass).  Raises ``ValueError`` on every rank where some rank's loader is empty
    while another's is not (there is nothing to repeat).

    Example:
        >>> for x, y in opt.join(loader):
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        ...     if not opt.repeating: log(loss)
    """

    def __init__(self, opt: Any, loader: Iterable, divide_by_initial_world_size: bool = False):
        self.opt = opt
        self.loader = loader
        self.divide_by_initial_world_size = bool(divide_by_initial_world_size)
        #: this rank's batch is a repeat (its loader ran out before another rank's)
        self.repeating = False

    def __iter__(self) -> Iterator[Any]:
        opt, comm = self.opt, self.opt.comm
        last: Any = None
        zeroing: list[Any] = []
        try:
            for n, (batch, having) in enumerate(batch_census(self.loader, comm)):
                if n == 0 and len(having) < comm.size:      # on every rank
                    missing = sorted(set(range(comm.size)) - set(having))
                    raise ValueError(f"DistributedOptimizer.join: ranks {missing} got no batch at all from "
                                     f"their loader while ranks {having} have some (nothing to repeat): give "
                                     "every rank at least one batch")
                if comm.rank in having:
                    last = batch
                self.repeating = comm.rank not in having
                if self.repeating and not zeroing:      # from now on this rank's gradients are zeros
                    zeroing = [p.register_hook(torch.zeros_like) for p in opt.trained_parameters()]
                    _REPEATING.add(id(comm))
                opt._join_pass(len(having), having[0], self.repeating, self.divide_by_initial_world_size)
                yield last
        finally:
            for h in zeroing:
                h.remove()
            _REPEATING.discard(id(comm))
            self.repeating = False
            opt._join_pass(None)


class Joining:
    """Mixin of :class:`bindings.torch.DistributedOptimizer`: :meth:`join` and the weights of its passes."""

    comm: Any
    strategy: Any
    _params: list[torch.nn.Parameter]
    _outside: Any

    def _init_join(self) -> None:
        #: during a :class:`Join` pass: (ranks that had a batch, the lowest of them, this rank repeats, divide
        #: by every rank); ``None`` outside one
        self._join: tuple[int, int, bool, bool] | None = None
        self._join_weights()

    def _join_weights(self) -> None:
        """A step begins: no pass weighed yet (the ranks that had a batch, summed over its passes)."""
        self._join_had = self._join_all = 0

    def join(self, loader: Iterable, *, divide_by_initial_world_size: bool = False) -> Join:
        """Iterate ``loader`` until every rank has run out of batches (uneven inputs, DDP's ``join``).

        A rank whose loader ran out repeats its last batch while the others still train; the repeat counts
        for nothing (its gradients are dropped, the average is over the ranks that had a batch, or over
        every rank with ``divide_by_initial_world_size``, DDP's default).  Call it on every rank; the loop
        body runs alike everywhere.  ``ValueError`` here, on every rank alike, for a strategy whose replicas
        drift (SelSync, Sync-Switch) or that sends residuals (sparse ones), and for parameters of the model
        outside the optimizer that require gradients.

        Example:
            >>> for x, y in opt.join(loader):
            ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        """
        s = self.strategy
        if not s.reopens or s.updates_parameters:
            raise ValueError(f"DistributedOptimizer.join: {s.name} does not average the gradients of every "
                             "step (its replicas drift, or it sends residuals), so the ranks that ran out "
                             "cannot follow it; use AllReduce or DeAR")
        outside = len(self._outside.trained())
        if outside:
            raise ValueError(f"DistributedOptimizer.join: {outside} parameters of the model outside the "
                             "optimizer require gradients; add them to the optimizer or freeze them")
        return Join(self, loader, divide_by_initial_world_size)

    @property
    def repeating(self) -> bool:
        """Whether this rank's batch is a repeat in :meth:`join` (it counts for nothing: leave it out of
        metrics).

        Example:
            >>> if not opt.repeating: losses.append(loss.item())
        """
        return self._join is not None and self._join[2]

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients are averaged, in optimizer order."""
        return list(self._params)

    def _join_pass(self, having: int | None, root: int = 0, repeats: bool = False,
                   whole: bool = False) -> None:
        """:class:`Join` yields a batch (``having`` ranks had one, ``root`` the lowest) or ends
        (``None``)."""
        self._join = None if having is None else (having, root, repeats, whole)

    def _join_backward(self) -> None:
        """A backward pass ended (accumulated or reduced): weigh it by the ranks that had a batch."""
        if self._join is not None:
            self._join_had += self._join[0]
            self._join_all += self.comm.size

    def _join_factor(self) -> float:
        """What the average over every rank is multiplied by: the average over the passes' batches."""
        if self._join is None or self._join[3]:
            return 1.0
        had, every = ((self._join_had, self._join_all) if self._join_all
                      else (self._join[0], self.comm.size))
        return every / had

    def _stats_root(self) -> int:
        """The rank whose running statistics every rank takes: the lowest that had a batch."""
        return 0 if self._join is None else self._join[1]
