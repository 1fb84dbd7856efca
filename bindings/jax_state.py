""":func:`bindings.jax_sharded.sharded_optimizer`'s state made whole and cut again.

Each rank keeps the inner optimizer's state over its shard of each bucket: a per-rank state, which
per-rank checkpoints restore on as many ranks.  :func:`whole_state` gathers every rank's shards into
the state ``inner`` keeps over the whole parameter tree (what ``inner.init(params)`` makes, the same
on every rank: rank 0 may save it alone, one process may train on with ``inner``), and
:func:`shard_state` cuts such a state into this rank's shards on any number of ranks, as FSDP's full
optimizer state dict is saved and scattered.

The parts of the state that follow the parameters (optax builds them with ``tree_map`` over them:
Adam's moments, momentum, MultiSteps' accumulated gradients) are found by their shape: over shards,
a list with one 1-D array per bucket of the shard's length; over the whole tree, the parameters'
tree and shapes.  Everything else (step counts) is the same on every rank and carried as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import commlib
from commlib.arrays import numpy_dtype
from commlib.errors import ValidationError

from .jax_fusion import Plan


def _matcher(treedef: Any, shapes: list[tuple[int, ...]]) -> Callable[[Any], bool]:
    """Whether a node of a state is a part laid out as ``treedef`` with leaves of ``shapes``."""
    def is_part(node: Any) -> bool:
        if jax.tree_util.tree_structure(node) != treedef:
            return False
        return [tuple(np.shape(x)) for x in jax.tree_util.tree_leaves(node)] == shapes
    return is_part


def _split(state: Any, is_part: Callable[[Any], bool]) -> tuple[list[Any], Any, list[bool]]:
    """``state``'s leaves with its parts as single leaves, the tree around them, which are parts."""
    leaves, outer = jax.tree_util.tree_flatten(state, is_leaf=is_part)
    return leaves, outer, [is_part(x) for x in leaves]


def _shard_parts(plan: Plan) -> Callable[[Any], bool]:
    return _matcher(jax.tree_util.tree_structure([0] * len(plan.buckets)),
                    [(b.shard_numel,) for b in plan.buckets])


def _whole_parts(plan: Plan) -> Callable[[Any], bool]:
    return _matcher(plan.treedef, plan.shapes)


def _over_shards(plan: Plan, inner: Any) -> Any:
    """The shapes and dtypes of ``inner``'s state over this rank's shards of ``plan``'s buckets."""
    return jax.eval_shape(inner.init, [jax.ShapeDtypeStruct((b.shard_numel,), numpy_dtype(b.dtype))
                                       for b in plan.buckets])


def shards_problem(plan: Plan, inner: Any, state: Any) -> str | None:
    """Why ``state`` is not ``inner``'s state over this rank's shards of ``plan``'s buckets, or
    ``None`` (its tree and shapes against ``inner.init``'s over shards): checked on every rank before
    :func:`whole_state` gathers, which would otherwise pair different parts over the ranks."""
    target = _over_shards(plan, inner)
    want, got = jax.tree_util.tree_structure(target), jax.tree_util.tree_structure(state)
    if got != want:
        return f"the optimizer state's tree is {got}, expected {want} (its shards of these buckets)"
    for x, t in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(target)):
        if tuple(np.shape(x)) != tuple(t.shape):
            return (f"a leaf of the optimizer state has shape {tuple(np.shape(x))}, expected "
                    f"{tuple(t.shape)} (its shards of these buckets)")
    return None


def whole_state(comm: commlib.Communicator, plan: Plan, inner: Any, state: Any, params: Any) -> Any:
    """``inner``'s state over the whole of ``params`` from this rank's ``state`` over its shards of
    ``plan``'s buckets: every part gathered (one all-gather per bucket and part; a call every rank
    makes, after every rank's ``state`` passed :func:`shards_problem`), the rest as this rank has it.
    Jax arrays, on the parameters' device.

    Example:
        >>> whole = whole_state(comm, plan, optax.adam(1e-3), shard_state, params)
    """
    leaves, outer, parts = _split(state, _shard_parts(plan))
    out: list[Any] = []
    for leaf, part in zip(leaves, parts):
        if not part:
            out.append(leaf)
            continue
        buffers = [comm.allgather(np.ascontiguousarray(s), tag="sharded_optimizer.whole_state").reshape(-1)
                   for s in leaf]
        arrays = plan.unpack(buffers)
        out.append(jax.tree_util.tree_unflatten(plan.treedef, plan.to_jax(arrays)))
    whole = jax.tree_util.tree_unflatten(outer, out)
    template = jax.eval_shape(inner.init, params)
    if jax.tree_util.tree_structure(whole) != jax.tree_util.tree_structure(template):
        raise ValidationError("sharded_optimizer.whole_state: the optimizer state over shards does not map "
                              "onto the state over the parameters (a part that follows the parameters "
                              "in a layout of its own?)")
    return jax.tree_util.tree_map(lambda x, t: jax.numpy.asarray(x, t.dtype), whole, template)


def shard_state(plan: Plan, rank: int, inner: Any, whole: Any, params: Any) -> Any:
    """This rank's state over its shards of ``plan``'s buckets, cut from ``whole``, ``inner``'s state
    over the whole of ``params`` (from :func:`whole_state` on any number of ranks, or from ``inner``
    trained in one process).  No communication.  ``ValidationError`` where ``whole`` is not such a
    state (its tree and shapes are compared with ``inner.init(params)``'s).

    Example:
        >>> state = shard_state(plan, comm.rank, optax.adam(1e-3), whole, params)
    """
    template = jax.eval_shape(inner.init, params)
    want, got = jax.tree_util.tree_structure(template), jax.tree_util.tree_structure(whole)
    if got != want:
        raise ValidationError(f"sharded_optimizer.shard_state: the state is not {type(inner).__name__}"
                              f"'s over these parameters: its tree is {got}, expected {want}")
    for path, (x, t) in zip((jax.tree_util.keystr(p) for p, _ in
                             jax.tree_util.tree_flatten_with_path(template)[0]),
                            zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(template))):
        if tuple(np.shape(x)) != tuple(t.shape):
            raise ValidationError(f"sharded_optimizer.shard_state: leaf {path} of the state has shape "
                                  f"{tuple(np.shape(x))}, expected {tuple(t.shape)}")
    target = _over_shards(plan, inner)
    leaves, outer, parts = _split(whole, _whole_parts(plan))
    tleaves, touter, tparts = _split(target, _shard_parts(plan))
    if outer != touter or parts != tparts:
        raise ValidationError("sharded_optimizer.shard_state: the state over the parameters does not map "
                              "onto the state over shards (a part that follows the parameters in a "
                              "layout of its own?)")
    out: list[Any] = []
    for leaf, t, part in zip(leaves, tleaves, parts):
        if part:
            cut = plan.shards_of(jax.tree_util.tree_leaves(leaf), rank)
            out.append([jax.numpy.asarray(s, ts.dtype) for s, ts in zip(cut, t)])
        else:
            out.append(jax.numpy.asarray(leaf, t.dtype))
    return jax.tree_util.tree_unflatten(outer, out)
