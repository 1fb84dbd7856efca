"""bindings.jax: gradient pytrees through fusion buckets, AllReduce and DeAR, against one process.

Every rank trains on its slice of a global batch; the reference is one
process running the same optax optimizer on the whole batch (the loss is a
mean, so the average of the ranks' gradients is the full-batch gradient).
"""

from __future__ import annotations

import functools
import os
import threading

# before jax initializes its backend: CPU only, two host devices for the mixed-device check
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=2").strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from commlib.bindings.jax import (  # noqa: E402
    GradientSync,
    allreduce_gradients,
    average_gradients,
    broadcast_params,
    sharded_optimizer,
)
from commlib.collectives import AllReduce, DeAR, SelSync, SyncSwitch  # noqa: E402
from commlib.errors import MismatchError, ValidationError  # noqa: E402

from conftest import assert_same_on_every_rank  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)

LOCAL = 3            # samples per rank per step
STEPS = 5
SMALL = 200 / 2**20  # a bucket cap of 200 bytes: the MLP's leaves spread over several buckets


def init_params(seed: int) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {"hidden": {"w": jax.random.normal(k[0], (6, 16)) * 0.4, "b": jnp.zeros(16)},
            "out": [jax.random.normal(k[1], (16, 3)) * 0.4, jax.random.normal(k[2], (3,)) * 0.1]}


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    w, b = params["out"]
    return jnp.mean((h @ w + b - y) ** 2)


grad_fn = jax.jit(jax.grad(loss_fn))
apply_updates = jax.jit(optax.apply_updates)


def batch(step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([1000, step])
    n = LOCAL * size
    return rng.standard_normal((n, 6)).astype(np.float32), rng.standard_normal((n, 3)).astype(np.float32)


@functools.cache   # one object per kind: jitted updates compile once per process
def optimizer(kind: str):
    if kind == "sgd":
        return optax.sgd(0.1, momentum=0.9, nesterov=True)
    return optax.adamw(optax.linear_schedule(0.02, 0.005, STEPS), weight_decay=0.05)


@functools.cache
def jitted_update(kind: str):
    return jax.jit(optimizer(kind).update)


@functools.cache
def reference(kind: str, size: int) -> dict:
    tx = optimizer(kind)

    @jax.jit
    def step_fn(params, state, x, y):
        updates, state = tx.update(jax.grad(loss_fn)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    params = init_params(0)
    state = tx.init(params)
    for step in range(STEPS):
        params, state = step_fn(params, state, *batch(step, size))
    return params


def distributed(comm, kind: str, strategy, mode: str) -> dict:
    """``jit``: the whole step jitted, averaging inside it (io_callback); ``eager``: the
    averaging transformation called eagerly between the jitted gradient and update;
    ``sharded``: DeAR's ZeRO-1 update (eager)."""
    params = broadcast_params(init_params(comm.rank), comm=comm)   # rank 0's start everywhere
    opt, average = optimizer(kind), average_gradients(comm=comm, strategy=strategy)
    if mode == "jit":
        tx = optax.chain(average, opt)

        @jax.jit
        def step_fn(params, state, x, y):
            updates, state = tx.update(jax.grad(loss_fn)(params, x, y), state, params)
            return optax.apply_updates(params, updates), state
    elif mode == "eager":
        tx = optax.chain(average, opt)
        opt_update = jitted_update(kind)

        def step_fn(params, state, x, y):
            grads, avg_state = average.update(grad_fn(params, x, y), state[0], params)
            updates, opt_state = opt_update(grads, state[1], params)
            return apply_updates(params, updates), (avg_state, opt_state)
    else:
        tx = sharded_optimizer(opt, comm=comm, strategy=strategy)

        def step_fn(params, state, x, y):
            updates, state = tx.update(grad_fn(params, x, y), state, params)
            return apply_updates(params, updates), state
    state = tx.init(params)
    mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
    for step in range(STEPS):
        x, y = batch(step, comm.size)
        params, state = step_fn(params, state, x[mine], y[mine])
    return params


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in jax.tree_util.tree_leaves(tree)])


def same_on_all_ranks(comm, tree) -> None:
    assert_same_on_every_rank(comm, flat(tree))


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("name,mode", [("allreduce", "eager"), ("allreduce", "jit"), ("dear", "eager"),
                                       ("dear", "jit"), ("dear", "sharded")])
def test_training_matches_single_process(comm, kind, name, mode):
    strategy = (AllReduce if name == "allreduce" else DeAR)(cap_mb=SMALL, first_cap_mb=SMALL / 2)
    params = distributed(comm, kind, strategy, mode)
    ref = reference(kind, comm.size)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(ref)
    for p, q in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref)):
        assert p.dtype == q.dtype and p.shape == q.shape
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=2e-5, atol=2e-6)
    same_on_all_ranks(comm, params)
    assert strategy.steps == STEPS
    assert (strategy.comm is comm) == (mode != "jit")      # the jitted path has its own communicator


def complex_params(seed: int) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    w = jax.random.normal(k[0], (6, 3)) + 1j * jax.random.normal(k[1], (6, 3))
    return {"w": (0.4 * w).astype(jnp.complex64), "b": jnp.zeros(3)}


def complex_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jnp.abs(x.astype(jnp.complex64) @ params["w"]) + params["b"] - y) ** 2)


@pytest.mark.parametrize("mode", ["eager", "jit", "sharded", "sharded-jit"])
def test_complex_leaves_train_as_one_process(comm, mode):
    """Complex parameters (a spectral layer's weights): averaged as complex numbers, inside jit too,
    and updated on shards, as one process trains them.  They were refused ("leaves must be floating")."""
    tx = optax.adam(0.02)

    def train(dist: bool) -> dict:
        params = broadcast_params(complex_params(comm.rank), comm=comm) if dist else complex_params(0)
        strategy = DeAR(cap_mb=SMALL, first_cap_mb=SMALL / 2)
        chain = (tx if not dist else sharded_optimizer(tx, comm=comm, strategy=strategy) if "sharded" in mode
                 else optax.chain(average_gradients(comm=comm, strategy=strategy), tx))

        def step_fn(params, state, x, y):
            updates, state = chain.update(jax.grad(complex_loss)(params, x, y), state, params)
            return optax.apply_updates(params, updates), state
        if not dist or mode.endswith("jit"):
            step_fn = jax.jit(step_fn)
        state = chain.init(params)
        mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL) if dist else slice(None)
        for step in range(STEPS):
            x, y = batch(step, comm.size)
            params, state = step_fn(params, state, x[mine], y[mine])
        return params

    got, ref = train(True), train(False)
    for k in ref:
        assert got[k].dtype == ref[k].dtype
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref[k]), rtol=2e-5, atol=2e-6, err_msg=k)


def mixed_tree(rank: int) -> dict:
    rng = np.random.default_rng([rank, 7])

    def vals(shape, dt):
        return jnp.asarray((rng.integers(-8, 9, size=shape) * 0.5).astype(dt))

    bf16 = ml_dtypes.bfloat16
    return {"a": vals((3, 5), np.float32), "bf": [vals((7,), bf16), vals((2, 2, 2), bf16)],
            "h": (vals((11,), np.float16), vals((), np.float32)), "empty": jnp.zeros((0, 4)),
            "big": vals((40,), np.float32), "z": vals((1, 1), np.float16)}


def test_fusion_round_trip_is_exact(comm):
    sync = GradientSync(comm, cap_mb=64 / 2**20, first_cap_mb=32 / 2**20)
    tree = mixed_tree(comm.rank)
    buffers = sync.flatten(tree)
    plan = sync._plans[next(reversed(sync._plans))]
    assert len(buffers) == len(plan.buckets) >= 4
    leaves = jax.tree_util.tree_leaves(tree)
    for buf, bucket in zip(buffers, plan.buckets):
        assert buf.size == bucket.padded and buf.size % comm.size == 0
        assert buf.dtype.name == bucket.dtype
        assert {leaves[s.index].dtype.name for s in bucket.slots} == {bucket.dtype}   # homogeneous
        assert not buf[bucket.numel:].any()                                          # zero padding
    for bucket in plan.buckets:                 # filled in reverse leaf order, as backward goes
        assert [s.index for s in bucket.slots] == sorted((s.index for s in bucket.slots), reverse=True)
    back = sync.unflatten(buffers, like=tree)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    for p, q in zip(jax.tree_util.tree_leaves(back), leaves):
        assert isinstance(p, jax.Array) and p.dtype == q.dtype and p.shape == q.shape
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))


@pytest.mark.parametrize("name", ["allreduce", "dear"])
def test_mixed_dtypes_are_averaged(comm, name):
    strategy = (AllReduce if name == "allreduce" else DeAR)(cap_mb=64 / 2**20, first_cap_mb=32 / 2**20)
    sync = GradientSync(comm, strategy)
    trees = [mixed_tree(r) for r in range(comm.size)]
    for _ in range(2):     # the second call reuses the plan and its buffers
        got = sync(trees[comm.rank])
        for i, p in enumerate(jax.tree_util.tree_leaves(got)):
            stack = np.stack([np.asarray(jax.tree_util.tree_leaves(t)[i], np.float64) for t in trees])
            assert p.dtype == jax.tree_util.tree_leaves(trees[0])[i].dtype
            np.testing.assert_allclose(np.asarray(p, np.float64), stack.mean(0), rtol=1e-2, atol=1e-2)
    assert len(sync.describe()) == len(sync.buckets) >= 4
    assert len(sync._plans) == 1
    # same structure and shapes, other dtype: a plan of its own
    got = sync({"d": jnp.ones(4, jnp.float32)}), sync({"d": jnp.ones(4, jnp.bfloat16)})
    assert [g["d"].dtype for g in got] == [jnp.float32, jnp.bfloat16] and len(sync._plans) == 3
    # numpy leaves are accepted; jax arrays come back
    got = sync({"n": np.full(4, comm.rank, np.float32)})
    assert isinstance(got["n"], jax.Array)
    np.testing.assert_array_equal(np.asarray(got["n"]), np.full(4, (comm.size - 1) / 2, np.float32))
    # the one-shot form
    got = allreduce_gradients({"g": jnp.full(5, float(comm.rank))}, comm=comm)
    np.testing.assert_array_equal(np.asarray(got["g"]), np.full(5, (comm.size - 1) / 2, np.float32))


@pytest.mark.parametrize("jit", [False, True])
def test_tuned_cap_replans_on_every_rank(comm, jit):
    """Eager and inside ``jax.jit``, where the plan stayed the one traced: the cap moved and the
    buckets never did."""
    strategy = AllReduce(cap_mb=64 / 2**20, first_cap_mb=0,
                         tune={"trials": 3, "window": 1, "skip": 0, "low_mb": 2**-14, "high_mb": 2**-8})
    sync = GradientSync(comm, strategy)
    call = jax.jit(sync) if jit else sync
    trees = [mixed_tree(r) for r in range(comm.size)]
    caps = []
    for _ in range(5):
        got = call(trees[comm.rank])
        caps.append(strategy.cap_bytes)
        for i, p in enumerate(jax.tree_util.tree_leaves(got)):
            stack = np.stack([np.asarray(jax.tree_util.tree_leaves(t)[i], np.float64) for t in trees])
            np.testing.assert_allclose(np.asarray(p, np.float64), stack.mean(0), rtol=1e-2, atol=1e-2)
    assert strategy.tuner.done and len(strategy.tuner.history) == 3
    assert len(set(caps)) > 1 and len(sync._plans) > 1          # the tuner moved the cap: re-planned
    table = comm.allgather(np.array(caps, np.int64))
    assert (table == table[0]).all()                              # the same caps on every rank


def test_a_tuners_state_loaded_before_the_first_call_resumes_its_search(comm):
    """README's resume: ``strategy.load_state_dict(saved)`` before the first update.  The tuner is
    made at the first setup, so the load dropped its state (history, trials done) and the search
    started over (6 more re-plans after one that had ended).  ``tune={}`` (the defaults) left tuning
    off; a setting CapTuner does not take failed only at the first setup."""
    def make():
        return AllReduce(cap_mb=64 / 2**20, first_cap_mb=0,
                         tune={"trials": 2, "window": 1, "skip": 0, "low_mb": 2**-14, "high_mb": 2**-8})

    tree = mixed_tree(comm.rank)
    first = make()
    sync = GradientSync(comm, first)
    for _ in range(3):
        sync(tree)
    assert first.tuner.done
    saved = first.state_dict()
    again = make()
    again.load_state_dict(saved)
    GradientSync(comm, again)(tree)
    assert again.tuner.done and again.tuner.history == first.tuner.history
    assert again.cap_bytes == first.cap_bytes
    assert AllReduce(tune={}).tuned and not AllReduce(tune=False).tuned
    with pytest.raises(TypeError, match=r"tune: unknown setting\(s\) \['bogus'\]"):
        AllReduce(tune={"bogus": 1})
    with pytest.raises(TypeError, match="tune='yes': expected True, False or a dict"):
        AllReduce(tune="yes")


def test_broadcast_params_makes_ranks_equal(comm):
    root = comm.size - 1
    tree = {"w": jnp.full((3, 4), float(comm.rank)), "bf": jnp.arange(5, dtype=jnp.bfloat16) + comm.rank,
            "count": jnp.asarray(comm.rank + 10, jnp.int32), "layers": [jnp.ones(2) * comm.rank]}
    got = broadcast_params(tree, root=root, comm=comm)
    same_on_all_ranks(comm, got)
    assert int(got["count"]) == root + 10 and got["count"].dtype == jnp.int32
    assert got["bf"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got["w"]), np.full((3, 4), float(root), np.float32))


def test_non_float_leaf_raises_on_every_rank(comm):
    sync = GradientSync(comm)
    g = {"w": jnp.ones(3), "n": jnp.ones(2, jnp.int32) if comm.rank == 0 else jnp.ones(2)}
    with pytest.raises(ValidationError, match=r"rank 0 rejected its pytree: leaf \['n'\] has dtype int32"):
        sync(g)
    with pytest.raises(ValidationError, match="must be floating"):
        sync({"w": jnp.ones(3), "n": jnp.ones(2, jnp.int32)})
    # the communicator and the GradientSync stay usable
    np.testing.assert_array_equal(np.asarray(sync({"w": jnp.ones(3)})["w"]), np.ones(3, np.float32))


def test_non_float_leaf_raises_inside_jit(comm):
    tx = average_gradients(comm=comm)
    step = jax.jit(lambda g: tx.update(g, tx.init(None))[0])
    with pytest.raises(Exception, match="must be floating"):
        jax.block_until_ready(step({"w": jnp.ones(3), "n": jnp.ones(2, jnp.int32)}))
    np.testing.assert_array_equal(np.asarray(step({"w": jnp.ones(3)})["w"]), np.ones(3, np.float32))


@pytest.mark.mpi(min_size=2)
def test_structure_differing_across_ranks_raises_on_every_rank(comm):
    sync = GradientSync(comm)
    g = {"w": jnp.ones(3)}
    if comm.rank == 1:
        g["extra"] = jnp.ones(2)
    with pytest.raises(MismatchError, match="differs across ranks"):
        sync(g)
    shape = (4,) if comm.rank == 0 else (2, 2)     # same size, other shape
    with pytest.raises(MismatchError, match="differs across ranks"):
        sync({"w": jnp.ones(shape)})
    np.testing.assert_array_equal(np.asarray(sync({"w": jnp.ones(3)})["w"]), np.ones(3, np.float32))
    # a structure known on some ranks only: check="always" compares on every call
    sync = GradientSync(comm, check="always")
    sync({"w": jnp.ones(3)})
    with pytest.raises(MismatchError, match=r"rank 1: 2 leaves, 5 elements"):
        sync({"w": jnp.ones(3), **({"extra": jnp.ones(2)} if comm.rank == 1 else {})})


def test_mixed_devices_raise_on_every_rank(comm):
    devs = jax.devices("cpu")
    if len(devs) < 2:
        pytest.skip("jax was initialized before this module set two host devices")
    sync = GradientSync(comm)
    other = devs[1] if comm.rank == 0 else devs[0]
    g = {"a": jax.device_put(jnp.ones(3), devs[0]), "b": jax.device_put(jnp.ones(3), other)}
    with pytest.raises(ValidationError, match="rank 0 rejected its pytree: leaves are on 2 devices"):
        sync(g)
    # one device that is not the default: the result stays there
    g = {"a": jax.device_put(jnp.ones(3), devs[1])}
    out = sync(g)
    assert out["a"].devices() == {devs[1]}
    sharded = jax.device_put(jnp.ones(4), jax.sharding.PositionalSharding(devs[:2])) \
        if hasattr(jax.sharding, "PositionalSharding") else jax.device_put(
            jnp.ones(4), jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devs[:2]), ("x",)),
                                                    jax.sharding.PartitionSpec("x")))
    with pytest.raises(ValidationError, match="sharded over 2 devices"):
        sync({"s": sharded})


@pytest.mark.parametrize("jit", [False, True])
def test_a_strategys_own_state_resumes_through_its_state_dict(comm, jit):
    """average_gradients' optax state is empty; a sparse strategy's residuals and thresholds come back
    through strategy.state_dict() / load_state_dict() (README's JAX paragraph), and the run resumed
    so equals the one that was not stopped."""
    from commlib.sparsify import ExDyna, SparseAllReduce

    def run(params, strategy, todo):
        tx = optax.chain(average_gradients(comm=comm, strategy=strategy), optax.sgd(0.1))

        def step_fn(params, state, x, y):
            updates, state = tx.update(jax.grad(loss_fn)(params, x, y), state, params)
            return optax.apply_updates(params, updates), state

        step_fn = jax.jit(step_fn) if jit else step_fn
        state = tx.init(params)
        mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
        for step in todo:
            x, y = batch(step, comm.size)
            params, state = step_fn(params, state, x[mine], y[mine])
        return params

    def sparse():
        return SparseAllReduce(selector=ExDyna(density=0.05), cap_mb=SMALL)

    start = broadcast_params(init_params(comm.rank), comm=comm)
    whole = run(start, sparse(), range(STEPS))
    first = sparse()
    params = run(start, first, range(2))
    resumed = sparse()
    resumed.load_state_dict(first.state_dict())
    np.testing.assert_array_equal(flat(run(params, resumed, range(2, STEPS))), flat(whole))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("make", [AllReduce, DeAR])
def test_one_strategy_object_serves_several_gradient_syncs(comm, jit, make):
    """Two ``average_gradients`` given one strategy object (a GAN's two models): once the second had
    run, the first returned each rank's own gradient (DeAR: part averaged, part local), silently.
    Each sets the strategy up again for its tree; both trees average as numpy does."""
    s = make(cap_mb=SMALL)
    t1, t2 = average_gradients(comm=comm, strategy=s), average_gradients(comm=comm, strategy=s)
    f1, f2 = (jax.jit(t.update) if jit else t.update for t in (t1, t2))
    every = [np.random.default_rng(r).standard_normal(40).astype(np.float32) for r in range(comm.size)]
    mean = np.mean(every, axis=0, dtype=np.float64)
    mine = every[comm.rank]
    for _ in range(2):
        a, _ = f1({"w": jnp.asarray(mine[:24]).reshape(4, 6)}, optax.EmptyState())
        b, _ = f2({"v": jnp.asarray(mine[24:36]), "u": jnp.asarray(mine[36:])}, optax.EmptyState())
        np.testing.assert_allclose(np.asarray(a["w"]).ravel(), mean[:24], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(b["v"]), mean[24:36], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(b["u"]), mean[36:], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("jit", [False, True])
def test_a_sparse_strategy_keeps_each_trees_state_and_serves_one_sync(comm, jit):
    """One ``average_gradients`` with a sparse strategy for two trees (one optax transformation,
    two models): the other tree's residuals were added to this one's (same sizes: 101 off) or this
    one's dropped at every switch (other sizes).  Each tree keeps its own: tree A interleaved with
    another averages exactly as A alone.  A second ``average_gradients`` given the same sparse
    strategy raises on every rank before it communicates."""
    from commlib.sparsify import SparseAllReduce, TopK

    def sparse():
        return SparseAllReduce(selector=TopK(density=0.25))

    rng = np.random.default_rng(comm.rank)
    grads = [jnp.asarray(rng.standard_normal(16).astype(np.float32)) for _ in range(4)]
    alone = average_gradients(comm=comm, strategy=sparse())
    run = jax.jit(alone.update) if jit else alone.update
    want = [np.asarray(run({"a": g}, optax.EmptyState())[0]["a"]) for g in grads]
    for other in ({"b": jnp.full(16, 100.0 * (comm.rank + 1))}, {"c": jnp.ones(10)}):
        shared = average_gradients(comm=comm, strategy=sparse())
        run = jax.jit(shared.update) if jit else shared.update
        for g, w in zip(grads, want):
            np.testing.assert_array_equal(np.asarray(run({"a": g}, optax.EmptyState())[0]["a"]), w)
            run(other, optax.EmptyState())
    s = sparse()
    first, second = average_gradients(comm=comm, strategy=s), average_gradients(comm=comm, strategy=s)
    (jax.jit(first.update) if jit else first.update)({"a": grads[0]}, optax.EmptyState())
    with pytest.raises(Exception, match="serves another GradientSync") as err:
        (jax.jit(second.update) if jit else second.update)({"a": grads[1]}, optax.EmptyState())
    assert isinstance(err.value, ValueError) or jit
    np.testing.assert_array_equal(np.asarray(comm.allreduce(np.ones(2))), np.full(2, comm.size))



@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("other", [(30, 7), (60, 7)], ids=["same-size", "other-size"])
def test_one_checkpoint_resumes_every_trees_sparse_state(comm, jit, other):
    """One ``average_gradients`` with ExDyna over two trees, checkpointed through
    ``strategy.state_dict()`` as README says: the checkpoint held only the tree averaged last,
    and its load went to whichever tree came first (same sizes: silently the other tree's
    residuals, 2.0 off; other sizes: a ValueError).  Now it holds each tree's, and the run
    resumed from it equals the one that was not stopped, step by step."""
    from commlib.sparsify import ExDyna, SparseAllReduce

    trees = ({"a": (37,)}, {"x": (other[0],), "y": (other[1],)})

    def grads(step):
        rng = np.random.default_rng([step, comm.rank])
        return {k: jnp.asarray(rng.standard_normal(n).astype(np.float32))
                for k, (n,) in trees[step % 2].items()}

    def run(strategy, steps):
        sync = average_gradients(comm=comm, strategy=strategy)
        update = jax.jit(sync.update) if jit else sync.update
        return [flat(update(grads(t), optax.EmptyState())[0]) for t in steps]

    def sparse():
        return SparseAllReduce(selector=ExDyna(density=0.1))

    whole = run(sparse(), range(8))
    first = sparse()
    run(first, range(5))                       # A, B, A, B, A: A is set up when it is saved
    saved = first.state_dict()
    assert len(saved["trees"]) == 1
    resumed = sparse()
    resumed.load_state_dict(saved)
    for got, want in zip(run(resumed, range(5, 8)), whole[5:]):    # B first
        np.testing.assert_array_equal(got, want)
    stranger = sparse()         # a tree the checkpoint does not hold starts afresh, with a warning
    average_gradients(comm=comm, strategy=stranger).update({"z": jnp.ones(5)}, optax.EmptyState())
    with pytest.warns(UserWarning, match="holds none of the tree '1 leaves, 5 elements #"):
        stranger.load_state_dict(saved)
    assert stranger.steps == saved["steps"] and len(stranger.state_dict()["trees"]) == 2

def test_arguments_are_checked():
    with pytest.raises(ValueError, match="give cap_mb"):
        GradientSync(strategy=AllReduce(), cap_mb=1)
    with pytest.raises(TypeError, match="GradientSync: expected a commlib.collectives Strategy .* got str"):
        GradientSync(strategy="dear")
    with pytest.raises(TypeError, match="sharded_optimizer: expected .* got str"):
        sharded_optimizer(optax.sgd(0.1), strategy="dear")
    with pytest.raises(ValueError, match="sharded strategy"):
        sharded_optimizer(optax.sgd(0.1), strategy=AllReduce())
    with pytest.raises(ValueError, match="re-shard"):
        sharded_optimizer(optax.sgd(0.1), strategy=DeAR(tune=True))
    # strategies that average parameters cannot be driven from gradients alone (they returned
    # wrong gradients silently: SyncSwitch's ASP exchanged the unchanged buffers' zero deltas)
    for strategy in (SelSync(mode="grads"), SelSync(mode="params"), SyncSwitch()):
        with pytest.raises(ValueError, match="reads and writes the parameters"):
            GradientSync(strategy=strategy)
        with pytest.raises(ValueError, match="reads and writes the parameters"):
            average_gradients(strategy=strategy)


def test_jitted_step_then_eager_metrics_allreduce(comm):
    """A jitted step's averaging (io_callback, on whichever thread XLA runs it) and an eager
    all-reduce issued at once on the thread driving ``comm`` never meet inside one communicator.

    The steps run on a second thread here, so that they overlap the metrics for certain (XLA on
    this CPU runs the callback inline): with one shared communicator, the ranks would match the
    two threads' collectives in different orders."""
    strategy = AllReduce(cap_mb=SMALL, first_cap_mb=SMALL / 2)
    tx = optax.chain(average_gradients(comm=comm, strategy=strategy), optimizer("sgd"))

    @jax.jit
    def step_fn(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    mine = slice(comm.rank * LOCAL, (comm.rank + 1) * LOCAL)
    params = broadcast_params(init_params(comm.rank), comm=comm)
    state = tx.init(params)
    x, y = batch(0, comm.size)
    params, state, loss = step_fn(params, state, x[mine], y[mine])   # traced here: the split happens
    assert strategy.comm is not comm and strategy.comm.size == comm.size

    def steps():
        nonlocal params, state, loss
        for step in range(1, STEPS):
            x, y = batch(step, comm.size)
            params, state, loss = step_fn(params, state, x[mine], y[mine])
            jax.block_until_ready(params)

    worker = threading.Thread(target=steps)
    worker.start()
    for i in range(20):                               # metrics while the steps communicate
        metrics = comm.allreduce(np.full(7, comm.rank + i, np.float32))
        np.testing.assert_array_equal(metrics, comm.size * (comm.size - 1) / 2 + comm.size * i)
    worker.join()
    assert np.isfinite(comm.allreduce(np.asarray(loss), "avg"))
    ref = reference("sgd", comm.size)
    for p, q in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=2e-5, atol=2e-6)
    same_on_all_ranks(comm, params)


def test_a_collective_on_a_traced_array_names_the_way_out(comm):
    """``comm.allreduce`` inside ``jax.jit`` gets a tracer, not an array: commlib's error says so
    on every rank (it was JAX's ConcretizationTypeError about ``devices()``); eagerly, a jax array
    works as any other."""
    x = jnp.arange(4.0) + comm.rank
    np.testing.assert_allclose(comm.allreduce(x), np.arange(4.0) * comm.size + sum(range(comm.size)))
    spare = comm.split(0)            # a rejected input aborts the communicator it was given to
    with pytest.raises(ValidationError, match="a traced jax array.*average_gradients"):
        jax.jit(lambda a: spare.allreduce(a))(x)
    spare.close()
