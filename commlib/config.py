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
:func:`commlib.init` wins over the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import ValidationError

_BACKENDS = ("auto", "mpi", "nccl")


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValidationError(f"{name}={raw!r}: expected 0 or 1")


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValidationError(f"{name}={raw!r}: expected seconds") from None


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
    nvtx: bool = True
    cuda_aware: bool | None = None  # None: ask MPI
    poll_spin: float = 1e-3
    device: int | None = None       # None: commlib.init chooses (commlib.device.choose_device)

    @classmethod
    def from_env(cls, **overrides: Any) -> "Config":
        """Read ``COMMLIB_*`` variables, then apply non-``None`` keyword overrides."""
        aware_raw = os.environ.get("COMMLIB_MPI_CUDA_AWARE", "auto").lower()
        if aware_raw not in ("auto", "0", "1"):
            raise ValidationError(f"COMMLIB_MPI_CUDA_AWARE={aware_raw!r}: expected auto, 0 or 1")
        raw_device = os.environ.get("COMMLIB_DEVICE", "")
        if raw_device and not raw_device.isdigit():
            raise ValidationError(f"COMMLIB_DEVICE={raw_device!r}: expected a GPU index (0, 1, ...)")
        cfg = cls(
            device=int(raw_device) if raw_device else None,
            poll_spin=_env_seconds("COMMLIB_POLL_SPIN", cls.poll_spin),
            backend=os.environ.get("COMMLIB_BACKEND", cls.backend).lower(),
            timeout=_env_seconds("COMMLIB_TIMEOUT", cls.timeout),
            stall_warning=_env_seconds("COMMLIB_STALL_WARNING", cls.stall_warning),
            check=_env_bool("COMMLIB_CHECK", False),
            timeline=os.environ.get("COMMLIB_TIMELINE") or None,
            nvtx=os.environ.get("COMMLIB_NVTX") == "force" or _env_bool("COMMLIB_NVTX", True),
            cuda_aware=None if aware_raw == "auto" else aware_raw == "1",
        )
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown commlib setting(s): {sorted(unknown)}")
        cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise :class:`ValidationError` on a setting out of range."""
        if self.backend not in _BACKENDS:
            raise ValidationError(f"backend {self.backend!r}: expected one of {_BACKENDS}")
        if not self.timeout >= 0:
            raise ValidationError(f"timeout {self.timeout!r}: expected seconds >= 0")
        if not self.stall_warning >= 0:
            raise ValidationError(f"stall_warning {self.stall_warning!r}: expected seconds >= 0")
        if self.device is not None and (not isinstance(self.device, int) or self.device < 0):
            raise ValidationError(f"device {self.device!r}: expected a GPU index >= 0")
        if not self.poll_spin >= 0:
            raise ValidationError(f"poll_spin {self.poll_spin!r}: expected seconds >= 0 (inf: never sleep)")

    def timeline_path(self, rank: int) -> str | None:
        """The timeline file of ``rank``, or ``None`` when the timeline is off."""
        if not self.timeline:
            return None
        if "{rank}" in self.timeline:
            return self.timeline.replace("{rank}", str(rank))
        root, ext = os.path.splitext(self.timeline)
        return f"{root}.rank{rank}{ext or '.json'}"
