"""JAX arrays on the GPU through a communicator: results come back as GPU jax arrays of the input's
dtype and the reference's values (NCCL with one rank; MPI staging through the host when ranks
share the GPU).  ``tests/test_gpu.py`` runs it in fresh processes: the JAX binding's test modules
pin jax to the CPU when pytest imports them.

    mpiexec -n N python tests/jobs/jax_gpu.py OUT_DIR      # writes OUT_DIR/ok.<rank>
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import commlib

comm = commlib.init(comm=MPI.COMM_WORLD)
assert jax.devices()[0].platform == "gpu", jax.devices()
n = 11
want = sum(np.arange(n, dtype=np.float64) + r for r in range(comm.size))
for dtype in ("float16", "bfloat16", "float32", "int32"):
    x = jnp.arange(n, dtype=dtype) + comm.rank
    for name, got, expect in [("allreduce", comm.allreduce(x), want),
                              ("allgather", comm.allgather(x).reshape(-1),
                               np.concatenate([np.arange(n) + r for r in range(comm.size)])),
                              ("broadcast", comm.broadcast(x, root=0), np.arange(n))]:
        where = {d.platform for d in got.devices()}
        assert got.dtype == x.dtype and where == {"gpu"}, (name, dtype, got.dtype, where, comm.backend)
        np.testing.assert_array_equal(np.asarray(got, dtype=np.float64), expect, err_msg=f"{name} {dtype}")
open(os.path.join(sys.argv[1], f"ok.{comm.rank}"), "w").close()
comm.close()
