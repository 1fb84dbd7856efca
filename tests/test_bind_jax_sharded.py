"""bindings.jax_sharded's sharded_optimizer (DeAR's ZeRO-1 update): eagerly and inside ``jax.jit``,
against one process on the whole batch and against each other; its per-rank state through
checkpoints; what it refuses."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from test_bind_jax import (  # noqa: E402
    LOCAL,
    SMALL,
    STEPS,
    apply_updates,
    batch,
    flat,
    grad_fn,
    init_params,
    loss_fn,
    optimizer,
    reference,
    same_on_all_ranks,
)

from commlib.bindings.jax import (  # noqa: E402
    apply_if_finite,
    broadcast_params,
    clip_by_global_norm,
    sharded_optimizer,
)
from commlib.collectives import DeAR  # noqa: E402
from commlib.errors import MismatchError, ValidationError  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)


def stepper(tx, jit: bool, with_params: bool = True):
    """One training step: the whole of it jitted, or the update called eagerly between the jitted
    gradient and apply_updates (the same arithmetic, so the two agree bit for bit)."""
    if jit:
        @jax.jit
        def step_fn(params, state, x, y):
            grads = jax.grad(loss_fn)(params, x, y)
            updates, state = tx.update(grads, state, params if with_params else None)
            return optax.apply_updates(params, updates), state
        return step_fn

    def eager(params, state, x, y):
        updates, state = tx.update(grad_fn(params, x, y), state, params if with_params else None)
        return apply_updates(params, updates), state
    return eager


def steps(comm, step_fn, params, state, todo):
    mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
    for step in todo:
        x, y = batch(step, comm.size)
        params, state = step_fn(params, state, x[mine], y[mine])
    return params, state


@pytest.mark.parametrize("kind,with_params", [("sgd", True), ("sgd", False), ("adamw", True)])
def test_jitted_update_trains_as_one_process_and_as_the_eager_one(comm, kind, with_params):
    """The whole step jitted (reduce-scatter and all-gather in callbacks around the traced inner update
    on the shards) trains as one process on the whole batch, and bit for bit as the eager update; its
    collectives run on a communicator of their own.  It raised TypeError ("runs eagerly")."""
    start = broadcast_params(init_params(comm.rank), comm=comm)
    got = {}
    for jit in (False, True):
        strategy = DeAR(cap_mb=SMALL, first_cap_mb=SMALL / 2)
        tx = sharded_optimizer(optimizer(kind), comm=comm, strategy=strategy)
        got[jit], state = steps(comm, stepper(tx, jit, with_params), start, tx.init(start), range(STEPS))
        assert strategy.steps == STEPS
        assert (strategy.comm is comm) == (not jit)
        assert [int(v) for v in np.asarray(state.owner)[:2]] == [comm.rank, comm.size]
    np.testing.assert_array_equal(flat(got[True]), flat(got[False]))
    np.testing.assert_allclose(flat(got[True]), flat(reference(kind, comm.size)), rtol=2e-5, atol=2e-6)
    same_on_all_ranks(comm, got[True])


@pytest.mark.parametrize("jit", [False, True])
def test_state_is_each_ranks_own(comm, jit):
    """sharded_optimizer's state in a checkpoint: each rank's own, restored in a fresh optimizer,
    continues as the run that was not stopped (so does a state whose owner lacks the optimizer's tag,
    as saved before the tag); rank 0's restored on every rank (saved on rank 0 alone, as replicated
    states are) is refused on every rank before the update communicates (it trained on, silently
    wrong), inside jax.jit too."""
    def fresh(strategy=None):
        return sharded_optimizer(optimizer("adamw"), comm=comm, strategy=strategy or DeAR(cap_mb=SMALL))

    start = broadcast_params(init_params(comm.rank), comm=comm)
    tx = fresh()
    whole, _ = steps(comm, stepper(tx, jit), start, tx.init(start), range(STEPS))
    tx = fresh()
    params, state = steps(comm, stepper(tx, jit), start, tx.init(start), range(2))
    saved = pickle.dumps((params, state))
    params, state = pickle.loads(saved)                      # this rank's own checkpoint
    resumed, _ = steps(comm, stepper(fresh(), jit), params, state, range(2, STEPS))
    np.testing.assert_array_equal(flat(resumed), flat(whole))
    untagged = state._replace(owner=np.asarray(state.owner)[:2])
    resumed, state = steps(comm, stepper(fresh(), jit), params, untagged, range(2, STEPS))
    np.testing.assert_array_equal(flat(resumed), flat(whole))
    assert np.asarray(state.owner).shape == (3,)
    if comm.size > 1:
        params, state = pickle.loads(comm.allgather_object(saved)[0])     # rank 0's, everywhere
        strategy = DeAR(cap_mb=SMALL)
        with pytest.raises(ValidationError if not jit else Exception, match="rank 1 holds rank 0 of"):
            steps(comm, stepper(fresh(strategy), jit), params, state, range(2, 3))
        assert strategy.comm is None      # refused by the update's tree check, before its reduction


@pytest.mark.parametrize("jit", [False, True])
def test_one_rank_restoring_alone(comm, jit):
    """Rank 0 restores its own state into a fresh optimizer while the others go on with theirs
    (eagerly: inside jax.jit a new optimizer's first step makes its communicator, a call every
    rank must make): the run continues as the uninterrupted one.  Rank 0 given rank 1's state
    while the others go on is refused on every rank.  Both aborted the communicator before (a
    mismatch: a rank whose state its optimizer had not handed out all-gathered the owners alone,
    the others were in the update's tree check)."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks or more")

    def fresh():
        return sharded_optimizer(optimizer("adamw"), comm=comm, strategy=DeAR(cap_mb=SMALL))

    start = broadcast_params(init_params(comm.rank), comm=comm)
    tx = fresh()
    params, state = steps(comm, stepper(tx, jit), start, tx.init(start), range(2))
    saved = comm.allgather_object(pickle.dumps(state))
    if not jit:
        whole, _ = steps(comm, stepper(tx, jit), params, state, range(2, STEPS))
        mine = fresh() if comm.rank == 0 else tx
        resumed, _ = steps(comm, stepper(mine, jit), params, pickle.loads(saved[comm.rank]),
                           range(2, STEPS))
        np.testing.assert_array_equal(flat(resumed), flat(whole))
    if comm.rank == 0:
        state = pickle.loads(saved[1])
    with pytest.raises(ValidationError if not jit else Exception, match="rank 0 holds rank 1 of"):
        steps(comm, stepper(tx, jit), params, state, range(2, 3))


@pytest.mark.parametrize("jit", [False, True])
def test_gradient_accumulation_around_it_trains_as_one_process(comm, jit):
    """``optax.MultiSteps`` around sharded_optimizer (the update every second step, on the accumulated
    gradients) trains as one process accumulating the whole batches.  MultiSteps calls the update
    inside ``lax.cond`` even eagerly, where it was refused ("runs eagerly")."""
    inner = optax.adam(0.02)
    start = broadcast_params(init_params(comm.rank), comm=comm)
    tx = optax.MultiSteps(sharded_optimizer(inner, comm=comm, strategy=DeAR(cap_mb=SMALL)), 2)
    got, _ = steps(comm, stepper(tx, jit), start, tx.init(start), range(STEPS + 1))

    @jax.jit
    def one_process(params, state, x, y):
        updates, state = ref_tx.update(jax.grad(loss_fn)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    ref_tx, params = optax.MultiSteps(inner, 2), init_params(0)
    state = ref_tx.init(params)
    for step in range(STEPS + 1):
        params, state = one_process(params, state, *batch(step, comm.size))
    np.testing.assert_allclose(flat(got), flat(params), rtol=2e-5, atol=2e-6)


def test_init_inside_jit_is_the_eager_one(comm):
    """``jax.jit(tx.init)`` (as a jitted ``TrainState.create`` calls it) gives the eager init's state,
    this rank's shards of the parameters taken in the traced code, and trains on as it; it was refused
    ("runs eagerly").  A tree that differs over the ranks is refused while tracing, on every rank."""
    start = broadcast_params(init_params(comm.rank), comm=comm)
    tx = sharded_optimizer(optimizer("adamw"), comm=comm, strategy=DeAR(cap_mb=SMALL, first_cap_mb=SMALL / 2))
    eager, jitted = tx.init(start), jax.jit(tx.init)(start)
    np.testing.assert_array_equal(flat(jitted.inner), flat(eager.inner))
    np.testing.assert_array_equal(np.asarray(jitted.owner), np.asarray(eager.owner))
    step = stepper(tx, True)
    a, _ = steps(comm, step, start, eager, range(STEPS))
    b, _ = steps(comm, step, start, jitted, range(STEPS))
    np.testing.assert_array_equal(flat(a), flat(b))
    if comm.size > 1:
        tx = sharded_optimizer(optax.sgd(0.1), comm=comm, strategy=DeAR(cap_mb=SMALL))
        tree = init_params(0) if comm.rank else {"only": init_params(0)["out"]}
        with pytest.raises(MismatchError, match="pytree"):
            jax.jit(tx.init)(tree)


def one_process_run(kind, size, todo, params, state):
    """``optimizer(kind)`` (or the transformation ``kind``) in one process on the whole batches of
    ``todo``: (params, state)."""
    tx = optimizer(kind) if isinstance(kind, str) else kind

    @jax.jit
    def step_fn(params, state, x, y):
        updates, state = tx.update(jax.grad(loss_fn)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    for step in todo:
        params, state = step_fn(params, state, *batch(step, size))
    return params, state


@pytest.mark.parametrize("jit", [False, True])
def test_whole_state_is_one_process_state_and_resumes_on_any_ranks(comm, jit):
    """``tx.whole_state`` gathers the ranks' shards into adamw's state over the whole tree: one process's
    state after the same steps, the same on every rank (rank 0 may save it alone).  Cut again by
    ``tx.shard_state`` in a fresh optimizer it continues bit for bit as the run that went on; one
    process's state, cut over these ranks, continues as one process does (a checkpoint that does not
    depend on the number of ranks).  Before, each rank had to save and restore its own shards."""
    def fresh():
        return sharded_optimizer(optimizer("adamw"), comm=comm,
                                 strategy=DeAR(cap_mb=SMALL, first_cap_mb=SMALL / 2))

    start = broadcast_params(init_params(comm.rank), comm=comm)
    tx = fresh()
    whole_run, _ = steps(comm, stepper(tx, jit), start, tx.init(start), range(STEPS))
    tx = fresh()
    params, state = steps(comm, stepper(tx, jit), start, tx.init(start), range(2))
    whole = tx.whole_state(state, params)
    one_params, one_state = one_process_run("adamw", comm.size, range(2), init_params(0),
                                            optimizer("adamw").init(init_params(0)))
    assert jax.tree_util.tree_structure(whole) == jax.tree_util.tree_structure(one_state)
    np.testing.assert_allclose(flat(whole), flat(one_state), rtol=2e-5, atol=2e-6)
    same_on_all_ranks(comm, whole)
    saved = pickle.dumps(whole) if comm.rank == 0 else None
    whole = pickle.loads(comm.allgather_object(saved)[0])            # rank 0's file, read everywhere
    tx = fresh()
    resumed, _ = steps(comm, stepper(tx, jit), params, tx.shard_state(whole, params), range(2, STEPS))
    np.testing.assert_array_equal(flat(resumed), flat(whole_run))
    tx = fresh()
    one_params = broadcast_params(one_params, comm=comm)
    resumed, _ = steps(comm, stepper(tx, jit), one_params, tx.shard_state(one_state, one_params),
                       range(2, STEPS))
    one_final, _ = one_process_run("adamw", comm.size, range(2, STEPS), one_params, one_state)
    np.testing.assert_allclose(flat(resumed), flat(one_final), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_clip_by_global_norm_inside_clips_by_the_whole_gradients_norm(comm, jit):
    """commlib's ``clip_by_global_norm`` inside ``sharded_optimizer`` sums the norm over the ranks'
    shards (one scalar all-gather): the run is one process's with optax's ``clip_by_global_norm`` on
    the whole batch, the same on every rank; the clip bites (the unclipped run ends elsewhere).
    optax's own is refused there (each rank would clip its shard by that shard's norm; the refusal
    names ours).  Outside ``sharded_optimizer`` ours is optax's, bit for bit."""
    def chain(clip):
        return optax.chain(clip(0.05), optax.adamw(0.02, weight_decay=0.05))

    start = broadcast_params(init_params(comm.rank), comm=comm)
    tx = sharded_optimizer(chain(clip_by_global_norm), comm=comm,
                           strategy=DeAR(cap_mb=SMALL, first_cap_mb=SMALL / 2))
    got, _ = steps(comm, stepper(tx, jit), start, tx.init(start), range(STEPS))
    theirs, ours = chain(optax.clip_by_global_norm), chain(clip_by_global_norm)
    ref, _ = one_process_run(theirs, comm.size, range(STEPS), init_params(0), theirs.init(init_params(0)))
    np.testing.assert_allclose(flat(got), flat(ref), rtol=2e-5, atol=2e-6)
    same_on_all_ranks(comm, got)
    free = optax.adamw(0.02, weight_decay=0.05)
    unclipped, _ = one_process_run(free, comm.size, range(STEPS), init_params(0), free.init(init_params(0)))
    assert np.abs(flat(unclipped) - flat(ref)).max() > 1e-3
    alone, _ = one_process_run(ours, comm.size, range(STEPS), init_params(0), ours.init(init_params(0)))
    np.testing.assert_array_equal(flat(alone), flat(ref))
    with pytest.raises(ValueError, match="commlib.bindings.jax.clip_by_global_norm"):
        sharded_optimizer(theirs, comm=comm, strategy=DeAR())
    for bad in (0, -1.0, "1", True):
        with pytest.raises(ValueError, match="max_norm must be a positive number"):
            clip_by_global_norm(bad)


@pytest.mark.parametrize("jit", [False, True])
def test_apply_if_finite_inside_skips_the_steps_one_process_skips(comm, jit):
    """commlib's ``apply_if_finite`` inside ``sharded_optimizer`` counts the non-finite elements over
    the ranks' shards: an inf in one rank's gradient (in one leaf, so in some ranks' shards only) skips
    that step on every rank, as one process skips it on the whole batch with optax's; its state is
    optax's.  optax's own is
    refused there (each rank would decide on its shard; the refusal names ours)."""
    def run(tx, dist: bool):
        params = broadcast_params(init_params(comm.rank), comm=comm) if dist else init_params(0)
        state = tx.init(params)
        update = jax.jit(tx.update) if jit else tx.update
        for step in range(STEPS + 2):
            x, y = batch(step, comm.size)
            if dist:
                mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
                x, y = x[mine], y[mine]
            grads = jax.tree_util.tree_map(np.array, jax.grad(loss_fn)(params, x, y))
            if step in (1, 3, 4) and (not dist or comm.rank == comm.size - 1):
                grads["out"][1][0] = np.inf          # each skipped (at most 2 in a row)
            updates, state = update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    def chain(wrap):
        return wrap(optax.adamw(0.02, weight_decay=0.05), 2)

    got, state = run(sharded_optimizer(chain(apply_if_finite), comm=comm,
                                       strategy=DeAR(cap_mb=SMALL, first_cap_mb=SMALL / 2)), True)
    ref, ref_state = run(chain(optax.apply_if_finite), False)
    same_on_all_ranks(comm, got)
    assert int(state.inner.total_notfinite) == int(ref_state.total_notfinite) == 3
    assert int(state.inner.notfinite_count) == int(ref_state.notfinite_count) == 0
    np.testing.assert_allclose(flat(got), flat(ref), rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="apply_if_finite, which read the whole gradient"):
        sharded_optimizer(chain(optax.apply_if_finite), comm=comm, strategy=DeAR())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_consecutive_errors must be an int"):
            apply_if_finite(optax.sgd(0.1), bad)


def test_whole_state_refusals(comm):
    """A state that is not the inner optimizer's over these parameters (another optimizer's, a leaf of
    another shape) is refused by ``shard_state`` with ValidationError, naming what differs, on every
    rank alike; a state of other buckets on one rank is refused by ``whole_state`` on every rank before
    the gathers (which would pair different parts); both refuse ``jax.jit`` (a checkpoint is eager)."""
    start = broadcast_params(init_params(comm.rank), comm=comm)
    tx = sharded_optimizer(optimizer("adamw"), comm=comm, strategy=DeAR(cap_mb=SMALL))
    state = tx.init(start)
    with pytest.raises(ValidationError, match="expected"):
        tx.shard_state(optax.sgd(0.1).init(start), start)
    whole = tx.whole_state(state, start)
    wrong = jax.tree_util.tree_map(lambda x: x, whole)
    wrong[0].mu["hidden"]["w"] = jax.numpy.zeros((16, 6))
    with pytest.raises(ValidationError, match=r"\['hidden'\]\['w'\] of the state has shape \(16, 6\), "
                                              r"expected \(6, 16\)"):
        tx.shard_state(wrong, start)
    if comm.size > 1:                                           # one rank's state of other shards
        bad = state._replace(inner=jax.tree_util.tree_map(lambda x: x[:-1] if np.ndim(x) else x, state.inner))
        bad = bad if comm.rank == comm.size - 1 else state
        seq = comm.seq
        with pytest.raises(ValidationError, match=f"rank {comm.size - 1} rejected its pytree: .*expected"):
            tx.whole_state(bad, start)
        assert comm.seq == seq + 1                              # the agreement's all-gather alone
        theirs = pickle.loads(comm.allgather_object(pickle.dumps(state))[0])      # rank 0's everywhere
        with pytest.raises(ValidationError, match=f"rank {comm.size - 1} rejected its pytree: it holds "
                                                  f"rank 0 of {comm.size}'s state"):
            tx.whole_state(theirs, start)
    with pytest.raises(TypeError, match="eagerly"):
        jax.jit(tx.shard_state)(whole, start)
    with pytest.raises(TypeError, match="eagerly"):
        jax.jit(tx.whole_state)(state, start)


@pytest.mark.parametrize("name", ["lamb", "lars", "clip_by_global_norm", "adafactor", "apply_if_finite"])
def test_sharded_optimizer_refuses_what_is_not_elementwise(name):
    """On each rank's flat shards LAMB's trust ratio, optax's global-norm clip, Adafactor's factored moments
    are not the leaves' (LAMB 0.026 off one process after 4 steps at 2 ranks, silently), nor is
    ``apply_if_finite``'s skip (each shard skipped alone: 0.13 off after 5 steps, an inf in one leaf).
    Tried at construction on every rank alike; elementwise ones (a schedule, ``clip``, ``zero_nans``) pass."""
    inner = {"lamb": optax.lamb(1e-3), "lars": optax.lars(1e-3), "adafactor": optax.adafactor(1e-3),
             "clip_by_global_norm": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
             "apply_if_finite": optax.apply_if_finite(optax.adam(1e-3), 3)}[name]
    with pytest.raises(ValueError, match=r"is not elementwise .*optax.chain\(average_gradients"):
        sharded_optimizer(inner, strategy=DeAR())
    for ok in (optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 5, 50)),
               optax.chain(optax.clip(1.0), optax.sgd(0.1, momentum=0.9, nesterov=True)),
               optax.chain(optax.zero_nans(), optax.adam(1e-3))):
        sharded_optimizer(ok, strategy=DeAR())


def test_a_state_wider_than_bfloat16_parameters_is_sharded_unrounded(comm):
    """optax's mixed precision (bfloat16 parameters, ``adam(mu_dtype=float32)``): ``shard_state``
    cut each part in the parameters' dtype and cast it back, so a resumed first moment was rounded
    to bfloat16 (1 + 2**-20 came back 1.0; a resume 4e-4 off the run that went on)."""
    start = jax.tree_util.tree_map(lambda x: x.astype(jax.numpy.bfloat16),
                                   broadcast_params(init_params(comm.rank), comm=comm))
    tx = sharded_optimizer(optax.adam(1e-3, mu_dtype=jax.numpy.float32), comm=comm,
                           strategy=DeAR(cap_mb=SMALL))
    whole = tx.whole_state(tx.init(start), start)
    fine = jax.tree_util.tree_map(lambda m: jax.numpy.full(m.shape, 1 + 2.0 ** -20, m.dtype), whole[0].mu)
    whole = (whole[0]._replace(mu=fine), *whole[1:])
    again = tx.whole_state(tx.shard_state(whole, start), start)
    for a, b in zip(jax.tree_util.tree_leaves(again[0].mu), jax.tree_util.tree_leaves(fine)):
        assert a.dtype == jax.numpy.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind", ["labels-by-path", "mask-by-path", "adamw-mask-by-path", "mask-tree"])
def test_a_transformation_that_decides_by_the_tree_is_refused_on_every_rank(comm, kind, jit):
    """Masks and labels keyed by the leaves' paths (flax's idiom), or given as a tree: the inner update
    runs on a list of flat shards, where every leaf looked alike, so a leaf labelled frozen trained
    (0.31 after 3 steps at 2 ranks) and adamw's mask decayed the biases, silently; a mask given as a
    tree failed in optax with a bare pytree error.  ``init`` refuses each on every rank, naming why,
    eagerly and inside ``jax.jit``; a mask by the leaves' values alone trains on."""
    def by_path(fn):
        return lambda tree: jax.tree_util.tree_map_with_path(lambda kp, _: fn(jax.tree_util.keystr(kp)), tree)

    inner = {
        "labels-by-path": optax.multi_transform(
            {"train": optax.sgd(0.1), "frozen": optax.set_to_zero()},
            by_path(lambda path: "frozen" if "hidden" in path else "train")),
        "mask-by-path": optax.masked(optax.adam(0.1), by_path(lambda path: "out" in path)),
        "adamw-mask-by-path": optax.adamw(0.1, weight_decay=0.1,
                                          mask=by_path(lambda path: "'b'" not in path)),
        "mask-tree": optax.masked(optax.adam(0.1), {"hidden": {"w": True, "b": False}, "out": [True, False]}),
    }[kind]
    start = broadcast_params(init_params(comm.rank), comm=comm)
    tx = sharded_optimizer(inner, comm=comm, strategy=DeAR(cap_mb=SMALL))
    init = jax.jit(tx.init) if jit else tx.init
    why = "takes the tree's" if kind == "mask-tree" else "decides by the tree"
    with pytest.raises(ValueError, match=why):
        init(start)
    fine = sharded_optimizer(optax.adamw(0.1, mask=lambda tree: jax.tree_util.tree_map(lambda _: True, tree)),
                             comm=comm, strategy=DeAR(cap_mb=SMALL))
    (jax.jit(fine.init) if jit else fine.init)(start)
    assert float(comm.allreduce(np.ones(1))[0]) == comm.size
