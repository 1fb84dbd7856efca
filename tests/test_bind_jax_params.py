"""bindings.jax_params: SelSync and Sync-Switch under optax, against one process that simulates every rank.

The reference runs each rank's steps in this process (its own slice of each
batch, its own optimizer state), synchronizing where the library's gate
decided to (read from its trace, the same on every rank) or where the
Sync-Switch schedule says: averages of the ranks' gradients, parameters or
optimizer states, and in ASP the parameter store's sum of the pushed changes.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from test_bind_jax import LOCAL, apply_updates, batch, flat, grad_fn, init_params, optimizer  # noqa: E402

from commlib.bindings.jax import DistributedOptimizer, average_gradients, broadcast_params  # noqa: E402
from commlib.collectives import AllReduce, DeAR, SelSync, SyncSwitch  # noqa: E402
from commlib.collectives.policies import OfflinePolicy, SchedulePolicy  # noqa: E402
from commlib.errors import MismatchError, ValidationError  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)

STEPS = 8
JUMPS = {4: 8.0, 7: 0.1}         # steps whose targets are scaled: the gradient norm jumps, the gate syncs
SWITCHES = [(0, "bsp"), (2, "asp"), (5, "bsp")]
LAST_ASP = 4                      # its switch back to BSP meets every rank at a barrier


def local_batch(step: int, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = batch(step, size)
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    return x[mine], y[mine] * np.float32(JUMPS.get(step, 1.0))


def mean(trees: list) -> dict:
    return jax.tree_util.tree_map(lambda *xs: sum(xs) / len(xs), *trees)


def averaged_state(states: list) -> list:
    """Every rank's optimizer state with its floating leaves averaged (the binding's rule)."""
    def avg(*xs):
        return sum(xs) / len(xs) if jax.numpy.issubdtype(xs[0].dtype, jax.numpy.inexact) else xs[0]
    return [jax.tree_util.tree_map(avg, *states)] * len(states)


def close(a, b, what: str) -> None:
    np.testing.assert_allclose(flat(a), flat(b), rtol=2e-5, atol=2e-6, err_msg=what)


def replicas(comm, params) -> np.ndarray:
    return np.asarray(comm.allgather(flat(params)))


# ---------------------------------------------------------------------- SelSync
def simulate_selsync(kind: str, mode: str, sync_state: bool, syncs: list[bool], size: int) -> list:
    tx = optimizer(kind)
    ps = [init_params(0)] * size
    states = [tx.init(ps[0])] * size
    drift = False                 # local steps since the last average (grads mode: of both)
    for step, sync in enumerate(syncs):
        grads = [grad_fn(ps[r], *local_batch(step, r, size)) for r in range(size)]
        if sync and mode == "grads":
            grads = [mean(grads)] * size
        for r in range(size):
            updates, states[r] = tx.update(grads[r], states[r], ps[r])
            ps[r] = apply_updates(ps[r], updates)
        realign = sync and mode == "grads" and drift
        if sync and (mode == "params" or realign):
            ps = [mean(ps)] * size
        if sync and (sync_state or realign):
            states = averaged_state(states)
        drift = not sync or (drift and not realign)
    return ps


@functools.cache
def jitted_step(tx):
    """The whole training step of ``tx`` (gradient, ``tx.update``, the updates applied) in one ``jax.jit``."""
    @jax.jit
    def step(params, state, x, y):
        updates, state = tx.update(grad_fn(params, x, y), state, params)
        return optax.apply_updates(params, updates), state
    return step


def train(comm, tx, params, state, steps: range, turns=lambda step: False, jit: bool = False) -> tuple:
    """Steps of ``tx`` on this rank's slices; ``turns(step)``: ranks step one after another (ASP);
    ``jit``: each step one jitted call (its callbacks done before the next rank's turn)."""
    for step in steps:
        for r in range(comm.size) if turns(step) else [comm.rank]:
            if r == comm.rank and jit:
                params, state = jitted_step(tx)(params, state, *local_batch(step, comm.rank, comm.size))
                jax.block_until_ready((params, state))
            elif r == comm.rank:
                grads = grad_fn(params, *local_batch(step, comm.rank, comm.size))
                updates, state = tx.update(grads, state, params)
                params = optax.apply_updates(params, updates)
            if turns(step):
                comm.barrier()
    return params, state


@pytest.mark.parametrize("kind,mode,sync_state,inner,jit", [
    ("sgd", "params", False, AllReduce, False), ("sgd", "params", True, AllReduce, False),
    ("adamw", "grads", False, AllReduce, False), ("sgd", "grads", True, AllReduce, False),
    ("sgd", "params", False, DeAR, False), ("adamw", "grads", False, DeAR, False),
    ("sgd", "params", True, AllReduce, True), ("adamw", "grads", False, AllReduce, True),
    ("sgd", "grads", True, DeAR, True)])
def test_selsync_trains_as_the_ranks_simulated_with_its_decisions(comm, kind, mode, sync_state, inner, jit):
    """Local steps and synchronized ones, as the gate decided them: every rank's parameters equal the
    simulation's for that rank; replicas are equal after a synchronized step and apart after a local one.
    Over DeAR the averages travel as reduce-scatter + all-gather; ``jit``: the whole step jitted."""
    gate = SelSync(inner(cap_mb=200 / 2**20), delta=0.5, window=2, warmup=2, mode=mode,
                   sync_optimizer_state=sync_state)
    tx = DistributedOptimizer(optimizer(kind), strategy=gate, comm=comm)
    params = init_params(0)
    state = tx.init(params)
    for step in range(STEPS):
        params, state = train(comm, tx, params, state, range(step, step + 1), jit=jit)
        table = replicas(comm, params)
        if gate.trace[-1][4]:
            np.testing.assert_allclose(table, table[[0] * comm.size], rtol=1e-6, atol=1e-7)
        elif comm.size > 1:
            assert np.abs(table - table[0]).max() > 1e-4, step
    syncs = [t[4] for t in gate.trace]
    assert syncs[:2] == [True, True] and True in syncs[2:] and False in syncs[2:], syncs
    expected = simulate_selsync(kind, mode, sync_state, syncs, comm.size)
    close(params, expected[comm.rank], f"rank {comm.rank}")
    assert gate.stats["local_steps"] == syncs.count(False)
    flushed = tx.flush(params)
    if syncs[-1]:
        close(flushed, params, "flush after a synchronized step")
    table = replicas(comm, flushed)
    np.testing.assert_allclose(table, table[[0] * comm.size], rtol=1e-6, atol=1e-7)
    close(flushed, mean(expected), "flush: the ranks' average")


def test_selsync_at_delta_zero_is_one_process(comm):
    """delta=0 synchronizes every step: grads mode with AdamW is one process on the whole batch."""
    tx = DistributedOptimizer(optimizer("adamw"), strategy=SelSync(delta=0.0, mode="grads"), comm=comm)
    params = init_params(0)
    params, _ = train(comm, tx, params, tx.init(params), range(STEPS))
    ref = simulate_selsync("adamw", "grads", False, [True] * STEPS, comm.size)
    close(params, ref[0], "one process")
    ref_tx, one = optimizer("adamw"), init_params(0)
    ref_state = ref_tx.init(one)
    for step in range(STEPS):
        x, y = zip(*[local_batch(step, r, comm.size) for r in range(comm.size)])
        updates, ref_state = ref_tx.update(grad_fn(one, np.concatenate(x), np.concatenate(y)), ref_state, one)
        one = apply_updates(one, updates)
    close(params, one, "one process on the concatenated batch")


def test_jitted_steps_never_meet_the_callers_collectives(comm):
    """Jitted steps dispatched back to back, with an all-reduce of the caller's on ``comm`` right after
    each, not waiting for the step: where dispatch is asynchronous (GPUs; on the CPU a step with
    callbacks returns when they are done) its callbacks run on XLA's thread meanwhile, so the
    strategy's collectives run on the optimizer's own communicator.  Both come out right; the steps,
    their decisions and the state after them are the eager run's."""
    runs = []
    for jit in (False, True):
        gate = SelSync(delta=0.5, window=2, warmup=2, mode="params")
        tx = DistributedOptimizer(optimizer("sgd"), strategy=gate, comm=comm)
        params = init_params(0)
        state = tx.init(params)
        for step in range(STEPS):
            if jit:
                params, state = jitted_step(tx)(params, state, *local_batch(step, comm.rank, comm.size))
            else:
                params, state = train(comm, tx, params, state, range(step, step + 1))
            total = comm.allreduce(np.full(3, comm.rank + step, np.float64))
            np.testing.assert_array_equal(total, comm.size * step + comm.size * (comm.size - 1) / 2)
        assert gate.comm is not comm and gate.comm.size == comm.size      # a split of it
        strategy_state = tx.state_dict()          # after the last step's callbacks
        assert strategy_state["steps"] == STEPS
        runs.append((flat(params), [t[4] for t in gate.trace]))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-6, atol=1e-7)
    assert runs[1][1] == runs[0][1]


@pytest.mark.parametrize("name", ["selsync", "syncswitch"])
def test_init_inside_jit_is_the_eager_one(comm, name):
    """``jax.jit(tx.init)`` (as a jitted ``TrainState.create`` calls it) sets the strategy up as the eager
    init does (the tree compared while tracing, the values and the set-up in an ordered callback): the
    state, and the run after it, jitted or eager steps, are the eager init's; it was refused ("runs
    eagerly").  Values that differ over the ranks are refused on every rank."""
    def fresh():
        strategy = (SelSync(delta=0.5, window=2, warmup=2, mode="params") if name == "selsync" else
                    SyncSwitch(AllReduce(cap_mb=200 / 2**20), policy=SchedulePolicy(SWITCHES, lr_scale=0.5)))
        return DistributedOptimizer(optimizer("sgd"), strategy=strategy, comm=comm)

    turns = (lambda step: False) if name == "selsync" else (lambda step: SWITCHES[1][0] <= step < LAST_ASP)
    runs = []
    for jit_init, jit_steps in ((False, False), (True, False), (True, True)):
        tx = fresh()
        params = init_params(0)
        state = (jax.jit(tx.init) if jit_init else tx.init)(params)
        assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(
            optimizer("sgd").init(params))
        params, state = train(comm, tx, params, state, range(STEPS), turns=turns, jit=jit_steps)
        runs.append((flat(params), flat(state), tx.state_dict()["steps"]))
    if name == "selsync":       # eager steps after either init; Sync-Switch's ranks push at once (LAST_ASP)
        np.testing.assert_array_equal(runs[1][0], runs[0][0])
        np.testing.assert_array_equal(runs[1][1], runs[0][1])
    for params, state, _ in runs[1:]:       # in the store's arrival order, and jitted steps round as XLA does
        close(params, runs[0][0], "parameters")
        close(state, runs[0][1], "optimizer state")
    assert [r[2] for r in runs] == [STEPS] * 3
    if comm.size > 1:           # raised by the callback: at the init (on the CPU) or the next step
        tx = fresh()
        with pytest.raises(Exception, match="differ across ranks .*broadcast_params"):
            state = jax.jit(tx.init)(init_params(comm.rank))
            train(comm, tx, init_params(comm.rank), state, range(1))


# ---------------------------------------------------------------------- Sync-Switch
def simulate_syncswitch(size: int, lr_scale: float) -> list:
    """BSP, then ASP (ranks in turns, the last ASP step all at once), then BSP again."""
    tx = optimizer("sgd")
    ps = [init_params(0)] * size
    states = [tx.init(ps[0])] * size
    store = None
    for step in range(STEPS):
        asp = SWITCHES[1][0] <= step < SWITCHES[2][0]
        grads = [grad_fn(ps[r], *local_batch(step, r, size)) for r in range(size)]
        if not asp:
            grads = [mean(grads)] * size
        changes = []
        for r in range(size):
            updates, states[r] = tx.update(grads[r], states[r], ps[r])
            if not asp:
                ps[r] = apply_updates(ps[r], updates)
                continue
            store = ps[r] if store is None else store
            changes.append(jax.tree_util.tree_map(lambda u: lr_scale * u, updates))
            if step != LAST_ASP:          # in turns: this rank's push, then its pull
                store = apply_updates(store, changes.pop())
                ps[r] = store
        if step == LAST_ASP:              # every rank's push, then the switch: all pull the store
            for c in changes:
                store = apply_updates(store, c)
            ps, states = [store] * size, averaged_state(states)
    return ps


@pytest.mark.parametrize("jit", [False, True])
def test_syncswitch_through_asp_and_back_is_the_simulated_store(comm, jit):
    """BSP (averaged gradients), ASP at half the learning rate (each rank's change pushed into the
    store, the store pulled), BSP again (replicas and momentum averaged): as simulated."""
    ss = SyncSwitch(AllReduce(cap_mb=200 / 2**20), policy=SchedulePolicy(SWITCHES, lr_scale=0.5))
    tx = DistributedOptimizer(optimizer("sgd"), strategy=ss, comm=comm)
    params = init_params(0)
    params, state = train(comm, tx, params, tx.init(params), range(STEPS),
                          turns=lambda step: SWITCHES[1][0] <= step < LAST_ASP, jit=jit)
    assert [(s["from"], s["to"], s["step"]) for s in ss.switches] == [("bsp", "asp", 2), ("asp", "bsp", 5)]
    close(params, simulate_syncswitch(comm.size, 0.5)[comm.rank], f"rank {comm.rank}")
    table = replicas(comm, params)
    np.testing.assert_allclose(table, table[[0] * comm.size], rtol=1e-6, atol=1e-7)
    momentum = np.asarray(comm.allgather(flat(state)))
    np.testing.assert_allclose(momentum, momentum[[0] * comm.size], rtol=1e-6, atol=1e-7)
    params, state = tx.close(params, state)
    assert ss.phase == "bsp" and not ss.stores
    with pytest.raises(RuntimeError, match="after close"):
        tx.update(params, state, params)


@pytest.mark.parametrize("first", ["bsp", "asp-jit"])
def test_close_in_asp_returns_every_rank_to_the_store(comm, first):
    """close() while asynchronous: back to BSP, every rank with the store's parameters and the
    averaged optimizer state (they had drifted apart).  ``asp-jit``: ASP from the first step, each
    rank's jitted step traced in its turn: tracing split a communicator (the optimizer state's
    average), a collective the other ranks, waiting for their turn, never entered (a timeout)."""
    asp = 0 if first == "asp-jit" else 1
    ss = SyncSwitch(AllReduce(), policy=SchedulePolicy([(0, "bsp"), (1, "asp")] if asp else "asp"))
    tx = DistributedOptimizer(optimizer("sgd"), strategy=ss, comm=comm)
    params = init_params(0)
    params, state = train(comm, tx, params, tx.init(params), range(3), turns=lambda step: step >= asp,
                          jit=first == "asp-jit")
    assert ss.phase == "asp"
    states = comm.allgather_object(state)
    params, state = tx.close(params, state)
    table = replicas(comm, params)
    np.testing.assert_allclose(table, table[[0] * comm.size], rtol=1e-6, atol=1e-7)
    close(state, averaged_state(states)[0], "the ranks' average state")


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name,jit", [("selsync-params", False), ("selsync-grads", False),
                                      ("syncswitch", False), ("selsync-grads", True), ("syncswitch", True)])
def test_each_rank_resumes_its_own_checkpoint_as_the_run_continued(comm, name, jit):
    """Each rank saves its parameters, optimizer state and strategy state after step 4 (SelSync
    flushed; Sync-Switch in ASP, replicas apart, the store saved with its state); a fresh job loading
    them trains on as the uninterrupted run does (``jit``: the steps jitted, the checkpoint taken
    between them)."""
    def make():
        if name == "syncswitch":
            s = SyncSwitch(AllReduce(), policy=SchedulePolicy(SWITCHES, lr_scale=0.5))
        else:
            s = SelSync(delta=0.5, window=2, warmup=2, mode=name.split("-")[1])
        return DistributedOptimizer(optimizer("sgd"), strategy=s, comm=comm)

    turns = (lambda step: SWITCHES[1][0] <= step < LAST_ASP) if name == "syncswitch" else (lambda step: False)
    tx = make()
    params = init_params(0)
    params, state = train(comm, tx, params, tx.init(params), range(4), turns, jit)
    if name != "syncswitch":
        params = tx.flush(params)
    saved = copy.deepcopy((params, state, tx.state_dict()))
    comm.barrier()      # every rank saved before any steps on (in ASP a peer's next push could land
    done, _ = train(comm, tx, params, state, range(4, STEPS), turns, jit)    # in a view saved later)

    again = make()
    params, state, strategy_state = saved
    again.init(params, same_start=False)
    again.load_state_dict(strategy_state, params)
    resumed, _ = train(comm, again, params, state, range(4, STEPS), turns, jit)
    if name == "syncswitch":       # the last ASP step's pushes meet in the store in arrival order
        # (float32 sums in either order: 1.04e-7 apart on one element of 0.0013 at 4 ranks, so the
        # absolute tolerance is a float32 rounding of the parameters' scale)
        np.testing.assert_allclose(flat(resumed), flat(done), rtol=1e-6, atol=1e-6 * np.abs(flat(done)).max())
    else:
        np.testing.assert_array_equal(flat(resumed), flat(done))
    assert again.strategy.steps == tx.strategy.steps == STEPS
    if name != "syncswitch":
        assert again.strategy.trace == tx.strategy.trace       # the same decisions, the same norms


# ---------------------------------------------------------------------- refusals
def test_what_cannot_run_here_is_refused_at_construction():
    inner = optax.sgd(0.1)
    with pytest.raises(ValueError, match="shards"):
        DistributedOptimizer(inner, strategy=SyncSwitch(bsp=DeAR()))
    with pytest.raises(ValueError, match="shards"):
        DistributedOptimizer(inner, strategy=DeAR())
    with pytest.raises(ValueError, match="momentum='keep'"):
        DistributedOptimizer(inner, strategy=SyncSwitch(policy=OfflinePolicy(0.5, 10, momentum="reset")))
    with pytest.raises(ValueError, match="cap_mb"):
        DistributedOptimizer(inner, strategy=AllReduce(tune=True))
    with pytest.raises(TypeError, match="GradientTransformation"):
        DistributedOptimizer(optax.sgd, strategy=SelSync())
    with pytest.raises(ValueError, match="DistributedOptimizer"):
        average_gradients(strategy=SelSync())


def test_settings_that_differ_across_ranks_raise_at_init_on_every_rank(comm):
    """The pytree was compared, not the strategy: SelSync's warmup (or a Sync-Switch policy's step
    count) differing on one rank met other collectives at the first step or switch (a hang or
    MPICH's internal assertion).  The strategy's repr travels with the tree now."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    last = comm.rank == comm.size - 1
    params = broadcast_params(init_params(0), comm=comm)
    for strategy in (SelSync(delta=0.3, warmup=2 if last else 6),
                     SyncSwitch(policy=OfflinePolicy(0.5, total_steps=12 if last else 8))):
        tx = DistributedOptimizer(optax.sgd(0.1), strategy=strategy, comm=comm)
        with pytest.raises(MismatchError, match=r"pytree or settings differs .*settings #\w+.*settings #\w+"
                           r".* where rank \d has '(warmup=2|total_steps=12)"):
            tx.init(params)
    sync = average_gradients(strategy=AllReduce(first_cap_mb=0.002 if last else 0.001), comm=comm)
    state = sync.init(params)
    with pytest.raises(MismatchError, match="pytree or settings differs"):
        sync.update(params, state)
    assert float(comm.allreduce(np.ones(1))[0]) == comm.size       # the communicator goes on


def test_bad_calls_raise_on_every_rank(comm):
    tx = DistributedOptimizer(optax.sgd(0.1), strategy=SelSync(delta=0.3), comm=comm)
    params = init_params(0)
    with pytest.raises(RuntimeError, match="before init"):
        tx.update(params, None, params)
    if comm.size > 1:               # apart: every rank is told, naming the way out
        with pytest.raises(ValidationError, match="broadcast_params"):
            tx.init(init_params(comm.rank))
        with pytest.raises(MismatchError, match="pytree or settings differs"):
            tx.init({"hidden": params["hidden"]} if comm.rank == comm.size - 1 else params)
    with pytest.raises(ValidationError, match="floating"):
        tx.init({"x": np.zeros(3, np.int32)})
    state = tx.init(broadcast_params(init_params(comm.rank), comm=comm))
    grads = grad_fn(params, *local_batch(0, comm.rank, comm.size))
    with pytest.raises(ValueError, match="params"):
        tx.update(grads, state)
    with pytest.raises(ValidationError, match="structure or shapes"):
        tx.update(grads["hidden"], state, params)
    with pytest.raises(TypeError, match="DistributedOptimizer.flush runs eagerly"):
        jax.jit(tx.flush)(params)
    with pytest.raises(TypeError, match="DistributedOptimizer.close runs eagerly"):
        jax.jit(lambda p: tx.close(p, state))(params)
    params, state = train(comm, tx, params, state, range(3))      # nothing was left half done
    plain = DistributedOptimizer(optax.sgd(0.1), strategy=AllReduce(), comm=comm)
    plain_state = plain.init(init_params(0))
    averaged, _ = plain.update(grads, plain_state)   # gradients only: params optional
    want = -0.1 * np.mean(comm.allgather(flat(grads)).astype(np.float64), axis=0)    # float64 reference
    np.testing.assert_allclose(flat(averaged), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    jitted, _ = jax.jit(lambda g, st: plain.update(g, st))(grads, plain_state)     # inside jit too
    np.testing.assert_array_equal(flat(jitted), flat(averaged))
    table = replicas(comm, params)
    np.testing.assert_allclose(table, table[[0] * comm.size], rtol=1e-6, atol=1e-7)
