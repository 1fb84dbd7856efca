"""Settings: every ``COMMLIB_*`` environment variable, mirrored by a keyword.

The one table of them is in README.md ("Settings"); in short:
``COMMLIB_BACKEND`` (``backend``: auto, mpi, nccl), ``COMMLIB_TIMEOUT``
(``timeout``, seconds, 0 = forever, default 1800 as torch.distributed's),
``COMMLIB_STALL_WARNING`` (``stall_warning``: seconds a wait may take before a
:class:`CommStallWarning` naming the missing ranks, default 60, 0 = none), ``COMMLIB_CHECK`` (``check``:
all ranks compare each call before entering it), ``COMMLIB_TIMELINE``
(``timeline``: Chrome-trace path per rank), ``COMMLIB_NVTX`` (``nvtx``) and
``COMMLIB_MPI_CUDA_AWARE`` (``cuda_aware``: auto, 0, 1), ``COMMLIB_POLL_SPIN``
(``poll_spin``: seconds ``Work.wait()`` yields the core before it sleeps on
the operation's completion, and an NCCL wait polls its event before it backs
off; default 0.001, ``inf`` never sleeps), ``COMMLIB_DEVICE`` (``device``: the
GPU of this rank's NCCL communicator; default: the current CUDA device if the
user chose one, else the node-local rank).  A keyword given to
:func:`commlib.init` wins over the variable, and is read as the variable is.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, fields
from typing import Any

from .errors import ValidationError

_BACKENDS = ("auto", "mpi", "nccl")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(raw: Any, what: str) -> bool:
    """A switch: a bool, 0 or 1, or its spelling in a string (1/true/yes/on, 0/false/no/off)."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, numbers.Integral) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str) and raw.lower() in _TRUE + _FALSE:
        return raw.lower() in _TRUE
    raise ValidationError(f"{what}={raw!r}: expected 0 or 1")


def _seconds(raw: Any, what: str) -> float:
    """Seconds: a number or its spelling in a string (``inf`` too); not a bool."""
    if isinstance(raw, numbers.Real) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw)
        except ValueError:
            pass
    raise ValidationError(f"{what}={raw!r}: expected seconds")


def _backend(raw: Any, what: str) -> str:
    if isinstance(raw, str) and raw.lower() in _BACKENDS:
        return raw.lower()
    raise ValidationError(f"{what}={raw!r}: expected one of {_BACKENDS}")


def _cuda_aware(raw: Any, what: str) -> bool | None:
    """``auto`` (``None``: ask MPI), or a switch."""
    if isinstance(raw, str) and raw.lower() == "auto":
        return None
    try:
        return _flag(raw, what)
    except ValidationError:
        raise ValidationError(f"{what}={raw!r}: expected auto, 0 or 1") from None


def _device(raw: Any, what: str) -> int:
    if isinstance(raw, numbers.Integral) and not isinstance(raw, bool) and raw >= 0:
        return int(raw)
    if isinstance(raw, str) and raw.isdigit():
        return int(raw)
    raise ValidationError(f"{what}={raw!r}: expected a GPU index (0, 1, ...)")


def _nvtx(raw: Any, what: str) -> bool | str:
    """A switch, or ``force`` (ranges emitted with no NVTX tool attached)."""
    if isinstance(raw, str) and raw.lower() == "force":
        return "force"
    try:
        return _flag(raw, what)
    except ValidationError:
        raise ValidationError(f"{what}={raw!r}: expected 0, 1 or force") from None


def _path(raw: Any, what: str) -> str | None:
    if isinstance(raw, (str, os.PathLike)):
        return os.fspath(raw) or None
    raise ValidationError(f"{what}={raw!r}: expected a file path")


#: each setting: its variable and its parser (a keyword given to init() is parsed as its variable is)
_SETTINGS = {
    "backend": ("COMMLIB_BACKEND", _backend),
    "timeout": ("COMMLIB_TIMEOUT", _seconds),
    "stall_warning": ("COMMLIB_STALL_WARNING", _seconds),
    "check": ("COMMLIB_CHECK", _flag),
    "timeline": ("COMMLIB_TIMELINE", _path),
    "nvtx": ("COMMLIB_NVTX", _nvtx),
    "cuda_aware": ("COMMLIB_MPI_CUDA_AWARE", _cuda_aware),
    "poll_spin": ("COMMLIB_POLL_SPIN", _seconds),
    "device": ("COMMLIB_DEVICE", _device),
}


@dataclass(frozen=True)
class Config:
    """Resolved settings of one communicator.

    Example:
        >>> Config.from_env(timeout=5.0).timeout
        5.0
    """

    backend: str = "auto"
    timeout: float = 1800.0
    stall_warning: float = 60.0
    check: bool = False
    timeline: str | None = None
    nvtx: bool | str = True         # "force": emitted with no NVTX tool attached
    cuda_aware: bool | None = None  # None: ask MPI
    poll_spin: float = 1e-3
    device: int | None = None       # None: commlib.init chooses (commlib.device.choose_device)

    @classmethod
    def from_env(cls, **overrides: Any) -> "Config":
        """Read ``COMMLIB_*`` variables, then apply non-``None`` keyword overrides (each parsed as
        its variable is: ``timeout="5"``, ``check=0``, ``cuda_aware="auto"``, ``backend="MPI"``)."""
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown commlib setting(s): {sorted(unknown)}")
        values, given = {}, {}
        for name, (var, parse) in _SETTINGS.items():
            raw, what = overrides.get(name), name
            if raw is None:
                raw, what = os.environ.get(var), var
                if raw is None or raw == "":
                    continue
            values[name], given[name] = parse(raw, what), what
        cfg = cls(**values)
        cfg.validate(given)
        return cfg

    def validate(self, given: dict[str, str] | None = None) -> None:
        """Raise :class:`ValidationError` on a setting out of range, named as ``given`` names it
        (its keyword, or the variable it came from: ``{"timeout": "COMMLIB_TIMEOUT"}``)."""
        def bad(name: str, expected: str) -> ValidationError:
            where = (given or {}).get(name, name)
            return ValidationError(f"{where}={getattr(self, name)!r}: expected {expected}")

        if self.backend not in _BACKENDS:
            raise bad("backend", f"one of {_BACKENDS}")
        for name in ("timeout", "stall_warning"):
            if not getattr(self, name) >= 0:
                raise bad(name, "seconds >= 0")
        if self.device is not None and (not isinstance(self.device, int) or self.device < 0):
            raise bad("device", "a GPU index >= 0")
        if not self.poll_spin >= 0:
            raise bad("poll_spin", "seconds >= 0 (inf: never sleep)")

    def timeline_path(self, rank: int) -> str | None:
        """The timeline file of ``rank``, or ``None`` when the timeline is off: ``{rank}`` in the
        path replaced, else ``.rank<N>`` inserted before the extension; in a folder (one that
        exists, or a path ending in ``/``), ``rank<N>.json``.

        Example:
            >>> Config.from_env(timeline="/tmp/tl/").timeline_path(1)
            '/tmp/tl/rank1.json'
        """
        if not self.timeline:
            return None
        path = self.timeline.replace("{rank}", str(rank))
        if path.endswith(os.sep) or os.path.isdir(path):        # a folder: rank<N>.json in it
            return os.path.join(path, f"rank{rank}.json")
        if path != self.timeline:
            return path
        root, ext = os.path.splitext(self.timeline)
        return f"{root}.rank{rank}{ext or '.json'}"
