"""bindings.jax: a gradient tree that differs on one rank after the first step raises on every rank.

The tree is compared over the ranks at every call (a few words; the whole comparison where they
differ or the tree is new): the ranks that had seen the tree before trusted their cached plan and
paired their all-reduce with the odd rank's comparison, so that their parameters took garbage (1e218)
with no error; a sharded optimizer's own check raised on the odd rank alone, its peers waiting in
the step's collectives until their timeout.  (The JAX DistributedOptimizer's case leaves the peers'
all-reduce posted: a job, tests/jobs/broken.py jax_optimizer_tree_on_one_rank.)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

from commlib.bindings.jax import allreduce_gradients, average_gradients, sharded_optimizer  # noqa: E402
from commlib.collectives import AllReduce, DeAR  # noqa: E402
from commlib.errors import MismatchError, ValidationError  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=2)


def trees(rank: int) -> tuple[dict, dict]:
    good = {"w": jnp.ones(4), "b": jnp.ones(2)}
    return good, ({"w": jnp.ones(5), "b": jnp.ones(2)} if rank == 1 else good)


@pytest.mark.parametrize("entry", ["average_gradients", "average_gradients-jit", "allreduce_gradients",
                                   "sharded_optimizer", "sharded_optimizer-jit"])
def test_a_tree_that_changes_on_one_rank_raises_on_every_rank(comm, entry):
    own = comm.split(0)
    try:
        good, odd = trees(own.rank)
        if entry == "allreduce_gradients":
            allreduce_gradients(good, comm=own)
            with pytest.raises(MismatchError, match="pytree"):
                allreduce_gradients(odd, comm=own)
            return
        if entry.startswith("average_gradients"):
            tx = optax.chain(average_gradients(comm=own, strategy=AllReduce()), optax.sgd(0.1))
            error, match = MismatchError, "pytree"
        else:
            tx = sharded_optimizer(optax.sgd(0.1), comm=own, strategy=DeAR())
            error, match = ValidationError, "rank 1 rejected its pytree: sharded_optimizer"
        update = jax.jit(tx.update) if entry.endswith("-jit") else tx.update
        state = tx.init(good)
        jax.block_until_ready(update(good, state, good))
        with pytest.raises((error, jax.errors.JaxRuntimeError), match=match):
            jax.block_until_ready(update(odd, state, odd))
    finally:
        own.close()
