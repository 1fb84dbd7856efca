"""An emulated cluster: MPI ranks in their own network namespaces behind shaped links.

Example:
    python -m benchmarks.cluster --ranks 4 --rate 1gbit -- python -m benchmarks.collectives

See :mod:`benchmarks.cluster.netns` (namespaces, tc), :mod:`.launch` (mpiexec
through a per-rank ``ip netns exec`` wrapper), :mod:`.selfcheck` (refuse
figures when the link rate is off) and :mod:`.straggler`.
"""

from .launch import mpiexec_path, run_ranks
from .netns import Cluster, ClusterUnavailable, available, parse_rate
from .selfcheck import SelfCheckFailed, ring_bound_s, selfcheck
from .straggler import Straggler

__all__ = ["Cluster", "ClusterUnavailable", "SelfCheckFailed", "Straggler", "available",
           "mpiexec_path", "parse_rate", "ring_bound_s", "run_ranks", "selfcheck"]
