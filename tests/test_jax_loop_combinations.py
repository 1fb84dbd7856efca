"""The features of an ordinary optax training loop together, drawn by hypothesis, through commlib's JAX
binding, against one process on the whole batch.

Each example draws the way the ranks train (``average_gradients`` over AllReduce or DeAR,
``sharded_optimizer``'s ZeRO-1 update, or ``DistributedOptimizer`` under SelSync at delta 0, which
synchronizes every step), the step eager or one ``jax.jit`` call, the optimizer (SGD with momentum,
AdamW with a schedule), a clip by the global norm, ``apply_if_finite``, gradient accumulation
(``optax.MultiSteps`` around the whole), whether ``params`` reach the update, and a checkpoint resumed
partway into a new transformation (the sharded state made whole on every rank and cut again).
Hypothesis runs derandomized, so every rank draws the same loops in the same order (the ranks must
make the same calls).
"""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_bind_jax import SMALL, flat, init_params, same_on_all_ranks  # noqa: E402
from test_bind_jax_sharded import one_process_run, stepper, steps  # noqa: E402

from commlib.bindings.jax import (  # noqa: E402
    DistributedOptimizer,
    apply_if_finite,
    average_gradients,
    broadcast_params,
    clip_by_global_norm,
    sharded_optimizer,
)
from commlib.collectives import AllReduce, DeAR, SelSync  # noqa: E402

from conftest import WORLD_SIZE  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)

STEPS = 5
MAX_NORM = 0.05     # below the MLP's gradient norms: the clip bites at every step

LOOPS = st.fixed_dictionaries({
    "way": st.sampled_from(["average-allreduce", "average-dear", "sharded", "selsync0"]),
    "jit": st.booleans(),
    "optimizer": st.sampled_from(["sgd", "adamw"]),
    "clip": st.booleans(),
    "guard": st.booleans(),         # apply_if_finite around the optimizer
    "accumulate": st.booleans(),
    "with_params": st.booleans(),
    "resume_at": st.sampled_from([None, 2, 3]),
})


def inner(loop: dict, ours: bool):
    """The optimizer the loop steps, with its clip (ours where the ranks train, optax's in one process)."""
    return _inner(loop["optimizer"], loop["clip"], loop["guard"], ours)


@functools.cache        # one object per kind: sharded_optimizer tries each once
def _inner(kind: str, clip: bool, guard: bool, ours: bool):
    opt = (optax.sgd(0.1, momentum=0.9) if kind == "sgd"
           else optax.adamw(optax.linear_schedule(0.02, 0.005, STEPS), weight_decay=0.05))
    if clip:
        opt = optax.chain((clip_by_global_norm if ours else optax.clip_by_global_norm)(MAX_NORM), opt)
    if guard:
        opt = (apply_if_finite if ours else optax.apply_if_finite)(opt, 3)
    return opt


def transformation(loop: dict, comm):
    """The loop's optax transformation over ``comm`` (None: one process)."""
    way = loop["way"]
    if comm is None:
        tx = inner(loop, ours=False)
    elif way.startswith("average"):
        strategy = (AllReduce if way == "average-allreduce" else DeAR)(cap_mb=SMALL, first_cap_mb=SMALL / 2)
        tx = optax.chain(average_gradients(comm=comm, strategy=strategy), inner(loop, ours=True))
    elif way == "sharded":
        tx = sharded_optimizer(inner(loop, ours=True), comm=comm,
                               strategy=DeAR(cap_mb=SMALL, first_cap_mb=SMALL / 2))
    else:
        tx = DistributedOptimizer(inner(loop, ours=True), strategy=SelSync(delta=0.0, mode="grads"),
                                  comm=comm)
    return optax.MultiSteps(tx, every_k_schedule=2) if loop["accumulate"] else tx


def params_given(loop: dict) -> bool:
    """SelSync's update reads the parameters (it may average them); AdamW's weight decay too."""
    return loop["with_params"] or loop["way"] == "selsync0" or loop["optimizer"] == "adamw"


def checkpoint(loop: dict, comm, tx, state, params):
    """What a loop saves: the sharded state made whole (the same on every rank: rank 0's is read back
    everywhere); the others' state, each rank its own (SelSync's, MultiSteps' local accumulator)."""
    if loop["way"] == "sharded" and not loop["accumulate"]:
        whole = tx.whole_state(state, params)
        saved = pickle.dumps(whole) if comm.rank == 0 else None
        return pickle.loads(comm.allgather_object(saved)[0])
    return pickle.loads(pickle.dumps(state))


def restored(loop: dict, tx, saved, params):
    if loop["way"] == "sharded" and not loop["accumulate"]:
        return tx.shard_state(saved, params)
    return saved


# derandomized: the 4-rank run draws the first 3 of the 6 loops the smaller runs draw (each loop's
# XLA compiles, paid by every rank, took 57 s of CI's suite at 4 ranks on its 2 cores)
@settings(max_examples=6 if WORLD_SIZE <= 2 else 3, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(loop=LOOPS)
def test_an_optax_loop_of_ordinary_features_trains_as_one_process(comm, loop):
    """Parameters match one process on the whole batch and are the same on every rank, resumed or not."""
    def trained(tx, params, state, todo):
        return steps(comm, stepper(tx, loop["jit"], params_given(loop)), params, state, todo)

    start = broadcast_params(init_params(comm.rank), comm=comm)
    tx = transformation(loop, comm)
    at = loop["resume_at"]
    if at is None:
        got, _ = trained(tx, start, tx.init(start), range(STEPS))
    else:
        params, state = trained(tx, start, tx.init(start), range(at))
        saved = checkpoint(loop, comm, tx, state, params)
        tx = transformation(loop, comm)
        tx.init(params)
        got, _ = trained(tx, params, restored(loop, tx, saved, params), range(at, STEPS))
    one = transformation(loop, None)
    ref, _ = one_process_run(one, comm.size, range(STEPS), init_params(0), one.init(init_params(0)))
    same_on_all_ranks(comm, got)
    np.testing.assert_allclose(flat(got), flat(ref), rtol=2e-5, atol=2e-6, err_msg=repr(loop))
