"""An emulated cluster: MPI ranks in network namespaces of their own, behind shaped links.

Example:
    python -m benchmarks.cluster --ranks 4 --rate 1gbit -- python -m benchmarks.collectives

:mod:`.netns` builds the namespaces, veth links, bridge and ``tc`` shapers;
:mod:`.launch` runs a command as the ranks under the mpich wheel's mpiexec,
each through ``ip netns exec`` with MPICH forced onto TCP; :mod:`.selfcheck`
refuses figures when the links are off the configured rate; :mod:`.control`
(launcher side) and :mod:`.straggler` (rank side) inject slow links and slow
ranks.  Ranks see these variables:

=============================  ================================================
``COMMLIB_CLUSTER_SHAPED``     ``1`` behind shaped links, ``0`` plain ranks
``COMMLIB_CLUSTER_RANKS``      number of ranks
``COMMLIB_CLUSTER_RATE``       link rate, bits/s (shaped only)
``COMMLIB_CLUSTER_DELAY_MS``   one-way delay, ``COMMLIB_CLUSTER_JITTER_MS``
``COMMLIB_CLUSTER_RANK``       this rank; ``COMMLIB_CLUSTER_NETNS``, ``_ADDR``
``COMMLIB_CLUSTER_SELFCHECK``  the launcher's self-check result (JSON)
``COMMLIB_CLUSTER_CONTROL``    directory for :func:`request_link`
``COMMLIB_STRAGGLER_COMPUTE``  ``RANK:SECONDS[:START[:STOP]]``, comma-separated
=============================  ================================================
"""

from .control import LinkChange, LinkController
from .launch import MPICH_ENV, kill_tree, mpiexec_path, rank_env, run_ranks
from .netns import (
                    Cluster,
                    ClusterBusy,
                    ClusterUnavailable,
                    NetemUnavailable,
                    available,
                    parse_ms,
                    parse_rate,
                    tbf_params,
)
from .selfcheck import SelfCheckFailed, describe, ring_bound_s, selfcheck
from .selfcheck import from_env as selfcheck_from_env
from .straggler import ComputeDelay, Straggler, request_link

__all__ = ["MPICH_ENV", "Cluster", "ClusterBusy", "ClusterUnavailable", "ComputeDelay",
           "LinkChange", "LinkController", "NetemUnavailable", "SelfCheckFailed", "Straggler",
           "available", "describe", "kill_tree", "mpiexec_path", "parse_ms", "parse_rate",
           "rank_env", "request_link", "ring_bound_s", "run_ranks", "selfcheck",
           "selfcheck_from_env", "tbf_params"]
