"""Parameters a step's update leaves out, as one process leaves out those whose ``.grad`` is ``None``;
parameters of the model the optimizer never updates (:class:`OutsideParameters`).

In one process, a parameter that no loss reached since ``zero_grad()`` (an unused
head, an expert no token was routed to, a branch taken at some steps only) has
``.grad is None``, and the optimizer skips it: no momentum, no weight decay.  Under
data parallelism a rank that did not reach it gives zeros, which average right when
another rank did; :class:`UnusedParameters` finds those no rank reached, which the
update must leave out.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

import commlib

from .torch_owners import owner_of

__all__ = ["UnusedParameters", "OutsideParameters"]


class UnusedParameters:
    """Which trained parameters this step's update leaves out (:attr:`indices`), found after the
    reduction on every rank: those no rank gave a gradient this step (one small all-reduce
    every step, so that a graph that changes from step to step is right at every step) and none
    since ``zero_grad(set_to_none=True)`` (after ``zero_grad(set_to_none=False)`` one process
    updates them with a zero gradient).  On a step whose update reads each rank's own gradient
    (SelSync's local steps, Sync-Switch's ASP) this rank's own, with no collective that
    asynchronous ranks never meet.  ``expected`` (``find_unused_parameters``): no warning when
    the first step finds some.

    Example:
        >>> unused = UnusedParameters(comm, expected=False)
        >>> unused.find(params, got, local=False, model=model, grads=None)   # after the reduction
        >>> for i in unused.indices: params[i].grad = None          # out of this update
    """

    def __init__(self, comm: commlib.Communicator, expected: bool) -> None:
        self.comm = comm
        self.expected = expected
        #: the parameters (indices) this step's update leaves out
        self.indices: set[int] = set()
        #: those no rank gave a gradient whose exchanged gradient is not zero (a sparse residual sent)
        self.sent: set[int] = set()
        self._checked = False       # the first step looked (and warned, unless expected)
        self._had: set[int] = set()     # ids of parameters some rank gave a gradient since zeroed

    def had_gradient(self, p: torch.Tensor) -> bool:
        """Whether some rank gave ``p`` a gradient since ``.grad`` was last set to ``None`` (one
        process's ``.grad`` is a tensor then, ``None`` before)."""
        return id(p) in self._had

    def zeroed(self) -> None:
        """``zero_grad(set_to_none=True)``: one process's ``.grad`` is ``None`` everywhere again."""
        self._had.clear()

    def replanned(self) -> None:
        """The parameters' indices changed: nothing left out yet, and the next step looks afresh."""
        self.indices, self.sent, self._checked = set(), set(), False

    def find(self, params: Sequence[torch.nn.Parameter], got: Sequence[bool], local: bool,
             model: torch.nn.Module, grads: Sequence[torch.Tensor] | None,
             also: Sequence[int] = ()) -> np.ndarray | None:
        """This step's :attr:`indices`, from ``got`` (whether this rank gave each a gradient): a
        collective unless ``local``.  ``grads``: the gradients the update reads, where they are
        whole (not under a sharded strategy); one that is not zero stays in the update though no
        rank gave a gradient (a sparse strategy's error feedback sent the parameter's residual).
        ``also``: other small integers to agree on in the same all-reduce; returns their max over
        the ranks (``None`` when ``local``)."""
        agreed = None
        if local:
            used = got
        else:
            both = self.comm.allreduce(np.array([*got, *also], np.int32), "max", tag="unused")
            used, agreed = both[:len(got)], both[len(got):]
        had = self._had
        idle = [i for i, u in enumerate(used) if not u]
        self.sent = {i for i in idle if grads is not None and bool(grads[i].any())}
        self.indices = {i for i in idle
                        if i not in self.sent and (id(params[i]) not in had or params[i].grad is None)}
        had.update(id(params[i]) for i, u in enumerate(used) if u)
        if local:
            return agreed
        if self.indices and not self._checked and not self.expected:
            names = {id(p): n for n, p in model.named_parameters()}
            listed = ", ".join(names.get(id(params[i]), f"#{i}") for i in sorted(self.indices))
            warnings.warn(f"DistributedOptimizer: no rank gave a gradient to {listed} in the first step; "
                          "they are left out of the update as single-process training leaves them "
                          "(pass find_unused_parameters=True to say that you expect it, or leave them "
                          "out of the optimizer)", stacklevel=3)
        self._checked = True
        return agreed


class OutsideParameters:
    """Parameters of ``model`` outside the optimizer that still require a gradient (a body left out of
    a fine-tuned head's optimizer, not frozen): :meth:`average` makes their ``.grad`` the average over
    the ranks at the end of a synchronous backward, as DDP averages every parameter of the model, so
    that a norm over ``model.parameters()`` (``clip_grad_norm_``) is one process's on every rank.  A
    parameter some rank gave no gradient counts as zeros there and has the average after, as one
    process has one.  Those another ``DistributedOptimizer`` trains (two optimizers over one model: a
    GAN's generator and discriminator) are left to it.  ``.grad`` accumulates as in one process (the
    optimizer's ``zero_grad`` leaves it): the average of an already averaged ``.grad`` plus this step's
    pass is that plus the pass's average.  One all-reduce per dtype, none where there are none.

    Example:
        >>> outside = OutsideParameters(comm, model, trained={id(p) for p in opt_params})
        >>> outside.average(local=False)      # every rank, at the end of a synchronous backward
    """

    def __init__(self, comm: commlib.Communicator, model: torch.nn.Module, trained: set[int]) -> None:
        self.comm = comm
        #: the model's parameters the optimizer does not hold
        self.params = [p for p in model.parameters() if id(p) not in trained]

    def trained(self) -> list[torch.nn.Parameter]:
        """Those that require a gradient now and that no other optimizer trains (averaged here)."""
        return [p for p in self.params if p.requires_grad and owner_of(p) is None]

    def average(self, local: bool) -> None:
        """Average the ``.grad`` of those that require a gradient now (a call every rank makes), unless
        ``local``: a step whose update reads each rank's own gradient (SelSync's local steps, ASP).
        One all-reduce per dtype and device, in that dtype (a complex one as its real pairs)."""
        if local:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in self.trained():
            groups.setdefault((p.dtype.to_real(), p.device), []).append(p)
        for (dtype, device), live in groups.items():           # the same order on every rank
            parts = [_real(p.grad).reshape(-1).to(device, dtype) if p.grad is not None else
                     torch.zeros(p.numel() * (2 if p.is_complex() else 1), dtype=dtype, device=device)
                     for p in live]
            buf = torch.cat([*parts, torch.tensor([float(p.grad is not None) for p in live], dtype=dtype,
                                                  device=device)])
            self.comm.allreduce(buf, "sum", out=buf, tag="outside")
            some = (buf[-len(live):] > 0).tolist()          # some rank gave it a gradient
            buf.div_(self.comm.size)
            at = 0
            for p, part, got in zip(live, parts, some):
                avg = buf[at:at + part.numel()]
                at += part.numel()
                if not got:        # no rank gave it a gradient: None (or zeros) stays, as in one process
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _real(p.grad).copy_(avg.view(_real(p.grad).shape))


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real pairs (a view), another as it is."""
    return torch.view_as_real(t) if t.is_complex() else t
