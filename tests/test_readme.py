"""README.md's examples, run as they stand, each checked against a reference.

Each block runs in a namespace holding what the text leaves to the reader (a
model, parameters, the names an earlier block imported).  The torch training
loop has its own test, against single-process training
(``test_train_loops.test_readme_loop_runs_verbatim``).
"""

from __future__ import annotations

import numpy as np
import pytest

import commlib

from conftest import HAVE_JAX, HAVE_TORCH, readme_example

if HAVE_TORCH:
    import torch

    torch.set_num_threads(1)


def run(heading: str, **names) -> dict:
    ns = dict(names)
    exec(compile(readme_example(heading), "README.md", "exec"), ns)
    return ns


@pytest.mark.mpi
def test_using_it(comm):
    """The collective calls: averaged in place, then reduce-scattered (a sum), against float64 numpy."""
    np.random.seed(comm.rank)      # the block draws from numpy's global generator
    ns = run("Using it")
    drawn = np.stack([np.random.RandomState(r).rand(1 << 20).astype(np.float32).astype(np.float64)
                      for r in range(comm.size)])
    mean = drawn.mean(0)
    np.testing.assert_allclose(ns["g"], mean, rtol=1e-6)
    counts = commlib.split_counts(mean.size, comm.size)
    lo = sum(counts[:comm.rank])
    np.testing.assert_allclose(ns["shard"], comm.size * mean[lo:lo + counts[comm.rank]], rtol=1e-5)


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_JAX, reason="jax is not installed")
def test_jax(comm):
    """Rank 0's parameters everywhere; two AdamW steps (eager, then jitted) on the averaged gradient."""
    import jax
    import jax.numpy as jnp
    import optax

    def start(rank: int) -> dict:
        return {"w": jnp.full((4, 3), float(rank + 1)), "b": jnp.arange(3.0) * (rank + 1)}

    def grads(rank: int, step: int) -> dict:
        return {"w": jnp.full((4, 3), (rank + 1.0) * (step + 1)), "b": jnp.arange(3.0) - rank * step}

    ns = run("JAX", params=start(comm.rank))
    params, tx = ns["params"], ns["tx"]
    ref_params, ref_tx = start(0), optax.adamw(1e-3)
    state, ref_state = tx.init(params), ref_tx.init(ref_params)
    update = jax.jit(tx.update)
    for step, fn in enumerate([tx.update, update]):
        updates, state = fn(grads(comm.rank, step), state, params)
        params = optax.apply_updates(params, updates)
        every = [grads(r, step) for r in range(comm.size)]
        mean = jax.tree_util.tree_map(lambda *g: sum(g) / comm.size, *every)
        ref_updates, ref_state = ref_tx.update(mean, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
    for k in ref_params:
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(ref_params[k]), rtol=1e-6, err_msg=k)


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_JAX, reason="jax is not installed")
def test_jax_selsync(comm):
    """Four steps of SelSync in grads mode: all inside its warm-up (25 steps), so synchronized, and
    the result is one process's SGD with momentum on the concatenated batches."""
    import jax
    import jax.numpy as jnp
    import optax

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    grad_fn = jax.jit(jax.grad(loss))
    rng = np.random.default_rng(5)
    data = [(rng.standard_normal((2 * comm.size, 4)).astype(np.float32),
             rng.standard_normal((2 * comm.size, 2)).astype(np.float32)) for _ in range(4)]
    mine = slice(2 * comm.rank, 2 * comm.rank + 2)
    start = {"w": jnp.full((4, 2), 0.1 * (comm.rank + 1)), "b": jnp.zeros(2)}
    ns = run("SelSync and Sync-Switch under optax", params=start, grad_fn=grad_fn,
             batches=[(x[mine], y[mine]) for x, y in data])
    assert ns["tx"].strategy.stats["syncs"] == 4
    ref, ref_tx = {"w": jnp.full((4, 2), 0.1), "b": jnp.zeros(2)}, optax.sgd(0.05, momentum=0.9)
    ref_state = ref_tx.init(ref)
    for x, y in data:
        updates, ref_state = ref_tx.update(grad_fn(ref, x, y), ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    for k in ref:
        np.testing.assert_allclose(np.asarray(ns["params"][k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_sparse_gradients(comm):
    """ExDyna's first step: the gradient written back is the ranks' mean on the selected
    indices (no residual yet) and zero elsewhere, about 1% of them, the same on every rank."""
    from commlib.bindings.torch import DistributedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    local = model.weight.detach().clone(), model.bias.detach().clone()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(comm.rank))
    ns = run("Sparse gradients: ExDyna and baselines", torch=torch, DistributedOptimizer=DistributedOptimizer,
             model=model)
    opt = ns["opt"]
    opt.zero_grad()
    model(x).square().sum().backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()

    plain = torch.nn.Linear(64, 32)
    with torch.no_grad():
        plain.weight.copy_(local[0])
        plain.bias.copy_(local[1])
    plain(x).square().sum().backward()
    mine = torch.cat([plain.weight.grad.reshape(-1), plain.bias.grad.reshape(-1)]).numpy()
    mean = comm.allgather(mine.astype(np.float64)).mean(0)
    chosen = np.flatnonzero(got)
    assert 0.5 * 0.01 * got.size <= chosen.size <= 2 * 0.01 * got.size, chosen.size
    np.testing.assert_allclose(got[chosen], mean[chosen], rtol=1e-5)
    for r, other in enumerate(comm.allgather(got)):
        np.testing.assert_array_equal(other, got, err_msg=f"rank {r}")


@pytest.mark.mpi
def test_gates():
    """The four strategies are made as written, with the settings the text gives them."""
    ns = run("Gates: SelSync and Sync-Switch")
    gate = ns["gate"]
    assert (gate.delta, gate.mode, type(gate.inner).__name__) == (0.3, "params", "AllReduce")
    assert isinstance(ns["offline"].policy, ns["OfflinePolicy"])
    assert isinstance(ns["online"].policy, ns["StragglerPolicy"])
    assert ns["sharded"].sharded and type(ns["sharded"].bsp).__name__ == "DeAR"    # BSP first, on shards


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_coming_from_horovod(comm):
    """The "after" line of the block (Horovod itself is not installed): the averaged all-reduce."""
    block = readme_example("Coming from Horovod")
    after = "\n".join(line for line in block.splitlines() if not line.startswith("import horovod"))
    ns: dict = {}
    exec(compile(after, "README.md", "exec"), ns)
    hvd = ns["hvd"]
    hvd.init()
    assert (hvd.rank(), hvd.size()) == (comm.rank, comm.size)
    got = hvd.allreduce(torch.full((5,), float(comm.rank)), name="readme")
    np.testing.assert_allclose(got.numpy(), np.full(5, (comm.size - 1) / 2))


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_JAX, reason="jax is not installed")
def test_jax_collectives_inside_jit(comm):
    """The jitted error rate over every rank's slice of a validation set, against numpy on the whole set."""
    import jax.numpy as jnp

    rng = np.random.default_rng(4)
    w, b = rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    sizes = [3 + r for r in range(comm.size)]            # uneven slices: the counts are summed too
    xs = [rng.standard_normal((n, 5)).astype(np.float32) for n in sizes]
    ys = [rng.integers(0, 3, n) for n in sizes]
    ns = run("Collectives inside `jax.jit` (mpi4jax's calls)")
    got = ns["error_rate"]({"w": jnp.asarray(w), "b": jnp.asarray(b)}, jnp.asarray(xs[comm.rank]),
                           jnp.asarray(ys[comm.rank]))
    x, y = np.concatenate(xs), np.concatenate(ys)
    np.testing.assert_allclose(float(got), np.mean((x @ w + b).argmax(-1) != y), rtol=1e-6)
