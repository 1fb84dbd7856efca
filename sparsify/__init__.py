"""Which values travel: gradient sparsification with error feedback (ExDyna and baselines).

A *selector* picks, each step, the elements of a flat accumulated gradient
that travel, exchanges them over a :class:`commlib.Communicator` and returns
the union of indices with the values averaged over ranks; an
:class:`ErrorFeedback` keeps what was not sent; :class:`SparseAllReduce`
puts both into the strategy lifecycle of :mod:`collectives`, so a binding
can use it in place of a dense strategy.

==================  =========================================================
:class:`ExDyna`     exclusive rotating partitions of blocks, dynamic
                    boundaries, online threshold scaling (arXiv 2402.13781)
:class:`TopK`       exact top-k per rank, union of indices (build-up)
:class:`RandomK`    shared-seed random indices (no index traffic)
:class:`HardThreshold`  fixed threshold over the whole vector
:class:`CLTK`       a rotating leader's top-k indices
:class:`MiCRO`      equal rotating partitions, the prototype's threshold rule
:class:`Dense`      all-reduce of everything
==================  =========================================================

Arrays: numpy on the host, cupy on the GPU, one code path (the array module
``xp`` is taken from the data); torch and other frameworks' tensors reach it
through DLPack.

Example (under ``mpiexec -n 4``):
    >>> import commlib
    >>> from commlib.sparsify import ErrorFeedback, ExDyna
    >>> comm = commlib.init()
    >>> sel = ExDyna(density=0.01).setup(comm, grad.size)
    >>> fb = ErrorFeedback(grad.size)
    >>> out = sel.reduce(fb.accumulate(grad))       # collective
    >>> fb.settle(out)
    >>> update = out.scatter_into(np.empty_like(grad))   # dense, zeros off the union
    >>> out.stats.density, out.stats.buildup, sel.threshold

or, with a binding:
    >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
    ...                            strategy=SparseAllReduce(selector=ExDyna(density=0.01)))
"""

from .base import Reduced, Selector, StepStats
from .exdyna import ExDyna, MiCRO
from .feedback import ErrorFeedback
from .partitions import BlockPartitions, EqualPartitions, imbalance
from .selectors import CLTK, Dense, HardThreshold, RandomK, TopK
from .strategy import SparseAllReduce
from .threshold import CountCurveThreshold, FixedThreshold, ReferenceThreshold, ThresholdPolicy

#: selector classes by name (benchmarks, command lines)
SELECTORS = {cls.name: cls for cls in (ExDyna, TopK, RandomK, HardThreshold, CLTK, MiCRO, Dense)}

__all__ = [
    "Selector", "Reduced", "StepStats", "ErrorFeedback", "SparseAllReduce", "SELECTORS",
    "ExDyna", "MiCRO", "TopK", "RandomK", "HardThreshold", "CLTK", "Dense",
    "BlockPartitions", "EqualPartitions", "imbalance",
    "ThresholdPolicy", "CountCurveThreshold", "ReferenceThreshold", "FixedThreshold",
]
