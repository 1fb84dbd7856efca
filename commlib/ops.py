"""An operation record and what ranks compare about it (``COMMLIB_CHECK``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import COMPLEX_DTYPES, DTYPES, INEXACT_DTYPES, View, as_view, host_pair, mark_written
from .backends.base import REDUCE_OPS, Pending
from .errors import MismatchError, ValidationError

#: Operation names, in the order of their codes on the status board and in checks.
OPS = ("allreduce", "reduce_scatter", "allgather", "allgatherv", "broadcast", "barrier")


@dataclass(slots=True)
class Op:
    """One operation, validated and ready to start: ``start(*args)`` posts it.

    Its result is ``result()`` when ``result`` is set (an allocated output to
    wrap as the caller's kind of array), else ``value`` (the caller's ``out``).
    """

    name: str
    start: Callable[..., Pending]
    args: tuple
    result: Callable[[], Any] | None
    value: Any = None
    nbytes: int = 0
    tag: str | None = None
    check_args: tuple = ()   # arguments of fingerprint() (used only in check mode)
    seq: int = 0
    submitted_us: float = 0.0  # on the timeline's clock (only with a timeline)
    token: Any = None        # the tracer's open "running" phase

    def __str__(self) -> str:
        return f"{self.name} #{self.seq}" + (f" [{self.tag}]" if self.tag else "")


def fingerprint(name: str, v: View | None = None, count: int = -1, root: int = -1,
                 op: str | None = None) -> list[int]:
    """What all ranks must agree on: [valid, op, dtype, count, root, reduce op]."""
    return [1, OPS.index(name), DTYPES.index(v.dtype) if v is not None else -1, count, root,
            REDUCE_OPS.index(op) if op is not None else -1]


def describe(fp: Sequence[int]) -> str:
    _, code, dt, count, root, red = (int(v) for v in fp)
    parts = [OPS[code]]
    if dt >= 0:
        parts.append(DTYPES[dt])
    if count >= 0:
        parts.append(f"count={count}")
    if root >= 0:
        parts.append(f"root={root}")
    if red >= 0:
        parts.append(f"op={REDUCE_OPS[red]}")
    return "(" + ", ".join(parts) + ")"




def out_buffer(v: View, out: Any, count: int, what: str) -> tuple[Any, Any]:
    """The receive storage for an ``out`` argument and the caller's result (``None``: allocated).

    Example:
        >>> recv, result = out_buffer(as_view(x, "x"), None, x.size, "allreduce")  # a new array
    """
    if out is None:
        return v.empty(count), None
    data = v.data
    if out is v.original and v.count == count and v.writable:
        if v.kind == "torch":
            mark_written(out)
        return data, out   # in place: the backend sees send is recv
    if host_pair(data, out) is not None and out.size == count:   # plain numpy: a few attribute reads
        return (out if out.ndim == 1 else out.reshape(-1)), out
    o = as_view(out, f"{what}: out")
    if o.dtype != v.dtype:
        raise ValidationError(f"{what}: out has dtype {o.dtype}, input has {v.dtype}")
    if o.device != v.device:
        raise ValidationError(f"{what}: out is on {o.device}, input on {v.device}")
    if o.count != count:
        raise ValidationError(f"{what}: out has {o.count} elements, expected {count}")
    if not o.writable:
        raise ValidationError(f"{what}: out is read-only" + (" (jax arrays are immutable)" if o.kind == "jax"
                                                              else ""))
    mark_written(out)
    return o.data, out


def reduce_op_ok(op: str, dtype: str) -> bool:
    """Whether ``op`` is a reduce op valid for ``dtype`` (``avg`` needs a floating or complex
    dtype; ``max`` and ``min`` an ordered one, not complex).

    Example:
        >>> reduce_op_ok("avg", "int32"), reduce_op_ok("max", "complex64")
        (False, False)
    """
    if dtype in COMPLEX_DTYPES:
        return op in ("sum", "avg")
    return op in REDUCE_OPS and (op != "avg" or dtype in INEXACT_DTYPES)


def check_reduce_op(op: str, dtype: str, what: str) -> None:
    """Reject an unknown reduce op, ``avg`` on integers and ``max``/``min`` on complex numbers
    (what :func:`reduce_op_ok` refuses) with :class:`ValidationError`.

    Example:
        >>> check_reduce_op("max", "complex64", "allreduce")     # raises: complex numbers have no order
    """
    if reduce_op_ok(op, dtype):
        return
    if op not in REDUCE_OPS:
        raise ValidationError(f"{what}: op {op!r} is not one of {REDUCE_OPS}")
    if dtype in COMPLEX_DTYPES:
        raise ValidationError(f"{what}: op {op!r} needs ordered values, got {dtype} (complex numbers are "
                              "summed or averaged: op 'sum' or 'avg')")
    raise ValidationError(f"{what}: op 'avg' needs a floating (or complex) dtype, got {dtype}")


def check_agreement(table: np.ndarray, name: str, seq: int) -> None:
    """Raise :class:`MismatchError` unless every row of the fingerprint table matches rank 0's."""
    ref = table[0]      # allgatherv's count is the total (every rank's counts are compared before)
    bad = [r for r in range(table.shape[0]) if not np.array_equal(table[r], ref)]
    if bad:
        calls = "; ".join(f"rank {r} called {describe(table[r])}" for r in bad)
        raise MismatchError(
            f"{name} #{seq}: ranks {bad} called a different operation than rank 0, "
            f"which called {describe(ref)}: {calls}", name, seq, bad)


_AGREE_TEXT = 48      # int64 words (384 bytes) for a summary and for a reason


def _words(text: str) -> np.ndarray:
    raw = text.encode()[:8 * _AGREE_TEXT]
    return np.frombuffer(raw.ljust(8 * _AGREE_TEXT, b"\0"), np.int64)


def _text(words: np.ndarray) -> str:
    return words.tobytes().rstrip(b"\0").decode(errors="replace")


def digest(text: str) -> str:
    """A short fingerprint of ``text``, alike in every process (messages compare the ranks' by it).

    Example:
        >>> digest("AllReduce(cap_mb=25.0)")
        '95c83949'
    """
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:8]


def agree(comm: Any, what: str, desc: str, *, noun: str = "input", summary: str = "",
          problem: str | None = None, differs: str | None = None) -> None:
    """Check, with one small all-gather, that every rank has the same ``desc`` and no ``problem``.

    Every rank raises the same error: :class:`ValidationError` listing each
    rank's ``problem`` ("rank r rejected its <noun>: ..."), else
    :class:`MismatchError` when ``desc`` differs ("the <noun> differs across
    ranks (rank 0: <summary>, rank r: <summary>)"; ``differs``, default ``noun``,
    names what differs where ``desc`` holds more than the noun).  For checks a binding
    makes before its first collective on new input (parameters, pytrees).

    Example:
        >>> agree(comm, "DistributedOptimizer", "(3, 4)/float32;(4,)/float32", noun="parameters",
        ...       summary="2 tensors, 16 elements")
    """
    import hashlib

    row = np.zeros(3 + 2 * _AGREE_TEXT, np.int64)
    row[0] = problem is None
    row[1:3] = np.frombuffer(hashlib.sha256(desc.encode()).digest()[:16], np.int64)
    row[3:3 + _AGREE_TEXT] = _words(summary)
    row[3 + _AGREE_TEXT:] = _words(problem or "")
    table = np.asarray(comm.allgather(row, tag=f"{what}-agree")).reshape(comm.size, -1)
    invalid = [r for r in range(comm.size) if table[r, 0] == 0]
    if invalid:
        raise ValidationError(f"{what}: " + "; ".join(
            f"rank {r} rejected its {noun}: {_text(table[r, 3 + _AGREE_TEXT:])}" for r in invalid))
    differ = [r for r in range(comm.size) if tuple(table[r, 1:3]) != tuple(table[0, 1:3])]
    if differ:
        ranks = ", ".join(f"rank {r}: {_text(table[r, 3:3 + _AGREE_TEXT])}" for r in [0, *differ])
        # on the way to the error every rank knows it: the descriptions themselves name the difference
        descs = comm.allgather_object(desc, label=f"{what}-agree: the differing ranks' {noun}")
        first = "; ".join(first_difference(descs[0], descs[r], r) for r in differ)
        raise MismatchError(f"{what}: the {differs or noun} differs across ranks ({ranks}); {first}; "
                            f"rank {comm.rank} has {desc[:300]}{' ...' if len(desc) > 300 else ''}",
                            "allgather", comm.seq, differ)


def first_difference(ref: str, other: str, rank: int) -> str:
    """Where rank ``rank``'s description first differs from rank 0's, field by field (fields part at
    ``|``, ``;`` and ``,``): the two fields.

    Example:
        >>> first_difference("a|cap_mb=2.0, x=1", "a|cap_mb=1.0, x=1", 1)
        "rank 0 has 'cap_mb=2.0' where rank 1 has 'cap_mb=1.0'"
    """
    import re

    mine, theirs = re.split(r"[|;,]", ref), re.split(r"[|;,]", other)
    for a, b in zip(mine, theirs):
        if a != b:
            return f"rank 0 has {a.strip()[:120]!r} where rank {rank} has {b.strip()[:120]!r}"
    longer, count = (0, len(mine)) if len(mine) > len(theirs) else (rank, len(theirs))
    return (f"rank 0 has {len(mine)} fields, rank {rank} {len(theirs)}: rank {longer}'s last is "
            f"{(mine if longer == 0 else theirs)[count - 1].strip()[:120]!r}")
