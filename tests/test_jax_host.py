"""``host_call``: the binding's ordered host calls inside ``jax.jit`` (XLA's FFI on the CPU backend,
``io_callback`` where that is not there), each way checked against numpy: operands and results as
pytrees, written in place, scalars, zero sizes, bfloat16, program order through ``scan`` and
``cond``, errors, and the host state a call changed there when the jitted function returns."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from commlib.bindings import jax_host  # noqa: E402
from commlib.bindings.jax import allgather, allreduce, broadcast  # noqa: E402
from commlib.bindings.jax_host import host_call  # noqa: E402


@pytest.fixture(params=["ffi", "io_callback"])
def mechanism(request, monkeypatch):
    """Each test both ways: XLA's FFI (what this JAX on CPU takes) and the io_callback fallback."""
    if request.param == "io_callback":
        monkeypatch.setattr(jax_host, "_PRIM", None)
    return request.param


def spec(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def test_this_jax_takes_the_ffi_path():
    """A JAX on which the FFI path fails to set up falls back silently: here, on the JAX the
    constraints install, it must not."""
    assert jax_host.MECHANISM == "ffi"


def test_results_written_in_place_and_returned(mechanism):
    def double(x, out):
        assert not x.flags.writeable         # XLA's operand: read-only
        np.multiply(x, 2, out=out)

    def halves(tree):
        return {"a": tree["a"] / 2, "n": np.int32(tree["b"].size)}

    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    f = jax.jit(lambda v: host_call(double, spec(v), host_call(double, spec(v), v, into=True) + 1, into=True))
    np.testing.assert_array_equal(f(x), (np.arange(6).reshape(2, 3) * 2 + 1) * 2)
    g = jax.jit(lambda v: host_call(halves, {"a": spec(v), "n": jax.ShapeDtypeStruct((), np.int32)},
                                    {"a": v, "b": v[0]}))
    got = g(x)
    np.testing.assert_array_equal(got["a"], np.arange(6).reshape(2, 3) / 2)
    assert int(got["n"]) == 3
    for v in (jnp.float32(3), jnp.ones(3, jnp.bfloat16), jnp.ones((0, 2), jnp.float32)):
        got = jax.jit(lambda v: host_call(double, spec(v), v, into=True))(v)
        np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(v, np.float64) * 2)


def test_calls_run_in_program_order_once_each(mechanism):
    seen: list[int] = []

    def note(k):
        def fn(x):
            seen.append(k)
            return x
        return fn

    def step(c, _):
        c = host_call(note(1), spec(c), c)
        return host_call(note(2), spec(c), c * 0.5), None

    def prog(v):
        v = jax.lax.scan(step, v, None, length=3)[0]
        v = jax.lax.cond(v.sum() > 0, lambda u: host_call(note(3), spec(u), u), lambda u: u, v)
        independent = host_call(note(4), spec(v), jnp.zeros_like(v))     # no data dependence on the rest
        return v + independent

    jax.jit(prog)(jnp.ones(4))
    assert seen == [1, 2, 1, 2, 1, 2, 3, 4]


def test_host_state_is_there_when_the_call_returns(mechanism):
    """As with io_callback, the jitted function has run its host calls when it returns (a strategy's
    state_dict() read right after a step is that step's)."""
    state = {"calls": 0}

    def count(x):
        state["calls"] += 1
        return x

    f = jax.jit(lambda v: host_call(count, spec(v), (v @ v) @ v))
    x = jnp.ones((256, 256))
    for k in range(1, 4):
        f(x)                                  # not blocked on
        assert state["calls"] == k


def test_a_traced_call_lives_as_long_as_its_program():
    """The handler's registry holds a call no longer than the jaxpr and the executable that use it."""
    import gc
    import weakref

    seen = []
    f = jax.jit(lambda v: host_call(lambda x: seen.append(1) or x, spec(v), v))
    f(jnp.ones(3))
    calls = [weakref.ref(c) for c in jax_host._CALLS.values()]
    assert seen == [1] and any(c() is not None for c in calls)
    del f
    jax.clear_caches()
    gc.collect()
    assert all(c() is None for c in calls)


def test_an_exception_fails_the_execution_naming_it(mechanism):
    def bad(x, out):
        raise ValueError("the host says no")

    f = jax.jit(lambda v: host_call(bad, spec(v), v, into=True))
    with pytest.raises(Exception, match="ValueError: the host says no"):
        f(jnp.ones(2)).block_until_ready()


def test_wrong_results_are_refused(mechanism):
    f = jax.jit(lambda v: host_call(lambda x: np.ones(5, np.float32), spec(v), v))
    with pytest.raises(Exception, match=r"returned shape \[5\], expected \[2\]"):
        f(jnp.ones(2, jnp.float32)).block_until_ready()


@pytest.mark.mpi
def test_jitted_collectives_match_numpy_either_way(comm, mechanism):
    """allreduce, allgather and broadcast inside one jitted program, in a scan, against numpy."""
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((comm.size, 3, 5)).astype(np.float32)

    def prog(x):
        def body(c, _):
            s = allreduce(c, "avg", comm=comm)
            g = allgather(c[0], comm=comm)
            b = broadcast(c, root=comm.size - 1, comm=comm)
            return s + b, g
        return jax.lax.scan(body, x, None, length=2)

    out, gathered = jax.jit(prog)(jnp.asarray(xs[comm.rank]))
    c = xs.astype(np.float64)
    want_g = []
    for _ in range(2):
        want_g.append(c[:, 0])
        c = np.broadcast_to(c.mean(0) + c[-1], c.shape)
    np.testing.assert_allclose(out, c[comm.rank], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gathered, np.stack(want_g), rtol=1e-5, atol=1e-5)
