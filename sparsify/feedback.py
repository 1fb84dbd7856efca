"""Error feedback: what a step did not send is kept and added to the next step's gradient.

``acc = gradient + residual`` is what a selector selects from; after the
exchange the residual is ``acc`` with every globally selected index (the
union) cleared, on every rank.  The values at the union are the average of
every rank's ``acc`` there, so nothing is lost: summed over ranks and steps,
the applied updates (times n) plus the residuals equal the gradients.

Example:
    >>> fb = ErrorFeedback(grad.size)
    >>> acc = fb.accumulate(grad)          # the residual buffer, now holding grad + residual
    >>> out = selector.reduce(acc)
    >>> fb.settle(out)                     # residual = acc, union cleared
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import module_by_device, to_host
from .base import Reduced


class ErrorFeedback:
    """The residual of one flat vector (``numel`` elements of ``dtype`` in ``xp`` arrays).

    The residual buffer doubles as the accumulator: :meth:`accumulate` adds
    the gradient in place and returns the buffer, so error feedback costs one
    vector of memory, not three.
    """

    def __init__(self, numel: int, dtype: Any = np.float32, xp: Any = np):
        if int(numel) < 1:
            raise ValueError(f"numel {numel!r}: expected >= 1")
        self.numel = int(numel)
        self.xp = xp
        self.residual = xp.zeros(self.numel, dtype=np.dtype(dtype))

    def accumulate(self, grad: Any) -> Any:
        """``residual += grad`` in place (``grad`` flat, same module; any float dtype); returns it."""
        if grad.shape != (self.numel,):
            raise ValueError(f"accumulate: expected a flat gradient of {self.numel} elements, "
                             f"got shape {tuple(grad.shape)}")
        self.residual += grad
        return self.residual

    def settle(self, reduced: Reduced) -> None:
        """Clear what was exchanged: the union (everything for a dense step)."""
        if reduced.indices is None:
            self.residual[...] = 0
        else:
            self.residual[reduced.indices] = 0

    def rescale(self, factor: float) -> None:
        """The gradients come ``factor`` times larger from now on: the residual follows."""
        self.residual *= factor

    def state_dict(self) -> dict[str, Any]:
        """The residual as a host (numpy) copy: exact."""
        return {"residual": np.array(to_host(self.residual), copy=True)}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise unless :meth:`load_state_dict` takes ``state`` (changing nothing)."""
        shape = np.shape(state["residual"])
        if shape != (self.numel,):
            raise ValueError(f"residual of shape {shape} given to a vector of {self.numel} elements")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        r = np.asarray(state["residual"])
        self.residual[...] = self.xp.asarray(r.astype(self.residual.dtype, copy=False))

    @classmethod
    def on(cls, device: str, numel: int, dtype: Any = np.float32) -> "ErrorFeedback":
        """An error feedback on ``device`` (``"cpu"`` or ``"cuda"``)."""
        return cls(numel, dtype, module_by_device(device))
