"""``SparseAllReduce``: a strategy that exchanges a sparse selection of each bucket instead of all of it.

When a bucket's gradients are ready (``launch``), the strategy adds the
bucket's residual (error feedback), lets its selector select and exchange
(a collective), writes the averaged sparse gradient back into the bucket
densely (zeros off the union) and keeps the rest as the new residual.  The
optimizer then steps on that gradient (momentum and weight decay apply
after aggregation, as in the ExDyna prototype).

ExDyna works on one flat vector of the whole model, so the default cap
puts the whole model in one bucket.  Gradients may be numpy, cupy, torch
(CPU or CUDA) or any DLPack array: the buckets are reached through
:func:`commlib.arrays.as_view`, never by importing a framework; 16-bit
gradients keep a float32 residual.

Example:
    >>> from commlib.bindings.torch import DistributedOptimizer
    >>> from commlib.sparsify import ExDyna, SparseAllReduce
    >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
    ...                            strategy=SparseAllReduce(selector=ExDyna(density=0.01)))
    >>> opt.strategy.last_stats[0].density          # after a step: what was sent

On the GPU the selection runs on cupy's current stream (as every commlib
operation orders after it): gradients written on another stream must be
complete before ``bucket_ready``.

Checkpoints: the residual belongs to its rank; save the state of every rank
(``torch.save(opt.state_dict(), f"ckpt.{rank}")``).  Loading a state saved by
another rank or world size keeps the step, thresholds (and boundaries, with the
same world size) and starts from zero residuals, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from commlib import Communicator, ValidationError
from commlib.collectives.buckets import Move
from commlib.collectives.checks import check_bool
from commlib.collectives.strategy import Strategy, saved_elsewhere

from ._arrays import GRAD_DTYPES, acc_dtype_for, all_finite, flat_view, read_as, write_as
from .base import Selector, StepStats
from .exdyna import ExDyna
from .feedback import ErrorFeedback

#: the default cap: large enough that a whole model is one bucket (ExDyna's one flat vector)
WHOLE_MODEL_MB = float(1 << 20)


class SparseAllReduce(Strategy):
    """Sparse gradient exchange with error feedback, one selector per bucket.

    ``selector``: a :class:`~sparsify.Selector` used as a template (each
    bucket gets a fresh clone; default :class:`~sparsify.ExDyna` at density
    0.01).  ``cap_mb``/``first_cap_mb``: bucket caps as for every strategy
    (default: the whole model in one bucket).  ``history``: keep every
    step's :class:`~sparsify.StepStats` in :attr:`history` (off by default;
    :attr:`last_stats` always holds the last step's).

    Tuning: one bucket gives ExDyna the whole model to balance and one
    exchange per step; several buckets overlap the exchange with backward
    but pay three small collectives per bucket.
    """

    name = "sparse"
    sparse = True

    def __init__(self, selector: Selector | None = None, cap_mb: float = WHOLE_MODEL_MB,
                 first_cap_mb: float = 0.0, history: bool = False):
        super().__init__(cap_mb=cap_mb, first_cap_mb=first_cap_mb, last_cap_mb=0.0)
        if selector is not None and not isinstance(selector, Selector):
            raise TypeError(f"selector: expected a sparsify.Selector, got {type(selector).__name__}")
        self.selector = selector if selector is not None else ExDyna(density=0.01)
        self.selectors: list[Selector] = []
        self.feedback: list[ErrorFeedback] = []
        self.last_stats: list[StepStats | None] = []
        self.keep_history = check_bool("SparseAllReduce", "history", history)
        self.history: list[list[StepStats]] = []
        self._views: list[tuple[Any, str, Any]] = []
        self._layout: list[tuple[int, str, str]] = []
        self._pending: dict[str, Any] | None = None
        #: the last plan's residuals and selectors, until a re-plan's replanned() carries them over
        self._before: tuple[list[ErrorFeedback], list[Selector]] | None = None
        #: per named tree other than the one set up now: its state (:meth:`_tree_record`)
        self._trees: dict[str, dict[str, Any]] = {}
        self.stats["nonfinite_steps"] = 0      # buckets averaged densely: a rank's gradient overflowed

    # ------------------------------------------------------------------ lifecycle
    def setup(self, comm: Communicator, buckets: Sequence[Any], params: Sequence[Any],
              grads: Sequence[Any], shard_grads: Sequence[Any] | None = None,
              broadcast: bool = True, tree: str | None = None) -> None:
        views, layout = [], []
        for b, g in enumerate(grads):
            data, dtype, xp = flat_view(g, f"{self.name}: grads[{b}]")
            if dtype not in GRAD_DTYPES:
                raise ValidationError(f"{self.name}: grads[{b}] has dtype {dtype}; sparse exchange "
                                      f"needs floating gradients ({', '.join(GRAD_DTYPES)})")
            if data.size < 1:
                raise ValidationError(f"{self.name}: grads[{b}] is empty")
            views.append((data, dtype, xp))
            layout.append((int(data.size), dtype, xp.__name__))
        new_plan = len(buckets) != len(self.buckets) or any(a is not b for a, b in zip(buckets, self.buckets))
        fresh = (new_plan or tree != self.tree or layout != self._layout
                 or any(s.comm is not comm for s in self.selectors))
        if fresh and self.tree is not None and self.selectors:   # a named tree's state waits for its setup
            self._trees[self.tree] = self._tree_record()
        super().setup(comm, buckets, params, grads, shard_grads, broadcast, tree)
        if fresh:
            # a new plan (or communicator), even of the same sizes (another tree, parameters that
            # moved): fresh selectors and residuals; a re-plan's binding carries the old ones' over
            # where its parameters moved (replanned())
            self._before = (self.feedback, self.selectors) if self.selectors and all(
                s.comm is comm for s in self.selectors) else None
            self.selectors = [self.selector.clone().setup(comm, n, xp)
                              for (n, _, _), (_, _, xp) in zip(layout, views)]
            self.feedback = [ErrorFeedback(n, acc_dtype_for(dt), xp)
                             for (n, dt, _), (_, _, xp) in zip(layout, views)]
            self.last_stats = [None] * len(views)
        self._views, self._layout = views, layout
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._load_buckets(state)
        elif tree is not None and tree in self._trees:
            self._load_buckets(self._trees.pop(tree))

    def replanned(self, moves: Sequence[Move]) -> None:
        """Each parameter's residual moves with it to its place in the new plan; a new bucket's
        selector continues the step and threshold of the old bucket most of its elements come from
        (partition boundaries start afresh, as for another world size's state).  A parameter new to
        training starts from a zero residual."""
        before, self._before = self._before, None
        if before is None:
            return
        feedback, selectors = before
        sources: dict[int, dict[int, int]] = {}
        for m in moves:
            old, new = feedback[m.old_bucket], self.feedback[m.bucket]
            if old.xp is new.xp:    # a move to another device starts afresh
                new.residual[m.offset:m.offset + m.numel] = old.residual[m.old_offset:m.old_offset + m.numel]
            counts = sources.setdefault(m.bucket, {})
            counts[m.old_bucket] = counts.get(m.old_bucket, 0) + m.numel
        for b, counts in sources.items():
            self.selectors[b].load_state_dict(selectors[max(counts, key=counts.get)].state_dict(),
                                              same_world=False)

    def launch(self, b: int) -> None:
        data, dtype, xp = self._views[b]
        fb = self.feedback[b]
        grad = read_as(xp, data, dtype, fb.residual.dtype) if dtype == "bfloat16" else data
        if not self._finite_everywhere(b, grad):
            # a rank's gradient overflowed (inf or NaN, as fp16 loss scaling makes on purpose): the
            # dense average, as DDP's, carries it to every rank (GradScaler and apply_if_finite
            # skip the step everywhere); residuals and selectors stay as they were, not poisoned
            self.comm.allreduce(self.grads[b], "avg", out=self.grads[b], tag=f"{self.name}:dense{b}")
            self.stats["bytes"] += 2 * data.nbytes * (self.comm.size - 1) / self.comm.size
            self.stats["nonfinite_steps"] += 1
            return
        acc = fb.accumulate(grad)
        out = self.selectors[b].reduce(acc)
        if out.indices is None:
            data[...] = write_as(xp, out.values, dtype)
        else:
            data[...] = 0
            data[out.indices] = write_as(xp, out.values, dtype)
        fb.settle(out)
        self.stats["bytes"] += out.stats.bytes
        self.last_stats[b] = out.stats
        if self.keep_history:
            while len(self.history) <= b:
                self.history.append([])
            self.history[b].append(out.stats)

    def rescale_gradients(self, factor: float) -> None:
        """Residuals and selectors' thresholds follow gradients that come ``factor`` times larger
        (a changed loss scale), so that the scaled run selects and carries what the unscaled one does."""
        for fb, sel in zip(self.feedback, self.selectors):
            fb.rescale(factor)
            sel.rescale(factor)

    def _finite_everywhere(self, b: int, grad: Any) -> bool:
        """Whether every rank's gradient of bucket ``b`` is finite (one 4-byte all-reduce)."""
        flag = np.zeros(1, np.int32) if all_finite(self._views[b][2], grad) else np.ones(1, np.int32)
        return not self.comm.allreduce(flag, "max", out=flag, tag=f"{self.name}:finite{b}")[0]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Steps; per bucket the selector's state (threshold, boundaries, step) and this rank's residual."""
        state = super().state_dict()
        state.update({
            "selector": repr(self.selector),
            "rank": None if self.comm is None else self.comm.rank,
            "world_size": None if self.comm is None else self.comm.size,
            "buckets": self._buckets_state(),
            # where one binding averages several named trees: the one set up now, and the others'
            # (each as _tree_record(): saved by which rank, at which world size, its buckets)
            "tree": self.tree, "trees": dict(self._trees),
        })
        return state

    def _buckets_state(self) -> list[dict[str, Any]]:
        return [{"numel": n, "elements": b.numel, "dtype": dt, "selector": s.state_dict(),
                 "feedback": f.state_dict()}
                for (n, dt, _), b, s, f in zip(self._layout, self.buckets, self.selectors, self.feedback)]

    def _tree_record(self) -> dict[str, Any]:
        """The state of the tree set up now, as its entry in ``state_dict()['trees']`` while another
        tree is set up (loaded by :meth:`_load_buckets` at its next setup)."""
        return {"selector": repr(self.selector), "rank": self.comm.rank, "world_size": self.comm.size,
                "buckets": self._buckets_state()}

    def check_state(self, state: dict[str, Any]) -> None:
        """As :meth:`Strategy.check_state`, and once set up, every bucket's selector and residual
        state too: a checkpoint of other buckets or selector settings is refused before anything
        of it is loaded."""
        super().check_state(state)
        if self.comm is not None:
            self._saved_buckets(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.comm is None:
            self._pending = state                # applied by setup()
        else:
            self._load_buckets(state)

    def _tree_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """What ``state`` holds for the tree set up now: itself where it was saved with that tree
        set up, else that tree's entry among its ``trees``, else no buckets (a tree not averaged
        yet when it was saved)."""
        if "tree" not in state or state["tree"] == self.tree:
            return state
        return (state.get("trees") or {}).get(self.tree) or {**state, "buckets": []}

    def _saved_buckets(self, state: dict[str, Any]) -> tuple[list[dict[str, Any]], bool, str]:
        """``state``'s buckets for the tree set up now (:meth:`_tree_state`), whether it was saved
        at this world size and, where it is another rank's, whose (:func:`saved_elsewhere`); raises
        unless each fits its bucket here."""
        state = self._tree_state(state)
        saved = state.get("buckets", [])
        same_world = state.get("world_size") == self.comm.size
        elsewhere = saved_elsewhere(state.get("rank"), state.get("world_size"), self.comm)
        if not saved:
            return saved, same_world, elsewhere
        if same_world:      # buckets as padded to a multiple of the world size
            got = [(int(s["numel"]), s["dtype"]) for s in saved]
            want = [(n, dt) for n, dt, _ in self._layout]
        else:               # the elements the buckets hold (their padding depends on the world size)
            got = [(int(s.get("elements", s["numel"])), s["dtype"]) for s in saved]
            want = [(b.numel, dt) for b, (_, dt, _) in zip(self.buckets, self._layout)]
        if got != want:
            raise ValueError(f"{self.name}: state of buckets {got} given to buckets {want}")
        for s, sel, fb in zip(saved, self.selectors, self.feedback):
            sel.check_state(s["selector"], same_world)
            if not elsewhere:
                fb.check_state(s["feedback"])
        return saved, same_world, elsewhere

    def _load_buckets(self, state: dict[str, Any]) -> None:
        saved, same_world, elsewhere = self._saved_buckets(state)
        if "tree" in state:     # the other trees' state waits for their setup (loaded as this one is)
            top = {k: state[k] for k in ("selector", "rank", "world_size", "buckets") if k in state}
            others = {state["tree"]: top, **(state.get("trees") or {})}
            if self.tree not in others:
                warnings.warn(f"{self.name}: the state holds none of the tree {self.tree!r} (only of "
                              f"{[k for k in others if k is not None]}: a tree not averaged yet when it "
                              "was saved, or another model's): its residuals and thresholds start afresh",
                              stacklevel=3)
            self._trees = {k: v for k, v in others.items() if k is not None and k != self.tree}
            state = self._tree_state(state)
        if not saved:
            return
        saved_as = state.get("selector")
        if saved_as is not None and saved_as != repr(self.selector):
            warnings.warn(f"{self.name}: state of {saved_as} loaded into {self.selector!r}: its step and "
                          "threshold go on under the new settings", stacklevel=3)
        if elsewhere:
            warnings.warn(f"{self.name}: {elsewhere}: residuals start from zero" + (
                "" if same_world else ", partition boundaries from the start"), stacklevel=3)
        for s, sel, fb in zip(saved, self.selectors, self.feedback):
            sel.load_state_dict(s["selector"], same_world)
            if not elsewhere:
                fb.load_state_dict(s["feedback"])
            else:
                fb.residual[...] = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(selector={self.selector!r}, {self._caps()})"
