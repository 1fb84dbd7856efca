"""Normalization statistics across ranks: ``SyncBatchNorm`` (re-exported by :mod:`bindings.torch`),
and :class:`RunningStats`, which keeps plain norm layers' running statistics the same on every rank.

``SyncBatchNorm`` normalizes with the mean and variance of the global batch,
as one process training on the concatenated batch does, where ``BatchNorm``
under data parallelism sees only its rank's slice.  It is torch's
``nn.SyncBatchNorm`` (and Horovod's ``hvd.SyncBatchNorm``) over a commlib
communicator, on CPU and GPU tensors alike.

* forward (training mode): each rank's per-channel mean, variance and count in
  one small all-gather (``2C + 2`` float64 per rank), combined exactly
  (Chan's parallel variance, so ranks may hold different batch sizes);
  running statistics are updated from the global ones (unbiased variance
  over the global count), the same on every rank;
* backward: the two per-channel sums the input gradient needs in one
  all-reduce (``2C``); the weight and bias gradients stay local sums, which
  the gradient averaging of :class:`~bindings.torch.DistributedOptimizer`
  turns into the single-process ones;
* evaluation (``model.eval()``) uses the running statistics, with no
  communication, as ``BatchNorm`` does.

Its collectives run on a communicator split once from ``comm`` and shared by
every ``SyncBatchNorm`` layer over it (closed with ``comm``), so that they do
not queue behind the gradient communication in flight (DeAR's all-gathers
overlapping the forward).

Example:
    >>> from commlib.bindings.torch import DistributedOptimizer, SyncBatchNorm
    >>> model = SyncBatchNorm.convert_sync_batchnorm(model)     # every BatchNorm*d layer
    >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

import commlib
from commlib.side import side_comm

from .torch_comm import wire_dtype
from .torch_join import repeating

__all__ = ["SyncBatchNorm", "RunningStats"]

#: what ``broadcast_buffers`` may say: norm layers' running statistics, every buffer, none
BUFFER_CHOICES = (True, "all", False)

class _CommRef:
    """A layer's communicator, held so that copies of the layer (``copy.deepcopy``: an EMA of the
    model) share it, and a pickled layer (``torch.save(model)``) loads with the default one."""

    __slots__ = ("comm",)

    def __init__(self, comm: commlib.Communicator | None):
        self.comm = comm

    def __deepcopy__(self, memo: dict) -> "_CommRef":
        return self

    def __reduce__(self) -> tuple:
        return (_CommRef, (None,))


#: whether torch's ``_BatchNorm`` takes ``bias`` (torch 2.13 and newer)
_BASE_TAKES_BIAS = "bias" in inspect.signature(torch.nn.modules.batchnorm._BatchNorm.__init__).parameters


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """``BatchNorm1d/2d/3d`` whose training-mode statistics are those of every rank's batch together.

    Takes ``BatchNorm``'s arguments (input ``(N, C, ...)``) plus ``comm``, the
    communicator (default :func:`commlib.init`'s).  Every rank must run the same
    training-mode forwards, in the same order (each is a collective); batch
    sizes may differ across ranks.  An input that does not fit raises
    ``ValueError`` on every rank, naming the ranks.  A deep copy of the layer
    (an EMA model) shares its communicator; a pickled one loads with the default.

    Example:
        >>> bn = SyncBatchNorm(64)                      # in place of torch.nn.BatchNorm2d(64)
        >>> model = SyncBatchNorm.convert_sync_batchnorm(model)
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 comm: commlib.Communicator | None = None, device: Any = None, dtype: Any = None,
                 *, bias: bool = True):
        if _BASE_TAKES_BIAS:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype,
                             bias=bias)
        else:   # torch before 2.13 has no ``bias`` argument: drop the parameter as 2.13 does
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
            if affine and not bias:
                self.bias = None
        self._comm = _CommRef(comm)

    @property
    def comm(self) -> commlib.Communicator | None:
        """The communicator given (``None``: :func:`commlib.init`'s)."""
        return self._comm.comm

    @comm.setter
    def comm(self, comm: commlib.Communicator | None) -> None:
        self._comm = _CommRef(comm)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(self._problem(input))

    def _problem(self, input: torch.Tensor) -> str:
        if input.dim() < 2:
            return f"expected at least 2D input (got {input.dim()}D input)"
        if input.size(1) != self.num_features:
            return f"expected {self.num_features} channels (got input of shape {tuple(input.shape)})"
        return ""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; in training mode with the global batch's statistics (a collective)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            if self.momentum is None:       # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        comm = (self.comm or commlib.init()) if bn_training and self.training else None
        if comm is None or comm.size == 1:
            self._check_input_dim(input)
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, factor, self.eps)
        return _sync_batch_norm(input, self.weight, self.bias, running_mean, running_var, self.eps,
                                factor, comm, self._problem(input), self.num_features)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               comm: commlib.Communicator | None = None) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` layer in ``module`` by a ``SyncBatchNorm`` sharing its
        parameters and buffers (torch's ``nn.SyncBatchNorm.convert_sync_batchnorm``).

        Returns ``module`` (or the new layer, if ``module`` itself is a ``BatchNorm``).
        Convert before wrapping the optimizer: the parameters stay the same objects.

        Example:
            >>> model = SyncBatchNorm.convert_sync_batchnorm(torchvision.models.resnet18())
        """
        out = module
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, comm, bias=module.bias is not None)
            if module.affine:
                out.weight = module.weight
                out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, comm))
        return out


@torch.compiler.disable     # communicates: run eagerly, never traced by torch.compile
def _sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                     factor: float, comm: commlib.Communicator, problem: str, c: int) -> torch.Tensor:
    """The statistics over ``comm``'s side communicator (split at the first call, a collective:
    never traced either, so that the first forward of a compiled model splits it eagerly)."""
    return _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, eps, factor,
                                side_comm(comm, "syncbn"), problem, c, repeating(comm))


class _SyncBatchNorm(torch.autograd.Function):
    """Training-mode batch normalization over every rank's batch (float32 arithmetic for 16-bit input).

    Local statistics are two-pass (mean, then the mean squared deviation).  Each pass allocates
    one tensor of the input's size and works in place on it: on CPU a fresh large allocation
    costs page faults that can exceed the arithmetic."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                factor: float, comm: commlib.Communicator, problem: str, c: int,
                repeat: bool) -> torch.Tensor:
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        row = torch.zeros(2 * c + 2, dtype=torch.float64, device=x.device)
        n = 0 if problem or repeat else x.numel() // c     # a repeated batch (join): no part in them
        dims = [0, *range(2, x.dim())]
        shape = (1, c) + (1,) * (x.dim() - 2)
        xc = x.to(cd)
        out = None
        if n:      # the output's buffer holds the squared deviations first: one large allocation
            mean = xc.sum(dims).div_(n)
            out = torch.sub(xc, mean.view(shape))
            row[:c], row[c:2 * c] = mean, out.square_().sum(dims).div_(n)
        row[2 * c], row[2 * c + 1] = n, bool(problem)
        table = comm.allgather(row, tag="syncbn.stats")
        flags = table[:, 2 * c + 1].tolist()
        if any(flags):
            bad = ", ".join(str(r) for r, f in enumerate(flags) if f)
            raise ValueError(f"SyncBatchNorm: ranks {bad} rejected their input"
                             + (f" (here: {problem})" if problem else ""))
        counts = table[:, 2 * c]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(total)} "
                             f"over all ranks (input of shape {tuple(x.shape)} here)")
        w = (counts / total)[:, None]
        means, variances = table[:, :c], table[:, c:2 * c]
        gmean = (w * means).sum(0)
        gvar = (w * (variances + (means - gmean) ** 2)).sum(0)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - factor).add_(gmean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_((gvar * (total / (total - 1))).to(running_var.dtype),
                                              alpha=factor)
        mean, invstd = gmean.to(cd), torch.rsqrt(gvar + eps).to(cd)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.comm, ctx.total, ctx.has_bias, ctx.repeat = comm, total, bias is not None, repeat
        scale = invstd if weight is None else invstd * weight.to(cd)
        shift = -mean * scale if bias is None else bias.to(cd) - mean * scale
        out = torch.mul(xc, scale.view(shape), out=out).add_(shift.view(shape))
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        cd, c = mean.dtype, mean.numel()
        shape = (1, c) + (1,) * (x.dim() - 2)
        dims = [0, *range(2, x.dim())]
        dyc, xc = dy.to(cd), x.to(cd)
        buf = torch.sub(xc, mean.view(shape))    # the input gradient's buffer: one large allocation
        sums = torch.cat([dyc.sum(dims), buf.mul_(dyc).sum(dims)])   # sum dy, sum dy * (x - mean)
        grad_w = grad_b = grad_x = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (sums[c:] * invstd).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = sums[:c].to(weight.dtype)
        if ctx.needs_input_grad[0]:     # the same on every rank: the same model
            mine = torch.zeros_like(sums) if ctx.repeat else sums      # a repeated batch (join): none
            means = ctx.comm.allreduce(mine, tag="syncbn.grad") / ctx.total
            scale = invstd if weight is None else invstd * weight.to(cd)
            # dx = scale * (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean)))
            k = invstd * invstd * means[c:]
            grad_x = torch.sub(xc, mean.view(shape), out=buf).mul_(-k.view(shape)).add_(dyc)
            grad_x = grad_x.sub_(means[:c].view(shape)).mul_(scale.view(shape)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None


class RunningStats:
    """Rank 0's buffers on every rank after each step, as DDP's ``broadcast_buffers``.

    Plain ``BatchNorm`` (and ``InstanceNorm`` with ``track_running_stats``)
    layers update their running statistics from their rank's slice, so without
    this each rank would evaluate a model of its own, and a checkpoint saved on
    rank 0 and resumed would change the other ranks' statistics (the resumed
    run would not be the uninterrupted one).  ``which``: ``True`` sends the
    running statistics of the norm layers in training mode (``SyncBatchNorm``'s
    are the same everywhere already); ``"all"`` every buffer of the model
    (DDP's rule: also a module's own running averages, at the cost of sending
    constant masks too); ``False`` none (Horovod's rule).  One broadcast per
    dtype, called by the binding at each ``step()`` while no gradient
    communication is in flight; ``lockstep=False`` (SelSync, Sync-Switch: replicas
    drift between synchronizations, ASP's ranks do not step together) sends nothing.

    Example:
        >>> stats = RunningStats(model, comm, True)
        >>> stats.sync()                 # a collective: every rank, at the same step
    """

    def __init__(self, model: torch.nn.Module, comm: commlib.Communicator, which: bool | str,
                 lockstep: bool = True):
        if not any(which is c for c in BUFFER_CHOICES):
            raise ValueError(f"broadcast_buffers {which!r}: expected True (norm layers' running "
                             "statistics), 'all' (every buffer) or False")
        torch_sync = [name for name, m in model.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
        if torch_sync and comm.size > 1 and not (torch.distributed.is_available()
                                                 and torch.distributed.is_initialized()):
            # (the same on every rank: the model's structure and torch.distributed's state)
            raise ValueError(
                f"the model has torch.nn.SyncBatchNorm layers ({', '.join(torch_sync[:4])}"
                f"{', ...' if len(torch_sync) > 4 else ''}), which synchronize over torch.distributed's "
                "process group; none is initialized, so each would normalize with its rank's own batch "
                "and keep its own running statistics (the replicas drift apart, silently): convert the "
                "model with commlib.bindings.torch.SyncBatchNorm.convert_sync_batchnorm(model), "
                "before wrapping it")
        self.model, self.comm, self.which = model, comm, which
        #: the ranks step together (False: a strategy whose replicas drift; nothing is sent)
        self.lockstep = lockstep
        #: the model's plain norm layers that track running statistics (the model's structure is fixed)
        self._norms = [m for m in model.modules()
                       if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats
                       and not isinstance(m, (SyncBatchNorm, torch.nn.SyncBatchNorm))]

    def buffers(self) -> list[torch.Tensor]:
        """The buffers :meth:`sync` sends now (the same list on every rank: model structure and modes)."""
        if self.which is False:
            return []
        if self.which == "all":
            return list(self.model.buffers())
        return [b for m in self._norms if m.training
                for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]

    @torch.no_grad()
    def sync(self, root: int = 0) -> None:
        """Give every rank ``root``'s buffers now (a collective; nothing to send: no communication)."""
        if self.comm.size == 1 or not self.lockstep:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in self.buffers():
            b = torch.view_as_real(b) if b.is_complex() else b      # a view: written through
            groups.setdefault((b.dtype, b.device), []).append(b)
        src, root = root, self.comm.rank == root
        for (dtype, device), bufs in groups.items():
            wire = wire_dtype(dtype)
            sizes = [b.numel() for b in bufs]
            flat = (torch.cat([b.reshape(-1).to(wire) for b in bufs]) if root
                    else torch.empty(sum(sizes), dtype=wire, device=device))
            self.comm.broadcast(flat, src, out=flat, tag="buffers")
            if not root:
                torch._foreach_copy_(bufs, [p.view(b.shape) for b, p in zip(bufs, flat.split(sizes))])
