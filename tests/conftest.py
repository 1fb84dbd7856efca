"""Shared fixtures: the world communicator, array kinds, deterministic inputs.

Single-process runs (``pytest --with-mpi``) are a world of one; the same
tests run under ``mpiexec -n 2`` and ``-n 4`` with ``--with-mpi -m mpi``.
Every skip condition here is the same on every rank, so ranks never diverge.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import commlib

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_JAX = importlib.util.find_spec("jax") is not None


def _have_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy or no driver
        return False


HAVE_GPU = _have_gpu()
README = Path(__file__).resolve().parent.parent / "README.md"

#: ranks in this run, from the launcher's environment (importing mpi4py here would initialize MPI
#: in the processes that tests spawn and that import this module): 1 in the single-process run
WORLD_SIZE = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)


def ranks_at_most(n: int, why: str) -> pytest.MarkDecorator:
    """Skip a test in runs of more than ``n`` ranks (the same on every rank); ``why``: what a
    larger run would only repeat.  For tests whose cost is each rank's own compiling or spawning,
    which CI's 2 cores pay n times over at 4 ranks.

    Example:
        >>> @ranks_at_most(2, "the benchmark's quick run covers its code at 2 ranks")
        ... def test_quick_run(): ...
    """
    return pytest.mark.skipif(WORLD_SIZE > n, reason=f"runs at up to {n} ranks: {why}")

#: bucket caps that spread the tests' tiny models over several buckets
SMALL = {"cap_mb": 0.0002, "first_cap_mb": 0.0001}


def _strategies() -> dict:
    from commlib.collectives import AllReduce, DeAR, SelSync, SyncSwitch
    from commlib.sparsify import Dense, SparseAllReduce

    return {
        "allreduce": lambda: AllReduce(**SMALL),
        "dear": lambda: DeAR(**SMALL),
        "selsync0": lambda: SelSync(inner=AllReduce(**SMALL), delta=0.0, mode="grads"),
        "syncswitch-bsp": lambda: SyncSwitch(bsp=AllReduce(**SMALL)),
        "syncswitch-dear": lambda: SyncSwitch(bsp=DeAR(**SMALL)),
        "sparse-dense": lambda: SparseAllReduce(selector=Dense()),
    }


#: the training-loop tests' strategies by name, each a fresh one per call (SelSync at delta 0 and
#: Sync-Switch in BSP train as one process; SparseAllReduce with a dense selector too)
STRATEGIES = _strategies()


def assert_same_on_every_rank(comm, vec: np.ndarray) -> None:
    """Every rank's ``vec`` equals this rank's, bit for bit (replicas that must not drift).

    Example:
        >>> assert_same_on_every_rank(comm, params_of(model))
    """
    for r, other in enumerate(comm.allgather(vec)):
        np.testing.assert_array_equal(other, vec, err_msg=f"rank {r} differs from rank {comm.rank}")


def trains_as_one_process(comm, run, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    """``run(dist)`` trains and returns the parameters, flat: through commlib on every rank (``True``)
    and as one process on the whole batch (``False``); the replicas must be equal bit for bit and
    close to the one process's.

    Example:
        >>> trains_as_one_process(comm, lambda dist: train(comm, "dear" if dist else None))
    """
    vec = run(True)
    assert_same_on_every_rank(comm, vec)
    np.testing.assert_allclose(vec, run(False), rtol=rtol, atol=atol)


def clip_grad_norm(opt, model, dist: bool, max_norm: float) -> None:
    """A run's clipping by the global norm: the wrapped optimizer's ``clip_grad_norm_`` through
    commlib (``dist``), torch's over the model in the one-process reference.

    Example:
        >>> clip_grad_norm(opt, model, dist, 0.5)
    """
    if dist:
        opt.clip_grad_norm_(max_norm)
    else:
        import torch

        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def rank_part(comm, local: int, *batch):
    """This rank's ``local`` rows of each tensor of a global batch (rank ``r``: rows ``r * local`` on).

    Example:
        >>> x, y = rank_part(comm, 4, *batch(step, comm.size))
    """
    lo = comm.rank * local
    return tuple(t[lo:lo + local] for t in batch)


if HAVE_TORCH:
    import torch

    class Lookahead(torch.optim.Optimizer):
        """Lookahead (Zhang et al. 2019) as timm and others write it: it wraps another optimizer
        (``Lookahead(base)``), and every ``k`` steps moves slow weights ``alpha`` of the way to the
        fast ones and copies them back, reading the parameters right after ``base.step()``."""

        def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2):
            self.base, self.alpha, self.k, self.steps = base, alpha, k, 0
            super().__init__(base.param_groups, base.defaults)
            self.param_groups = base.param_groups

        @torch.no_grad()
        def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
            loss = self.base.step(closure)
            self.steps += 1
            if self.steps % self.k == 0:
                for group in self.param_groups:
                    for p in group["params"]:
                        if "slow" not in self.state[p]:
                            self.state[p]["slow"] = p.detach().clone()
                        slow = self.state[p]["slow"]
                        slow.add_(p - slow, alpha=self.alpha)
                        p.copy_(slow)
            return loss

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.base.zero_grad(set_to_none)


def checkpoint_bytes(**objects) -> bytes:
    """The ``state_dict()`` of each named object (``None`` kept as ``None``) through ``torch.save``:
    a checkpoint file's bytes, as a training loop writes one.

    Example:
        >>> ckpt = checkpoint_bytes(model=model, opt=opt, scaler=scaler)
    """
    import io

    import torch

    f = io.BytesIO()
    torch.save({k: None if o is None else o.state_dict() for k, o in objects.items()}, f)
    return f.getvalue()


def resume_from(ckpt: bytes, **objects) -> None:
    """Load :func:`checkpoint_bytes`'s ``ckpt`` (``torch.load``'s default, ``weights_only``) into the
    named objects (``None`` skipped), in the order given.

    Example:
        >>> resume_from(ckpt, model=model, opt=opt, scaler=scaler)
    """
    import io

    import torch

    state = torch.load(io.BytesIO(ckpt))
    for k, o in objects.items():
        if o is not None:
            o.load_state_dict(state[k])


def readme_example(heading: str) -> str:
    """The first python block of README.md under the section titled ``heading``, as it stands."""
    text = README.read_text()
    section = text[text.index(f"# {heading}\n"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("\n```", start)]
NO_GPU_REASON = "no CUDA device with cupy on this machine (GPU tests run on a lent GPU machine)"

NUMPY_DTYPES = {
    "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
    "float64": np.float64, "int32": np.int32, "int64": np.int64,
    "complex64": np.complex64, "complex128": np.complex128,
}
#: sizes: empty, one, primes, not divisible by 2, 3 or 4, and one that is
SIZES = [0, 1, 2, 3, 7, 13, 64, 1009]


@pytest.fixture(scope="session")
def comm() -> commlib.Communicator:
    return commlib.init(timeout=120)


def rank_input(rank: int, n: int, dtype: str, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: small integers (exact in every dtype) times 0.5 for floats (complex:
    in both parts)."""
    rng = np.random.default_rng([rank, n, salt, 12345])
    ints = rng.integers(-8, 9, size=n)
    dt = NUMPY_DTYPES[dtype]
    if dtype.startswith("int"):
        return ints.astype(dt)
    if dtype.startswith("complex"):
        return ((ints + 1j * rng.integers(-8, 9, size=n)) * 0.5).astype(dt)
    return (ints * 0.5).astype(dt)


def wide(dtype: str) -> type:
    """The reference's dtype for ``dtype``: complex128 for complex numbers, else float64."""
    return np.complex128 if dtype.startswith("complex") else np.float64


def heavy_tailed_grad(rank: int, step: int, numel: int, dtype=np.float32, salt: int = 0) -> np.ndarray:
    """A heavy-tailed gradient, different per rank and step, whose scale drifts (the sparse tests' data).

    Example:
        >>> g = heavy_tailed_grad(comm.rank, step, 5000)
    """
    rng = np.random.default_rng([rank, step, numel, salt])
    scale = np.repeat(np.geomspace(0.1, 3.0, 8), numel // 8 + 1)[:numel]
    return (rng.standard_t(3, numel) * scale * (1 + 0.5 * np.sin(step / 4))).astype(dtype)


def all_inputs(size: int, n: int, dtype: str, salt: int = 0) -> np.ndarray:
    """Every rank's input in float64 (complex128), shape (size, n): the reference's raw material."""
    return np.stack([rank_input(r, n, dtype, salt).astype(wide(dtype)) for r in range(size)])


def reference(op: str, stacked: np.ndarray) -> np.ndarray:
    """float64 numpy reference of a reduction over ranks."""
    return {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.max(0),
            "min": stacked.min(0)}[op] if stacked.shape[0] else stacked.sum(0)


def tolerance(dtype: str) -> float:
    return {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12, "complex64": 1e-6,
            "complex128": 1e-12}.get(dtype, 0)


def assert_close(actual, expected, dtype: str) -> None:
    a = np.asarray(actual).astype(wide(dtype))
    np.testing.assert_allclose(a, expected, rtol=tolerance(dtype), atol=tolerance(dtype))
