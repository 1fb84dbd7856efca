"""Pytrees as fused buckets for :mod:`bindings.jax`: the plan of a tree structure, packing and
unpacking, the check that every rank has the same tree, and whether an optax transformation can
run on flat shards of the buckets."""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import commlib
from commlib.arrays import INEXACT_DTYPES, is_tracer, numpy_dtype
from commlib.collectives import TensorSpec, plan_buckets
from commlib.collectives.buckets import Bucket
from commlib.host_results import HOST_RESULTS
from commlib.ops import agree, digest

from .jax_global import summed_over_shards
from .jax_host import host_call


def _leaf_device(x: Any) -> tuple[Any, bool, str | None]:
    """(device or None, committed, error) of one concrete leaf."""
    devices = getattr(x, "devices", None)
    if devices is None:          # numpy array or scalar: the default device, uncommitted
        return None, False, None
    ds = devices()
    if len(ds) != 1:
        return None, False, (f"is sharded over {len(ds)} devices; gather it to one device first "
                             "(commlib's JAX binding takes single-device arrays)")
    return next(iter(ds)), bool(getattr(x, "committed", True)), None


class Plan:
    """Bucket plan and host buffers of one tree structure (shapes, dtypes, device)."""

    def __init__(self, treedef: Any, paths: Sequence[str], shapes: Sequence[tuple[int, ...]],
                 dtypes: Sequence[str], allowed: Sequence[str], world_size: int,
                 cap_bytes: int, first_cap_bytes: int | None, device: Any, committed: bool,
                 error: str | None):
        self.treedef = treedef
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.dtypes = list(dtypes)
        self.numels = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.device, self.committed = device, committed
        bad = [f"leaf {p} has dtype {d}" for p, d in zip(paths, self.dtypes) if d not in allowed]
        if bad and error is None:
            kinds = "floating or complex" if tuple(allowed) == INEXACT_DTYPES else "supported"
            error = (f"{'; '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}: leaves must be "
                     f"{kinds} ({', '.join(allowed)}); take other leaves out of the tree")
        self.error = error
        self.agreed = False
        text = repr((str(treedef), self.shapes, self.dtypes)).encode()
        sha = hashlib.sha256(text)
        h = np.frombuffer(sha.digest()[:16], np.int64)
        self.digest = (int(h[0]), int(h[1]))
        #: the tree's name for a strategy that keeps state per tree (the same on every rank and run)
        self.key = f"{len(self.shapes)} leaves, {sum(self.numels)} elements #{sha.hexdigest()[:12]}"
        self.buckets: list[Bucket] = []
        if error is None:
            # gradients become ready in reverse leaf order during backward
            specs = [TensorSpec(i, self.numels[i], self.dtypes[i], numpy_dtype(self.dtypes[i]).itemsize)
                     for i in reversed(range(len(self.shapes)))]
            self.buckets = plan_buckets(specs, world_size, cap_bytes, first_cap_bytes)
        self.buffers: list[np.ndarray] = []
        self.shards: list[np.ndarray] = []
        self._shard_fns: dict[int, Any] = {}    # rank -> compiled shards_of

    def allocate(self, sharded: bool) -> None:
        if not self.buffers:
            self.buffers = [np.zeros(b.padded, numpy_dtype(b.dtype)) for b in self.buckets]
        if sharded and not self.shards:
            self.shards = [np.zeros(b.shard_numel, numpy_dtype(b.dtype)) for b in self.buckets]

    def pack(self, b: int, leaves: Sequence[Any], into: list[np.ndarray] | None = None) -> None:
        buf = (into or self.buffers)[b]
        for s in self.buckets[b].slots:
            buf[s.offset:s.offset + s.numel] = np.asarray(leaves[s.index]).reshape(-1)

    def shards_of(self, leaves: Sequence[Any], rank: int) -> list[Any]:
        """``rank``'s shard of every bucket gathered from ``leaves`` (padding zero), as jax arrays:
        one compiled function, eagerly or inside ``jax.jit`` (where it is inlined: the leaves need
        not cross to the host)."""
        fn = self._shard_fns.get(rank)
        if fn is None:
            fn = self._shard_fns[rank] = jax.jit(
                lambda ls: [self._shard(b, ls, rank) for b in range(len(self.buckets))])
        return fn(list(leaves))

    def _shard(self, b: int, leaves: Sequence[Any], rank: int) -> Any:
        import jax.numpy as jnp

        bucket = self.buckets[b]
        pieces = sorted(bucket.pieces(rank), key=lambda p: p[2].start)
        # the leaves' own dtype (an optimizer state kept wider than bfloat16 parameters: optax's
        # mu_dtype=float32 stays float32), else the bucket's
        dtype = jnp.result_type(*(leaves[i] for i, _, _ in pieces)) if pieces else numpy_dtype(bucket.dtype)
        sh = bucket.shard(rank)
        parts, at = [], sh.start
        for i, flat, piece in pieces:
            if piece.start > at:
                parts.append(jnp.zeros(piece.start - at, dtype))
            parts.append(jnp.ravel(leaves[i])[flat].astype(dtype))
            at = piece.stop
        if sh.stop > at:
            parts.append(jnp.zeros(sh.stop - at, dtype))
        return jnp.concatenate(parts)

    def unpack(self, source: Sequence[np.ndarray] | None = None,
               into: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Numpy leaves of their own (never views of the reused buffers), from the pool of host
        results: JAX takes them without a copy, and a bucket's memory is reused once no leaf of
        it is held (a fresh copy of every bucket each step paid page faults: 27 MiB took 5.7 ms).
        ``source``: buffers laid out as the buckets (default :attr:`buffers`); ``into``: arrays shaped
        as the leaves to write instead (XLA's result buffers inside ``jax.jit``), returned."""
        source = self.buffers if source is None else source
        if into is not None:
            for b, bucket in enumerate(self.buckets):
                for s in bucket.slots:
                    into[s.index].reshape(-1)[:] = source[b][s.offset:s.offset + s.numel]
            return list(into)
        out: list[np.ndarray | None] = [None] * len(self.shapes)
        for b, bucket in enumerate(self.buckets):
            copy = HOST_RESULTS.empty((bucket.numel,), source[b].dtype)
            np.copyto(copy, source[b][:bucket.numel])
            for s in bucket.slots:
                out[s.index] = copy[s.offset:s.offset + s.numel].reshape(self.shapes[s.index])
        for i, o in enumerate(out):     # zero-size leaves have no slot
            if o is None:
                out[i] = np.zeros(self.shapes[i], numpy_dtype(self.dtypes[i]))
        return out  # type: ignore[return-value]

    def to_jax(self, arrays: list[np.ndarray]) -> list[Any]:
        if self.device is not None and self.committed:
            return jax.device_put(arrays, self.device)
        return jax.device_put(arrays)

    def describe(self) -> list[dict]:
        return [b.describe() for b in self.buckets]


def agree_plan(comm: commlib.Communicator, plan: Plan, who: str, problem: str | None = None,
               settings: str = "") -> None:
    """Compare ``plan`` and ``settings`` (the strategy's repr) over the ranks (one all-gather); raise the
    same error on every rank, also where some rank has a ``problem`` of its own with what comes with
    the tree."""
    tree = repr((str(plan.treedef), plan.shapes, plan.dtypes))
    agree(comm, who, f"settings {settings} | pytree {tree}", noun="pytree",
          differs="pytree or settings" if settings else "pytree",
          summary=f"{len(plan.shapes)} leaves, {sum(plan.numels)} elements (#{digest(tree)})"
          + (f", settings #{digest(settings)}" if settings else ""), problem=plan.error or problem)
    plan.agreed = True


def make_plan(tree: Any, leaves: Sequence[Any], treedef: Any, allowed: Sequence[str],
               world_size: int, cap_bytes: int, first_cap_bytes: int | None) -> Plan:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    error, device, committed = None, None, False
    if not any(is_tracer(x) for x in leaves):
        seen: dict[Any, str] = {}
        for p, x in zip(paths, leaves):
            dev, com, err = _leaf_device(x)
            if err:
                error = f"leaf {p} {err}"
                break
            if dev is not None:
                seen.setdefault(dev, p)
                device, committed = (dev, com) if device is None else (device, committed or com)
        if error is None and len(seen) > 1:
            where = ", ".join(f"{p} on {d}" for d, p in seen.items())
            error = (f"leaves are on {len(seen)} devices ({where}); move them to one device "
                     "(jax.device_put) before averaging")
    dtypes = [np.dtype(x.dtype).name if hasattr(x, "dtype") else np.asarray(x).dtype.name
              for x in leaves]
    shapes = [tuple(np.shape(x)) for x in leaves]
    return Plan(treedef, paths, shapes, dtypes, allowed, world_size, cap_bytes, first_cap_bytes,
                 device, committed, error)


class _PiecesSum:
    """``total`` for :func:`summed_over_shards` in :func:`shard_problem`'s trial, whose pieces (the
    ranks' shards) run one after another: each sum asked for is recorded (:attr:`seen`) and answered
    from :attr:`totals`, the sums over the pieces of the round before (its own sum at first)."""

    def __init__(self) -> None:
        self.seen: list[float] = []
        self.totals: list[float] = []

    def answer(self, sq: np.ndarray) -> np.ndarray:
        k = len(self.seen)
        self.seen.append(float(sq))
        return np.asarray(self.totals[k] if k < len(self.totals) else sq, dtype=np.asarray(sq).dtype)

    def __call__(self, sq: Any) -> Any:
        return host_call(self.answer, jax.ShapeDtypeStruct((), sq.dtype), sq)


def shard_problem(inner: Any) -> str | None:
    """Why optax transformation ``inner`` cannot run on shards, or ``None``: each rank runs it on its
    flat shards of the buckets, which updates as on the leaves only where an element's update
    depends on that element alone (not LAMB's trust ratio, ``clip_by_global_norm``, Adafactor, nor
    ``apply_if_finite``'s skip of the whole update, which each shard would decide alone).
    Tried, as :func:`bindings.torch_state.shard_problem` tries a torch optimizer: one 4x6 leaf
    against its flat halves, each with a state of its own, six steps of a quadratic whose
    gradients (~100 an element) are larger than any usual clipping norm; then the same with the
    first element's gradient infinite at the third step.

    Example:
        >>> shard_problem(optax.lamb(1e-3))     # 'the transformation is not elementwise (...)'
    """
    try:
        hash(inner)
    except TypeError:               # not hashable: tried each time
        return _tried.__wrapped__(inner)
    return _tried(inner)            # once per transformation (0.1-0.5 s)


@functools.lru_cache(maxsize=64)
def _tried(inner: Any) -> str | None:
    """:func:`shard_problem`'s trial."""
    import jax.numpy as jnp

    rng = np.random.default_rng(1234)
    w0, a, b = rng.random((3, 4, 6)) + np.array([-0.5, 0.5, -0.5])[:, None, None]
    a, b = 100 * a, 100 * b
    sums = _PiecesSum()
    # one compilation per shape (eager ops cost seconds), of a function of its own: jax.jit(inner.update)
    # would share its traces, whose callbacks are bound to their sums, with other jits of inner.update
    update = jax.jit(lambda u, s, p: inner.update(u, s, p))

    def train(pieces: list[tuple[np.ndarray, ...]], poisoned: bool = False) -> np.ndarray:
        """The pieces in lockstep, as ranks: a sum over the shards inside ``inner`` (the squares of
        :func:`bindings.jax_global.clip_by_global_norm`, the non-finite count of ``apply_if_finite``)
        sums the pieces'."""
        ws = [jnp.asarray(w, jnp.float32) for w, _, _ in pieces]
        states = [inner.init([w]) for w in ws]
        for step in range(6):
            grads = []
            for k, (w, (_, aw, bw)) in enumerate(zip(ws, pieces)):
                g = np.asarray(aw * np.asarray(w) + bw, np.float32)
                if poisoned and k == 0 and step == 2:       # the whole leaf's first element: piece 0's
                    g.reshape(-1)[0] = np.inf
                grads.append(jnp.asarray(g))
            totals: list[float] = []
            for _ in range(4):      # each round hands back the sums the last one saw (one more sum right)
                seen, outs = [], []
                for k in range(len(pieces)):
                    sums.seen, sums.totals = [], totals
                    outs.append(update([grads[k]], states[k], [ws[k]]))
                    seen.append(sums.seen)
                new = [float(np.sum(col)) for col in zip(*seen)]
                if new == totals or not new:
                    break
                totals = new
            states = [st for _, st in outs]
            ws = [w + out[0] for w, (out, _) in zip(ws, outs)]
        return np.concatenate([np.ravel(w) for w in ws])

    def halves() -> list[tuple[np.ndarray, ...]]:
        return [tuple(t.reshape(-1)[k * 12:(k + 1) * 12] for t in (w0, a, b)) for k in range(2)]

    try:
        with summed_over_shards(sums):
            whole = train([(w0, a, b)])
    except Exception:       # noqa: BLE001 - not runnable on a list of arrays: its own error comes later
        return None
    try:
        with summed_over_shards(sums):
            split = train(halves())
    except Exception as e:  # noqa: BLE001
        return f"the transformation is not elementwise (on a flat piece: {e})"
    size = float(np.abs(whole - w0.reshape(-1)).max())
    off = float(np.abs(split - whole).max())
    if off > 1e-5 * size:
        return (f"the transformation is not elementwise (its update of an element depends on others: on "
                f"the two flat halves of a leaf, each with a state of its own as on two ranks' shards, it "
                f"differed from its update of the whole by {off / size:.2g} of its size)")
    with summed_over_shards(sums):
        whole, split = train([(w0, a, b)], poisoned=True), train(halves(), poisoned=True)
    if not np.allclose(split, whole, rtol=0, atol=1e-5 * size, equal_nan=True):
        return ("the transformation is not elementwise on non-finite gradients (with one element's "
                "gradient infinite at one step, its update of the other elements differed on two ranks' "
                "shards from its update of the whole: a skip of the whole update, as optax.apply_if_finite "
                "makes, would be decided by each shard alone)")
    return None


def tree_problem(inner: Any, tree: Any) -> str | None:
    """Why elementwise ``inner`` (see :func:`shard_problem`) cannot run on the shards of ``tree``'s
    buckets, or ``None``: it decides by the tree itself (a mask or labels computed from the leaves'
    paths or keys, or given as a tree of the parameters' structure, as ``optax.masked``,
    ``optax.multi_transform`` and ``optax.adamw(mask=...)`` take them), which the shards, flat
    arrays in a list, do not have: every leaf would be treated alike, silently.  Tried: two steps on
    a small stand-in of ``tree`` (each leaf of its own dimensions, two elements each) against the
    same leaves in a list (a transformation that fails on the tree itself: its own error comes later).

    Example:
        >>> tree_problem(optax.masked(optax.adam(1e-3), lambda p: {"w": True, "b": False}), params)
        'it takes the tree's structure ...'
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return None
    if any(is_tracer(x) for x in leaves):     # jax.jit(tx.init): tried eagerly, on a thread of its own
        verdict: list[str | None] = []         # (JAX's trace is the tracing thread's)
        thread = threading.Thread(target=lambda: verdict.append(_tree_tried(inner, leaves, treedef)))
        thread.start()
        thread.join()
        return verdict[0]
    return _tree_tried(inner, leaves, treedef)


def _tree_tried(inner: Any, leaves: list[Any], treedef: Any) -> str | None:
    """:func:`tree_problem`'s trial."""
    import jax.numpy as jnp

    rng = np.random.default_rng(4321)
    small = [jnp.asarray(rng.random((2,) * np.ndim(x)) + 0.5, jnp.float32) for x in leaves]
    grads = [[jnp.asarray(rng.random(w.shape) - 0.5, jnp.float32) for w in small] for _ in range(2)]

    def run(wrap: Any) -> list[Any]:
        ws = list(small)
        state = inner.init(wrap(ws))
        for g in grads:
            out, state = inner.update(wrap(g), state, wrap(ws))
            ws = [w + u for w, u in zip(ws, jax.tree_util.tree_leaves(out))]
        return ws

    with summed_over_shards(lambda sq: sq):         # one piece: commlib's global sums are its own
        try:
            as_tree = run(lambda ls: jax.tree_util.tree_unflatten(treedef, ls))
        except Exception:   # noqa: BLE001 - not runnable on the tree: its own error comes later
            return None
        try:
            as_list = run(list)
        except Exception as e:  # noqa: BLE001
            return (f"it takes the tree's structure (a mask or labels given as a tree?), which the shards, "
                    f"flat arrays in a list, do not have ({type(e).__name__}: {e})")
    if any(not np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(as_tree, as_list)):
        return ("it decides by the tree (a mask or labels computed from the leaves' paths or keys?): on "
                "the shards, flat arrays in a list, every leaf would be treated alike")
    return None
