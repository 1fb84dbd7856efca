"""Threshold scaling: one global threshold that keeps the selected count at the target k.

:class:`CountCurveThreshold` (ours, the default of :class:`~sparsify.ExDyna`)
selects exactly k elements per step with one global threshold, taken from
that step's own global count curve, with no communication beyond the
counts exchange the step makes anyway:

* A window of thresholds ``[floor, top]`` (``width`` octaves either side of
  a predicted threshold) is laid on a log grid of ``resolution`` points per
  octave.  Each rank scans its partition for candidates ``|acc| >= floor``
  and bins their magnitudes on the grid.
* The histogram *is* the rank's counts record: it travels in the counts
  all-gather (``2 max_width resolution + 1`` int64), so every rank holds
  every rank's histogram.  Every rank finds the same boundary bin (the one
  where the global count from the top reaches k), takes everything above it,
  and splits the rest of the quota over the ranks' elements in that bin in
  proportion to their counts there (integer largest remainder: every rank
  computes the same split, hence every rank's count, which the index
  all-gather needs).  Each rank takes its share's largest elements of the
  boundary bin.  The union is exactly k whenever the window holds the
  solution; the threshold is the same on every rank up to the width of that
  one bin (1/32 octave), inside which the ranks' quotas differ.
* The next window is centred on the boundary of the step one rotation before
  it (the partitions rotate: every ``size`` steps each rank selects from the
  same partition, so where the ranks' gradients differ in scale, non-IID
  data, the count curve comes back with the rotation), moved by how much the
  boundary moved over the last rotation; before a rotation was seen, and at
  one rank, on this step's boundary.  When the solution
  lies outside the window (a sudden change of scale) the step takes what the
  window allows, and the window re-centres (extrapolating with the curve's
  measured slope, at most ``max_step`` per step) and widens up to ``max_width``.
* The first prediction comes from a sample of each rank's partition: its
  magnitudes at a ladder of tail fractions around the target density travel
  in one tiny all-gather at the first step only, and the ranks solve the
  same estimated global tail for k.
* Every input is an integer known to every rank and the arithmetic is
  deterministic (integers, and thresholds rounded to 1/4096 octave): the
  threshold is identical on all ranks without any communication of its own.

:class:`ReferenceThreshold` is the rule of the authors' prototype (start at
``1/(2 sqrt(k))``, multiply by 1.005 above 1.1 k, by 1.00125 inside the
band, by 0.995 below); it needs hundreds of steps to reach the band and then
settles under the target.  :class:`FixedThreshold` never moves (the hard
threshold baseline).  Both select ``>= threshold`` directly and report a count.

Example:
    >>> import numpy as np
    >>> c = CountCurveThreshold()
    >>> c.threshold = 4.0                                  # the predicted threshold
    >>> floor, _ = c.window()
    >>> mags = np.abs(np.random.default_rng(0).laplace(size=100_000)).astype(np.float32)
    >>> bins = c.bins(np, mags[mags >= floor], floor)
    >>> table = c.histogram(np, bins)[None, :]             # one rank's record (all-gathered)
    >>> j, take = c.choose(1000, table)
    >>> int((bins > j).sum()) + take[0]                      # exactly k
    1000
    >>> [round(c.grid_threshold(i), 2) for i in (j, j + 1)]  # the boundary bin; Laplace: ln(100) = 4.61
    [4.56, 4.65]
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from commlib.collectives.checks import check_real

from .kernels import bin_counts, log2_bins

_QUANT = 4096.0           # thresholds live on a grid of 1/4096 octave
_TINY = float(np.finfo(np.float32).tiny)


def quantize(t: float) -> float:
    """``t`` rounded to 1/4096 of an octave (deterministic across ranks and math libraries)."""
    if not t > 0 or not math.isfinite(t):
        return _TINY
    q = 2.0 ** (round(math.log2(t) * _QUANT) / _QUANT)
    return max(q, _TINY)


class ThresholdPolicy:
    """What a threshold-selecting selector asks of its threshold rule.

    Plain rules (:attr:`record_len` 0) give a threshold and learn the global
    count afterwards; histogram rules bin the candidates (:meth:`bins`,
    :meth:`histogram`), and :meth:`choose` splits the quota using every
    rank's histogram before the indices travel.
    """

    name = "policy"
    #: histogram bins a rank adds to its counts record (0: a plain threshold rule)
    record_len = 0

    def __init__(self) -> None:
        self.threshold: float | None = None

    @property
    def needs_init(self) -> bool:
        """True until a first threshold is known (then the selector runs the sampling exchange)."""
        return self.threshold is None

    def start(self, k: int, period: int = 1) -> None:
        """Called at setup with the target count (rules that start from k alone) and the period
        of the selection's layout (the rotating partitions': every ``period`` steps each rank
        selects from the same partition again)."""

    def window(self) -> tuple[float, float]:
        """``(floor, threshold)``: candidates are ``>= floor``; plain rules select ``>= threshold``."""
        assert self.threshold is not None
        return self.threshold, self.threshold

    def grid(self) -> tuple[float, int] | None:
        """Histogram rules: ``(resolution, points)`` of the log2 grid above the floor that
        :meth:`bins` uses (``sparsify.kernels.log2_bins``); ``None`` for plain rules."""
        return None

    def store_from(self) -> int:
        """Histogram rules: the lowest grid bin whose candidates a GPU scan keeps (the histogram
        counts every bin; a boundary below this bin costs a second scan): 0, all of them."""
        return 0

    def bins(self, xp: Any, mags: Any, floor: float) -> Any:
        """Grid bin of each candidate magnitude (histogram rules)."""
        raise NotImplementedError

    def histogram(self, xp: Any, bins: Any) -> Any:
        """Counts per bin, length :attr:`record_len`."""
        raise NotImplementedError

    def choose(self, k: float, table: np.ndarray) -> tuple[int, list[int]]:
        """Histogram rules: the boundary bin and each rank's take from it, given every rank's
        histogram (see :meth:`CountCurveThreshold.choose`)."""
        raise NotImplementedError

    def grid_threshold(self, j: int) -> float:
        """The threshold of grid point ``j`` of the current window."""
        raise NotImplementedError

    def update(self, k: float, count: int, hist: np.ndarray | None = None, chosen: int | None = None) -> None:
        """Prepare the next step from the global ``count`` (histogram rules: the summed histogram
        and the chosen grid point)."""

    def rescale(self, factor: float) -> None:
        """The magnitudes come ``factor`` times larger from now on: the threshold follows."""
        if self.threshold is not None:
            self.threshold = float(self.threshold) * factor

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "threshold": self.threshold}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise unless :meth:`load_state_dict` takes ``state`` (changing nothing)."""
        if state.get("name") != self.name:
            raise ValueError(f"threshold state of {state.get('name')!r} given to {self.name!r}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.threshold = None if state["threshold"] is None else float(state["threshold"])

    def describe(self) -> str:
        return self.name

    def __repr__(self) -> str:               # deterministic: strategies compare reprs across ranks
        return self.describe()


class FixedThreshold(ThresholdPolicy):
    """A threshold that never moves (``value``; ``None``: the first step's estimate, then frozen)."""

    name = "fixed"

    def __init__(self, value: float | None = None):
        super().__init__()
        if value is not None:
            value = check_real("FixedThreshold", "value", value, "a finite number > 0",
                               lambda v: 0 < v < math.inf)
        self.threshold = value
        self._value = value

    def describe(self) -> str:
        return f"fixed({self._value:g})" if self._value is not None else "fixed(first estimate)"


class ReferenceThreshold(ThresholdPolicy):
    """The ExDyna / MiCRO prototype's rule: ``1/(2 sqrt(k))``, then x1.005 / x1.00125 / x0.995 by band."""

    name = "reference"

    def start(self, k: int, period: int = 1) -> None:
        if self.threshold is None:
            self.threshold = 1.0 / (2.0 * math.sqrt(max(k, 1)))

    @property
    def needs_init(self) -> bool:
        return False

    def update(self, k: float, count: int, hist: np.ndarray | None = None, chosen: int | None = None) -> None:
        ratio = count / k
        if ratio > 1.1:
            factor = 1.005
        elif ratio > 0.909:
            factor = 1.00125
        else:
            factor = 0.995
        self.threshold = float(self.threshold) * factor


class CountCurveThreshold(ThresholdPolicy):
    """Ours: each step's threshold from that step's global count curve (see the module docs).

    ``resolution``: grid points per octave (32: adjacent thresholds 2.2 %
    apart; only the boundary bin is split); ``width``: the window's
    half-width in octaves (0.5); ``max_width``: how far the window widens
    after the solution fell outside it (2); ``max_step``: the largest factor
    per step when re-centring outside the window (4).  :attr:`threshold` is the prediction the next window is
    centred on.

    Tuning: a wider window reads more candidates (a larger share of the
    partition passes ``floor``) but falls out of it less often after sudden
    changes of the gradient scale; the record is ``2 max_width resolution + 1``
    int64 per rank.
    """

    name = "count-curve"

    def __init__(self, resolution: int = 32, width: float = 0.5, max_width: float = 2.0,
                 max_step: float = 4.0):
        super().__init__()
        if int(resolution) < 1:
            raise ValueError(f"resolution {resolution!r}: expected >= 1 grid point per octave")
        if not 0 < width <= max_width:
            raise ValueError(f"width {width!r}, max_width {max_width!r}: expected 0 < width <= max_width")
        if not max_step > 1:
            raise ValueError(f"max_step {max_step!r}: expected > 1")
        self.resolution = int(resolution)
        self.base_half = max(1, int(round(width * self.resolution)))      # half-width in grid steps
        self.max_half = max(self.base_half, int(round(max_width * self.resolution)))
        self.max_step = float(max_step)
        self.half = self.base_half
        self.record_len = 2 * self.max_half + 1
        self._config = (resolution, width, max_width, max_step)
        self.period = 1
        #: the last ``period + 1`` steps' boundaries (natural log of the threshold), oldest first
        self._recent: list[float] = []
        self._spread = 0.0      # the boundary's distance from the prediction, in bins (running mean)

    def start(self, k: int, period: int = 1) -> None:
        self.period = max(1, int(period))
        self._recent, self._spread = [], 0.0

    def describe(self) -> str:
        r, w, mw, ms = self._config
        return f"count-curve(resolution={r}, width={w:g}, max_width={mw:g}, max_step={ms:g})"

    # ------------------------------------------------------------------ per step
    @property
    def points(self) -> int:
        """Grid points in the current window (the last one collects everything above it)."""
        return 2 * self.half + 1

    def window(self) -> tuple[float, float]:
        assert self.threshold is not None
        t = self.threshold
        return t * 2.0 ** (-self.half / self.resolution), t

    def grid_threshold(self, j: int) -> float:
        return self.threshold * 2.0 ** ((j - self.half) / self.resolution)

    def grid(self) -> tuple[float, int]:
        return float(self.resolution), self.points

    def store_from(self) -> int:
        """1/16 octave (at least one bin) under the predicted threshold (bin ``half``): in steady
        state the boundary moves less than that in a step, and the bins under it hold most of
        the window's candidates (error feedback piles the residual up under the threshold)."""
        return max(0, self.half - max(1, self.resolution // 16))

    def bins(self, xp: Any, mags: Any, floor: float) -> Any:
        return log2_bins(xp, mags, floor, self.resolution, self.points)

    def histogram(self, xp: Any, bins: Any) -> Any:
        return bin_counts(xp, bins, self.record_len)

    def choose(self, k: float, table: np.ndarray) -> tuple[int, list[int]]:
        """Split exactly ``k`` selections (or all candidates, if fewer) over the ranks.

        ``table``: every rank's histogram (shape ``(n, record_len)``).  Returns
        the boundary bin ``j`` and per rank how many of its elements in bin
        ``j`` it takes (its largest ones); everything above bin ``j`` is taken.
        The quota of bin ``j`` is split in proportion to the ranks' counts
        there, by largest remainder in integers: every rank computes the same.
        """
        h = np.asarray(table, dtype=np.int64)[:, :self.points]
        per_bin = (h.sum(axis=0) if h.shape[0] > 1 else h[0]).tolist()   # Python ints: no overflow
        k = int(k)
        if sum(per_bin) <= k:                                # fewer candidates than k: take all
            return 0, h[:, 0].tolist()
        above = 0                                            # the global count above bin j
        for j in range(self.points - 1, -1, -1):             # (a few dozen bins: no numpy calls)
            if above + per_bin[j] >= k:
                break
            above += per_bin[j]
        need = k - above
        col, total = h[:, j].tolist(), per_bin[j]
        share = [c * need // total for c in col]
        rem = [c * need % total for c in col]
        left = need - sum(share)
        for r in sorted(range(len(col)), key=lambda r: (-rem[r], r))[:left]:
            share[r] += 1
        return j, share

    def update(self, k: float, count: int, hist: np.ndarray | None = None, chosen: int | None = None) -> None:
        """Centre the next window on this step's boundary; re-centre and widen when the
        solution lay outside the window (``hist``: the global histogram)."""
        cum = np.cumsum(np.asarray(hist[:self.points], dtype=np.float64)[::-1])[::-1]
        j = int(chosen)
        log_t = math.log(self.grid_threshold(j))
        step = math.log(2.0) / self.resolution
        if cum[0] < k:                                   # below the window: re-centre lower
            if cum[0] <= 0:
                nxt = log_t - math.log(self.max_step)
            else:
                nxt = log_t - math.log(k / cum[0]) / self._slope(cum, 0, step)
                nxt = max(nxt, log_t - math.log(self.max_step))
            self.half = min(self.max_half, 2 * self.half)
        elif j == self.points - 1:                       # above the window: re-centre higher
            start = max(0, j - self.resolution)
            nxt = log_t + math.log(max(cum[-1], k) / k) / self._slope(cum, start, step)
            nxt = min(max(nxt, log_t + step), log_t + math.log(self.max_step))
            self.half = min(self.max_half, 2 * self.half)
        else:
            nxt = log_t
            self.half = max(self.base_half, (self.half * 3) // 4)
        # how far the boundary fell from the prediction, in bins (a running mean): the window is kept
        # three times as wide, so that a noisy curve (a small vector's) stays inside it
        missed = abs(nxt - math.log(self.threshold)) / step
        self._spread = 0.9 * self._spread + 0.1 * missed
        self.half = max(self.half, min(self.max_half, math.ceil(3 * self._spread)))
        recent = self._recent = [*self._recent, nxt][-(self.period + 1):]
        if self.period > 1 and len(recent) == self.period + 1:
            # the next step's layout was this one's a rotation ago (recent[1]); the drift of this
            # step's layout over the rotation (recent[-1] - recent[0]) moves it on
            nxt = recent[1] + (recent[-1] - recent[0])
        self.threshold = quantize(math.exp(nxt))

    def rescale(self, factor: float) -> None:
        super().rescale(factor)
        if factor > 0:
            self._recent = [v + math.log(factor) for v in self._recent]

    @staticmethod
    def _slope(cum: np.ndarray, start: int, step: float) -> float:
        """-d log C / d log t from ``start`` up to where the count halves (clipped to [0.5, 30])."""
        c0 = cum[start]
        end = start + 1
        while end < cum.size - 1 and cum[end] > c0 / 2:
            end += 1
        c1 = cum[end] if end < cum.size else 0
        if c1 <= 0 or c1 >= c0:
            return 4.0
        s = (math.log(c0) - math.log(c1)) / ((end - start) * step)
        return min(max(s, 0.5), 30.0)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "half": self.half, "config": list(self._config),
                "period": self.period, "recent": list(self._recent), "spread": self._spread}

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        if tuple(state["config"]) != tuple(self._config):
            raise ValueError(f"count-curve state of {state['config']} given to a controller of "
                             f"{list(self._config)}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.half = int(state["half"])
        same = int(state.get("period", 0)) == self.period       # another world: another rotation
        self._recent = [float(v) for v in state.get("recent", [])] if same else []
        self._spread = float(state.get("spread", 0.0))


def make_policy(spec: str | ThresholdPolicy | float | None) -> ThresholdPolicy:
    """``"auto"``/``"count-curve"``: ours; ``"reference"``: the prototype's rule; a float: fixed."""
    if isinstance(spec, ThresholdPolicy):
        return spec
    if spec in (None, "auto", "count-curve"):
        return CountCurveThreshold()
    if spec == "reference":
        return ReferenceThreshold()
    if isinstance(spec, numbers.Real) and not isinstance(spec, (bool, np.bool_)):
        return FixedThreshold(float(spec))
    raise ValueError(f"threshold {spec!r}: expected 'auto', 'reference', a number or a ThresholdPolicy")


# ---------------------------------------------------------------------- first estimate
#: tail fractions, relative to the target density, at which each rank reports its sample
INIT_FRACTIONS = tuple(2.0 ** (i / 2) for i in range(-6, 7))
#: sample at most this many elements of a partition for the first estimate
INIT_MAX_SAMPLE = 1 << 20


def sample_tail(xp: Any, seg: Any, density: float) -> np.ndarray:
    """This rank's sample of ``|seg|`` at the tail fractions ``density * INIT_FRACTIONS``.

    Returns float64 ``[elements covered, v_0, v_1, ...]`` (NaN where the
    sample has no positive value there).  A strided sample of at least
    65536 elements (and ``100 / density``, at most 2**20).
    """
    out = np.full(1 + len(INIT_FRACTIONS), np.nan)
    m = int(seg.size)
    out[0] = m
    if m == 0:
        return out
    want = min(INIT_MAX_SAMPLE, max(1 << 16, int(math.ceil(100.0 / density))))
    stride = max(1, m // want)
    s = xp.sort(xp.abs(seg[::stride]))
    ns = int(s.size)
    pos = [ns - min(ns, max(1, int(math.ceil(f * density * ns)))) for f in INIT_FRACTIONS]
    vals = s[xp.asarray(pos)]
    vals = vals.get() if xp is not np else vals
    v = np.asarray(vals, dtype=np.float64)
    v[~(v > 0) | ~np.isfinite(v)] = np.nan
    out[1:] = v
    return out


def solve_initial(table: np.ndarray, density: float, target: float) -> float:
    """The threshold at which the ranks' sampled tails together select ``target`` elements.

    ``table``: one :func:`sample_tail` row per rank.  Each rank's tail
    fraction ``F_r(t)`` is interpolated log-log between its sample points
    (beyond the largest sampled value it falls as ``t**-8``; under the
    smallest it stays at the largest fraction), and ``sum_r size_r F_r(t) =
    target`` is solved by bisection.  Deterministic: every rank gets the same.
    """
    fr = np.log(np.asarray(INIT_FRACTIONS) * density)
    rows = []
    for row in np.asarray(table, dtype=np.float64):
        ok = np.isfinite(row[1:])
        if row[0] > 0 and ok.any():
            lv = np.log(row[1:][ok])
            lf = fr[ok]
            order = np.argsort(lv, kind="stable")
            rows.append((row[0], lv[order], lf[order]))
    if not rows:
        return _TINY

    def count(lt: float) -> float:
        total = 0.0
        for size, lv, lf in rows:
            if lt >= lv[-1]:
                f = lf[-1] - 8.0 * (lt - lv[-1])
            else:
                f = float(np.interp(lt, lv, lf))
            total += size * math.exp(min(f, 0.0))
        return total

    lo = min(r[1][0] for r in rows) - 1.0
    hi = max(r[1][-1] for r in rows) + 4.0
    if count(lo) < target:
        return quantize(math.exp(lo))
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        if count(mid) >= target:
            lo = mid
        else:
            hi = mid
    return quantize(math.exp(0.5 * (lo + hi)))
