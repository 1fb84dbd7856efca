"""``DeAR``: all-reduce decoupled into a reduce-scatter during backward and an
all-gather before the next forward (arXiv 2302.12445), with a sharded update.

Each bucket's gradients are reduce-scattered (averaged) as soon as backward
fills the bucket; the optimizer then updates only this rank's shard of each
bucket (ZeRO-1: optimizer state and update cost 1/world_size); the updated
parameter shards are all-gathered, bucket by bucket in forward order, while
the next forward runs, and a module waits only for its own bucket.  Total
traffic equals one ring all-reduce, but the second half overlaps forward.

Unlike the paper's prototype: any elementwise optimizer works (the binding
runs the user's optimizer class on the shards), the last step's update is
applied (``flush()``), an extra forward never applies an update twice (the
update happens once, in the optimizer step), and evaluation after
``flush()`` or inside any forward sees current parameters.
"""

from __future__ import annotations

from typing import Any

from commlib import Work

from .strategy import Strategy


class DeAR(Strategy):
    """Decoupled reduce-scatter / all-gather with a sharded (ZeRO-1) update.

    Tuning: as for :class:`AllReduce`, ``cap_mb`` trades overlap against
    per-message latency; the all-gathers of the next forward overlap best
    when the first layers' bucket is small.

    Example:
        >>> opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()), model, strategy=DeAR())
        >>> for x, y in loader:
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        >>> with opt.flush():            # evaluation sees the last update
        ...     evaluate(model)
    """

    name = "dear"
    sharded = True
    reopens = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scatter: list[Work | None] = []     # per bucket: its reduce-scatter in flight
        self._gather: list[Work | None] = []      # per bucket: its all-gather in flight

    def setup(self, *args: Any, **kwargs: Any) -> None:
        self.complete()        # a re-plan: the last plan's all-gathers land first
        super().setup(*args, **kwargs)
        n = len(self.buckets)
        self._scatter = [None] * n
        self._gather = [None] * n

    def launch(self, b: int) -> None:
        self._scatter[b] = self.comm.ireduce_scatter(self.grads[b], "avg", out=self.shard_grads[b],
                                                     tag=f"rs{b}")
        self.stats["bytes"] += self.buckets[b].nbytes * (self.comm.size - 1) / self.comm.size

    def before_update(self) -> None:
        super().before_update()
        self._wait(self._scatter)

    def after_update(self) -> None:
        super().after_update()
        rank = self.comm.rank
        # forward runs the last-ready bucket first: gather in reverse bucket order
        for b in reversed(range(len(self.buckets))):
            p = self.params[b]
            self._gather[b] = self.comm.iallgather(p[self.buckets[b].shard(rank)], out=p, tag=f"ag{b}")
            self.stats["bytes"] += self.buckets[b].nbytes * (self.comm.size - 1) / self.comm.size

    def before_forward(self, b: int) -> None:
        if self._gather[b] is not None:
            self._wait(self._gather, b)

    def flush(self) -> None:
        self._wait(self._gather)

    def complete(self) -> None:
        self._wait(self._gather)      # all DeAR has in flight after a step: flush starts nothing new

    def writes_in_flight(self) -> bool:
        return any(w is not None for w in self._gather)
