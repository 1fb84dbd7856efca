"""``AllReduce``: wait-free backpropagation (WFBP), the baseline every DDP and Horovod user knows."""

from __future__ import annotations

from typing import Any

from commlib import Work

from .strategy import Strategy


class AllReduce(Strategy):
    """Average each bucket's gradients with one all-reduce, started as soon as
    the bucket's last gradient is ready in backward (and the buckets before
    it are launched); the optimizer step waits for all of them.

    Tuning: smaller ``cap_mb`` starts communication earlier but pays more
    per-message latency; on slow links 4-32 MiB is usually right, and
    ``tune=True`` searches it online.

    Example:
        >>> from commlib.bindings.torch import DistributedOptimizer
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
        ...                            strategy=AllReduce(cap_mb=25))
    """

    name = "allreduce"
    reopens = True

    def setup(self, *args: Any, **kwargs: Any) -> None:
        super().setup(*args, **kwargs)
        self._works: list[Work | None] = [None] * len(self.buckets)

    def launch(self, b: int) -> None:
        g = self.grads[b]
        self._works[b] = self.comm.iallreduce(g, "avg", out=g, tag=f"b{b}")
        self.stats["bytes"] += self.buckets[b].nbytes

    def before_update(self) -> None:
        super().before_update()
        self._wait(self._works)
