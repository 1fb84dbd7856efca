"""bindings.jax's allreduce, allgather and broadcast: eager, inside ``jax.jit``, under ``jax.grad``.

References: numpy over every rank's input (each rank makes all of them), and for derivatives
one process differentiating the sum of every rank's objective (mpi4jax's rule).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

from commlib.bindings.jax import allgather, allreduce, average_gradients, broadcast  # noqa: E402
from commlib.errors import ValidationError  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)


def inputs(size: int, dtype: str) -> np.ndarray:
    """Every rank's input, (size, 3, 2): small integers, exact in every dtype and sum."""
    return np.random.default_rng(7).integers(-8, 9, size=(size, 3, 2)).astype(dtype)


def run(mode: str, fn, *args):
    return jax.jit(fn)(*args) if mode == "jit" else fn(*args)


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", ["float32", "int32", "bfloat16"])
def test_collectives_match_numpy(comm, mode, dtype):
    every = inputs(comm.size, "float32")
    x = jnp.asarray(every[comm.rank]).astype(dtype)
    root = comm.size - 1

    def all_of_them(v):         # several calls in one program: run in its order on every rank
        return (allreduce(v, "sum", comm), allreduce(v, "max", comm), allreduce(v, "min", comm),
                allgather(v, comm), broadcast(v, root, comm))

    got = run(mode, all_of_them, x)
    want = (every.sum(0), every.max(0), every.min(0), every, every[root])
    for g, w, name in zip(got, want, ["sum", "max", "min", "allgather", "broadcast"]):
        assert g.dtype == x.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(np.asarray(g, np.float64), w, err_msg=name)
    if dtype != "int32":
        avg = run(mode, lambda v: allreduce(v, "avg", comm), x)
        rtol = 1e-2 if dtype == "bfloat16" else 1e-6
        np.testing.assert_allclose(np.asarray(avg, np.float64), every.mean(0), rtol=rtol)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_complex_numbers_are_summed_averaged_and_moved(comm, mode):
    """complex64 (a spectral layer's values): summed and averaged as complex numbers, gathered and
    broadcast (max and min are refused while tracing: test_bad_input_raises_on_every_rank_...)."""
    every = inputs(comm.size, "float32") + 1j * inputs(comm.size, "float32")[:, ::-1]
    x = jnp.asarray(every[comm.rank]).astype(jnp.complex64)
    root = comm.size - 1
    got = run(mode, lambda v: (allreduce(v, "sum", comm), allreduce(v, "avg", comm), allgather(v, comm),
                               broadcast(v, np.int64(root), comm)), x)     # numpy's integer: a root too
    for g, w in zip(got, (every.sum(0), every.mean(0), every, every[root])):
        assert g.dtype == jnp.complex64 and g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6)


def objectives(size: int, root: int):
    """Rank r's objective of its own input, through each collective, and the sum over ranks of
    the same objectives written without collectives (one process, every rank's input)."""
    c = jnp.asarray(np.random.default_rng(3).standard_normal((size, size, 3, 2)), jnp.float32)
    ours = {
        "sum": lambda r, comm: lambda x: jnp.sum((c[r, 0] * allreduce(x, "sum", comm)) ** 2),
        "avg": lambda r, comm: lambda x: jnp.sum(jnp.sin(c[r, 0] * allreduce(x, "avg", comm))),
        "allgather": lambda r, comm: lambda x: jnp.sum((c[r] * allgather(x, comm)) ** 3),
        "broadcast": lambda r, comm: lambda x: jnp.sum(c[r, 0] * jnp.tanh(broadcast(x, root, comm))),
    }
    ranks = range(size)
    one = {
        "sum": lambda xs: sum(jnp.sum((c[r, 0] * xs.sum(0)) ** 2) for r in ranks),
        "avg": lambda xs: sum(jnp.sum(jnp.sin(c[r, 0] * xs.mean(0))) for r in ranks),
        "allgather": lambda xs: sum(jnp.sum((c[r] * xs) ** 3) for r in ranks),
        "broadcast": lambda xs: sum(jnp.sum(c[r, 0] * jnp.tanh(xs[root])) for r in ranks),
    }
    return ours, one


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", ["sum", "avg", "allgather", "broadcast"])
def test_gradients_are_those_of_the_summed_objective(comm, mode, name):
    every = inputs(comm.size, "float32") / 8
    ours, one = objectives(comm.size, root=comm.size - 1)
    got = run(mode, jax.grad(ours[name](comm.rank, comm)), jnp.asarray(every[comm.rank]))
    want = jax.grad(one[name])(jnp.asarray(every))[comm.rank]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_max_is_not_differentiable_on_every_rank(comm):
    f = jax.jit(jax.grad(lambda x: jnp.sum(allreduce(x, "max", comm))))
    with pytest.raises(TypeError, match="not differentiable"):
        f(jnp.ones(3))      # raised while tracing the backward pass: before any collective
    np.testing.assert_array_equal(allreduce(jnp.ones(3), "sum", comm), np.full(3, comm.size))


def test_vmap_is_refused_naming_commlib(comm):
    """Under ``jax.vmap`` (README: not supported) every rank raises, saying so and what to do
    (JAX's own "Batching rule for 'commlib_host_call' not implemented" named no one), before any
    collective; the communicator goes on."""
    from commlib.bindings.jax_host import MECHANISM

    if MECHANISM != "ffi":
        pytest.skip(f"the io_callback path ({MECHANISM}): JAX refuses vmap of an ordered effect itself")
    with pytest.raises(NotImplementedError, match="outside jax.vmap"):
        jax.jit(jax.vmap(lambda v: allreduce(v, comm=comm)))(jnp.ones((3, 2)))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: allreduce(v, comm=comm))(jnp.ones(2))),
                                  np.full(2, comm.size))


def test_bad_input_raises_on_every_rank_before_any_collective(comm):
    x = jnp.ones(3)
    for call, match in [(lambda: allreduce(x, "prod", comm), "op 'prod'"),
                        (lambda: allreduce(x > 0, "sum", comm), "dtype bool"),
                        (lambda: jax.jit(lambda v: allreduce(v.astype(jnp.int32), "avg", comm))(x),
                         "'avg' needs a floating"),
                        (lambda: jax.jit(lambda v: allreduce(v * 1j, "max", comm))(x), "'max' needs ordered"),
                        (lambda: jax.jit(lambda v: allgather(v.astype(jnp.uint8), comm))(x), "dtype uint8"),
                        (lambda: broadcast(x, comm.size, comm), "root"),
                        (lambda: allreduce([1.0], "sum", comm), "expected a jax or numpy array")]:
        with pytest.raises(ValidationError, match=match):
            call()
    seq = comm.seq
    np.testing.assert_array_equal(allreduce(x, "sum", comm), np.full(3, comm.size))    # still usable
    assert comm.seq == seq + 1


def test_a_jitted_step_averages_its_loss_as_one_process(comm):
    """mpi4jax's training step: gradients averaged (average_gradients) and the loss reported as
    the mean over ranks, all inside one jitted step; against one process on the whole batch."""
    rng = np.random.default_rng(11)
    xs, ys = rng.standard_normal((2, 4 * comm.size, 5)).astype(np.float32)
    w0 = jnp.asarray(rng.standard_normal(5), jnp.float32)

    def loss(w, x, y):
        return jnp.mean((x @ w - y[:, 0]) ** 2)

    def make(tx, reduce):
        @jax.jit
        def step(w, state, x, y):
            value, g = jax.value_and_grad(loss)(w, x, y)
            updates, state = tx.update(g, state, w)
            return optax.apply_updates(w, updates), state, reduce(value)
        return step

    mine = slice(4 * comm.rank, 4 * (comm.rank + 1))
    tx = optax.chain(average_gradients(comm=comm), optax.sgd(0.1))
    step, ref_step = make(tx, lambda v: allreduce(v, "avg", comm)), make(optax.sgd(0.1), lambda v: v)
    w, state, ref_w, ref_state = w0, tx.init(w0), w0, optax.sgd(0.1).init(w0)
    for _ in range(3):
        w, state, value = step(w, state, xs[mine], ys[mine])
        ref_w, ref_state, ref_value = ref_step(ref_w, ref_state, xs, ys)
        np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)


def test_successive_jitted_results_are_their_own(comm):
    """The callback's host buffer is reused across calls: each result must still be its own."""
    f = jax.jit(lambda v: (allreduce(v, "sum", comm), allgather(v, comm)))
    first, second = f(jnp.ones(4)), f(jnp.full(4, 2.0))
    np.testing.assert_array_equal(first[0], np.full(4, comm.size))
    np.testing.assert_array_equal(second[0], np.full(4, 2 * comm.size))
    np.testing.assert_array_equal(first[1], np.ones((comm.size, 4)))
    scalar = jax.jit(lambda v: allreduce(v, "max", comm))(jnp.float32(comm.rank))
    assert scalar.shape == () and float(scalar) == comm.size - 1


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_averaged_gradients_held_stay_their_own(comm, mode):
    """average_gradients' leaves come from the pool of host results (reused once nothing holds
    them; JAX takes them without a copy eagerly): seven results held, then each against its own."""
    tx = average_gradients(comm=comm)
    step = (lambda g: tx.update(g, tx.init(g))[0])
    step = jax.jit(step) if mode == "jit" else step
    n = 1 << 15                                    # two leaves of 128 KiB: one pooled bucket
    held = [step({"a": jnp.full(n, k * (comm.rank + 1.0)), "b": jnp.full((n // 8, 8), -k * 1.0)})
            for k in range(1, 8)]
    mean = (comm.size + 1) / 2
    for k, g in enumerate(held, 1):
        np.testing.assert_array_equal(g["a"], np.full(n, k * mean, np.float32))
        np.testing.assert_array_equal(g["b"], np.full((n // 8, 8), -k, np.float32))
