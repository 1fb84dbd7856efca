"""The selector interface: select from an accumulated gradient, exchange, report.

A :class:`Selector` owns one flat vector's selection state (threshold,
partition boundaries, step) and its exchange; error feedback (the residual)
is a separate role (:class:`sparsify.ErrorFeedback`), as in GRACE.  Each
step, :meth:`Selector.reduce` is a collective: every rank calls it with its
own accumulated gradient ``acc`` (gradient + residual) and gets the same
:class:`Reduced`: the union of selected indices and the average over ranks
of ``acc`` there, exact on the union.

Per step each selector reports a :class:`StepStats`.
"""

from __future__ import annotations

import copy
import numbers
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from commlib import Communicator

from ._arrays import ACC_DTYPES, index_dtype, is_array_of
from .exchange import Traffic, exchange_records


def check_density(density: Any) -> float:
    """``density`` as a float in (0, 1], else ``ValueError`` (a string, a bool: not a number)."""
    if not isinstance(density, numbers.Real) or isinstance(density, (bool, np.bool_)):
        raise ValueError(f"density {density!r}: expected a number in (0, 1]")
    d = float(density)
    if not 0.0 < d <= 1.0:
        raise ValueError(f"density {density!r}: expected a number in (0, 1]")
    return d


@dataclass
class StepStats:
    """What one step of a selector did (identical on every rank except ``selected`` and the times).

    ``selected``: this rank's count; ``union``: distinct indices exchanged;
    ``sum_selected``: the ranks' counts added up; ``density``: union / numel;
    ``density_error``: density / target - 1; ``buildup``: union / k (top-k's
    "gradient build-up" reaches n); ``duplication``: sum_selected / union (1
    for disjoint selections); ``bytes``: sent by this rank (ring model);
    ``select_s``/``exchange_s``: local selection and communication time;
    ``imbalance``: max(count) n / total - 1 over the partitions (partitioned
    selectors); ``threshold``: the threshold used (threshold selectors).
    """

    selector: str
    step: int
    numel: int
    k: int
    selected: int
    union: int
    sum_selected: int
    density: float
    target_density: float
    density_error: float
    buildup: float
    duplication: float
    bytes: float
    select_s: float
    exchange_s: float
    threshold: float | None = None
    imbalance: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Reduced:
    """The result of a step: ``values`` (averaged over ranks) at ``indices`` (the union).

    ``indices is None`` means every element (dense); ``local`` holds this
    rank's own selection (before the exchange), for inspection.
    """

    indices: Any
    values: Any
    local: Any
    stats: StepStats

    def scatter_into(self, out: Any) -> Any:
        """Write the sparse result into flat ``out`` densely (zeros off the union); returns ``out``."""
        if self.indices is None:
            out[...] = self.values
        else:
            out[...] = 0
            out[self.indices] = self.values
        return out


class Selector:
    """Base of every selector.  Subclasses implement :meth:`_reduce`.

    ``density``: the target fraction of elements exchanged per step, in (0, 1].

    Lifecycle::

        sel = ExDyna(density=0.01)
        sel.setup(comm, numel)             # numpy; setup(comm, numel, xp=cupy) on the GPU
        out = sel.reduce(acc)              # collective; out.indices, out.values, out.stats
    """

    name = "selector"

    def __init__(self, density: float = 0.01):
        self.density = check_density(density)
        self.comm: Communicator | None = None
        self.numel = 0
        self.xp: Any = np
        self.step = 0
        self.last: StepStats | None = None

    # ------------------------------------------------------------------ setup
    def config(self) -> dict[str, Any]:
        """The constructor arguments (a selector is rebuilt from them by :meth:`clone`)."""
        return {"density": self.density}

    def clone(self) -> "Selector":
        """A fresh selector with this one's settings (no state)."""
        return type(self)(**copy.deepcopy(self.config()))

    def setup(self, comm: Communicator, numel: int, xp: Any = np) -> "Selector":
        """Bind to ``comm`` and a vector of ``numel`` elements held in ``xp`` arrays (numpy or cupy)."""
        if int(numel) < 1:
            raise ValueError(f"{self.name}: numel {numel!r}: expected >= 1 element")
        self.comm = comm
        self.numel = int(numel)
        self.xp = xp
        self.index_dtype = index_dtype(self.numel)
        self.k = max(1, int(round(self.density * self.numel)))
        self.step = 0
        self._setup()
        return self

    def _setup(self) -> None:
        """Subclass hook after the common setup."""

    # ------------------------------------------------------------------ step
    def validate(self, acc: Any) -> str | None:
        """Why ``acc`` cannot be reduced on this rank (``None``: fine).  Local, no communication."""
        xp = self.xp
        if not is_array_of(acc, xp):
            return (f"expected a flat {xp.__name__} array (the device given at setup), "
                    f"got {type(acc).__module__}.{type(acc).__name__}")
        if acc.ndim != 1 or acc.size != self.numel:
            return f"expected a flat vector of {self.numel} elements, got shape {tuple(acc.shape)}"
        if acc.dtype.name not in ACC_DTYPES:
            return f"dtype {acc.dtype.name} is not supported; use one of {', '.join(ACC_DTYPES)}"
        return None

    def reduce(self, acc: Any) -> Reduced:
        """Select from ``acc``, exchange, return the union and the averaged values there.

        Collective: every rank calls it with its own ``acc`` (flat, ``numel``
        elements, float16/32/64, on the setup device); ``acc`` is not
        modified.  Bad input on any rank raises :class:`commlib.ValidationError`
        on every rank before any data moves.
        """
        if self.comm is None:
            raise RuntimeError(f"{self.name}: call setup(comm, numel) before reduce()")
        problem = self.validate(acc)
        traffic = Traffic(self.comm.size)
        t0 = time.perf_counter()
        out = self._reduce(acc, problem, traffic)
        total = time.perf_counter() - t0
        st = out.stats
        st.bytes = traffic.bytes
        st.exchange_s = max(total - st.select_s, 0.0)
        self.last = st
        self.step += 1
        return out

    def _reduce(self, acc: Any, problem: str | None, traffic: Traffic) -> Reduced:
        raise NotImplementedError

    def _reduce_dense(self, acc: Any, problem: str | None, traffic: Traffic) -> Reduced:
        """Everything, all-reduced (``avg``): :class:`Dense`'s step, and a partitioned selector's
        where ``k`` is every element (``density=1``: a threshold would leave the zeros and, while
        it settles, the smallest values behind)."""
        comm = self.comm
        exchange_records(comm, [], 1, problem, self.name, traffic)
        values = acc.copy()
        comm.allreduce(values, "avg", out=values, tag=f"{self.name}:values")
        traffic.allreduce(values.nbytes)
        n = self.numel
        stats = self._stats(n, n, n * comm.size, 0.0)
        return Reduced(None, values, None, stats)

    def _stats(self, selected: int, union: int, sum_selected: int, select_s: float,
               **kw: Any) -> StepStats:
        density = union / self.numel
        return StepStats(
            selector=self.name, step=self.step, numel=self.numel, k=self.k, selected=int(selected),
            union=int(union), sum_selected=int(sum_selected), density=density,
            target_density=self.density, density_error=density / self.density - 1.0,
            buildup=union / self.k, duplication=(sum_selected / union) if union else 1.0,
            bytes=0.0, select_s=select_s, exchange_s=0.0, **kw)

    # ------------------------------------------------------------------ state
    def rescale(self, factor: float) -> None:
        """The accumulated gradients come ``factor`` times larger from now on (a changed loss scale):
        state in their units follows (a threshold).  Default: none (the selection is scale-free)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (plain Python values and numpy arrays)."""
        return {"name": self.name, "step": self.step, "numel": self.numel, "density": self.density}

    def check_state(self, state: dict[str, Any], same_world: bool = True) -> None:
        """Raise unless :meth:`load_state_dict` takes ``state`` (it checks first, so that a refused
        state changes nothing: the strategy asks every bucket's selector before it loads any)."""
        if state.get("name") != self.name:
            raise ValueError(f"state of selector {state.get('name')!r} given to {self.name!r}")
        if self.comm is None:
            raise RuntimeError(f"{self.name}: call setup(comm, numel) before load_state_dict()")
        if same_world and int(state["numel"]) != self.numel:    # elsewhere: padded to another size
            raise ValueError(f"{self.name}: state for {state['numel']} elements given to a selector "
                             f"of {self.numel}")

    def load_state_dict(self, state: dict[str, Any], same_world: bool = True) -> None:
        """Continue from ``state``.  ``same_world=False``: it was saved at another
        world size, or over another bucket layout (a re-plan), so only what does not depend
        on the ranks or the layout is taken (the step, the threshold; partition boundaries
        start afresh)."""
        self.check_state(state, same_world)
        self.step = int(state["step"])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"
