"""Accuracy curves across seeds (against the training clock, steps or trained tokens): means,
95% CIs, peaks, speed-ups.

Two speed-up estimators, both to 99 % of the baseline's (GRPO's) peak:

- per seed (``speedup``): seed i's target is 99 % of the baseline's peak on seed i; the
  speed-up is the median over seeds of baseline time / method time. Robust to one
  strong or weak seed, and it needs paired seeds.
- the authors' (``mean_curve_speedup``): average each method's runs into one mean
  curve, take 99 % of the baseline mean curve's best as the target, and divide the
  times at which the two mean curves first reach it. The paper's single-GPU speed-ups
  (about 2.0x on GSM8K and MATH, 3.0x for Llama, over 10 runs) are this estimator.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

# The cumulative trained tokens at an evaluation, which experiments.compare adds from metrics.jsonl.
TRAINED_TOKENS = "train/tokens_total"
# What a curve can be drawn against: x -> the evaluation record's key, and the plot's axis label.
X_KEYS = {"time": "time/elapsed_train_s", "steps": "step", "tokens": TRAINED_TOKENS}
X_LABELS = {"time": "training clock (s, evaluation excluded)", "steps": "RL steps (generated batches)",
            "tokens": "trained tokens"}


@dataclasses.dataclass(frozen=True)
class Curve:
    """Step-function accuracy of one run: the last evaluation at or before each x (time, step, tokens)."""

    # [E] x of each evaluation, ascending: training-clock seconds unless built with another x
    times: np.ndarray
    accuracy: np.ndarray  # [E]

    @classmethod
    def from_history(cls, history: Sequence[Mapping[str, float]], x: str = "time") -> Curve:
        """The run's accuracy against ``x`` ("time", "steps" or "tokens", see ``X_KEYS``)."""
        if x not in X_KEYS:
            raise ValueError(f"x must be one of {', '.join(X_KEYS)}; got {x!r}")
        if not history:
            raise ValueError("a run has no evaluations")
        if not records(history, x):
            raise ValueError(f"a run's evaluations lack {X_KEYS[x]!r}, which x={x!r} reads")
        # Sorted by x alone: evaluations at the same x keep their logged order, the last one counting.
        points = sorted(((float(h[X_KEYS[x]]), float(h["eval/accuracy"])) for h in history), key=lambda p: p[0])
        times, accuracy = zip(*points)
        return cls(np.asarray(times), np.asarray(accuracy))

    def at(self, grid: np.ndarray) -> np.ndarray:
        """Accuracy on ``grid``; NaN before the first evaluation."""
        idx = np.searchsorted(self.times, grid, side="right") - 1
        return np.where(idx >= 0, self.accuracy[np.clip(idx, 0, None)], np.nan)

    def first_time_reaching(self, threshold: float) -> float:
        """Training seconds of the first evaluation at or above ``threshold``; inf if never."""
        hits = np.flatnonzero(self.accuracy >= threshold)
        return float(self.times[hits[0]]) if len(hits) else math.inf


def records(history: Sequence[Mapping[str, float]], x: str) -> bool:
    """Whether every evaluation of a run records ``x`` (runs from before trained tokens were added lack it)."""
    return bool(history) and all(X_KEYS[x] in h for h in history)


def curves_on(histories: Mapping[str, Sequence[Sequence[Mapping[str, float]]]], x: str) -> dict[str, list[Curve]]:
    """label -> the curves against ``x`` of that label's runs that record it; the others are left out."""
    return {label: [Curve.from_history(h, x) for h in runs if records(h, x)] for label, runs in histories.items()}


@dataclasses.dataclass(frozen=True)
class Band:
    """Mean and 95% confidence interval across seeds on a shared time grid."""

    grid: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray


def t_critical_95(dof: int) -> float:
    """Two-sided 95% Student-t quantile (scipy ships with jax)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, dof)) if dof > 0 else math.nan


def band(curves: Sequence[Curve], grid: np.ndarray) -> Band:
    values = np.stack([c.at(grid) for c in curves])  # [S, G]
    mean = np.nanmean(values, axis=0) if len(curves) else np.full(len(grid), np.nan)
    if len(curves) > 1:
        half = t_critical_95(len(curves) - 1) * np.nanstd(values, axis=0, ddof=1) / math.sqrt(len(curves))
    else:
        half = np.zeros_like(mean)
    return Band(grid, mean, mean - half, mean + half)


def common_grid(groups: Mapping[str, Sequence[Curve]], points: int = 200) -> np.ndarray:
    end = max(float(c.times[-1]) for curves in groups.values() for c in curves)
    return np.linspace(0.0, end, points)


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """The mean curve over runs, point by point, as the authors average their runs' checkpoints.

    Runs are aligned by evaluation index: point k is the mean of every run's k-th
    evaluation, at the mean of their k-th times (runs that evaluate every X seconds of
    training clock evaluate at about the same times). Runs are cut to the shortest.
    """
    if not curves:
        raise ValueError("no runs to average")
    k = min(len(c.times) for c in curves)
    return Curve(np.mean([c.times[:k] for c in curves], axis=0), np.mean([c.accuracy[:k] for c in curves], axis=0))


@dataclasses.dataclass(frozen=True)
class MethodSummary:
    label: str
    peak: float  # mean over seeds of each seed's peak accuracy
    time_to_target: float  # median over seeds of the first time reaching that seed's target; inf if never
    speedup: float  # median over seeds of baseline time / this method's time on the seed; 0 if never
    seed_times: tuple[float, ...] = ()  # per seed, the first time reaching that seed's target
    seed_speedups: tuple[float, ...] = ()  # per seed, baseline time / this time
    mean_curve_peak: float = math.nan  # best point of this method's mean curve
    mean_curve_time: float = math.inf  # first time its mean curve reaches 99% of the baseline mean curve's best
    mean_curve_speedup: float = 0.0  # the authors' estimator: baseline mean-curve time / this one; 0 if never
    seed_peaks: tuple[float, ...] = ()  # per seed, the best accuracy
    peak_ci95: tuple[float, float] = (math.nan, math.nan)  # Student-t interval of the mean peak over seeds
    speedup_ci95: tuple[float, float] = (math.nan, math.nan)  # of the geometric-mean per-seed speed-up
    late_slopes: tuple[float, ...] = ()  # per seed, ``late_slope``: accuracy per unit of x at the end
    late_slope_ci95: tuple[float, float] = (math.nan, math.nan)  # Student-t interval of their mean


def late_slope(curve: Curve, fraction: float = 1 / 3) -> float:
    """The least-squares slope of accuracy against x over the last ``fraction`` of the run's x
    range: whether a run still gains at its end (a budget long enough for it has it near 0).
    NaN with fewer than 3 evaluations there."""
    end = float(curve.times[-1])
    late = curve.times >= end - fraction * (end - float(curve.times[0]))
    if late.sum() < 3:
        return math.nan
    return float(np.polyfit(curve.times[late], curve.accuracy[late], 1)[0])


def ci95(values: Sequence[float]) -> tuple[float, float]:
    """The two-sided 95% Student-t interval of the mean of ``values`` (NaNs with fewer than two)."""
    values = np.asarray(values, np.float64)
    if len(values) < 2:
        return math.nan, math.nan
    half = t_critical_95(len(values) - 1) * float(values.std(ddof=1)) / math.sqrt(len(values))
    return float(values.mean()) - half, float(values.mean()) + half


def ratio_ci95(ratios: Sequence[float]) -> tuple[float, float]:
    """A 95% interval of the geometric mean of ratios (a t-interval of their logs, mapped back).

    NaNs when a ratio is 0 ("never reached") or infinite: no interval of a mean covers those.
    """
    ratios = np.asarray(ratios, np.float64)
    if not np.all(np.isfinite(ratios) & (ratios > 0)):
        return math.nan, math.nan
    low, high = ci95(np.log(ratios))
    return math.exp(low), math.exp(high)


def summarize(groups: Mapping[str, Sequence[Curve]], baseline: str, fraction: float = 0.99) -> list[MethodSummary]:
    """Peak accuracy, time to ``fraction`` of the baseline's peak and speed-up, per method, both ways.

    Seeds are paired by position: curve i of every method is seed i, and on the tiny
    preset all methods of a seed start from the same warmed-up policy. Seed i's target
    is ``fraction`` times the baseline's peak on seed i (the paper's 99% of GRPO's
    peak), so one strong start does not set a bar that another seed never sees. The
    speed-up on a seed is the baseline's time to the target over the method's (0 when
    the method never reaches it); the summary reports the median over seeds.

    The ``mean_curve_*`` fields are the authors' estimator on the same runs: the target
    is ``fraction`` times the best point of the baseline's ``mean_curve``, and each
    method's time is when its own mean curve first reaches it.
    """
    if baseline not in groups:
        raise ValueError(f"baseline {baseline!r} is not among the methods {sorted(groups)}")
    seeds = {label: len(curves) for label, curves in groups.items()}
    if len(set(seeds.values())) != 1 or not seeds[baseline]:
        raise ValueError(f"every method needs the same seeds, paired by position; got runs per method {seeds}")
    targets = [fraction * float(c.accuracy.max()) for c in groups[baseline]]
    base_times = [c.first_time_reaching(t) for c, t in zip(groups[baseline], targets)]
    means = {label: mean_curve(curves) for label, curves in groups.items()}
    mean_target = fraction * float(means[baseline].accuracy.max())
    mean_base_time = means[baseline].first_time_reaching(mean_target)
    out = []
    for label, curves in groups.items():
        times = [c.first_time_reaching(t) for c, t in zip(curves, targets)]
        ratios = [_speedup(b, t) for b, t in zip(base_times, times)]
        peaks = tuple(float(c.accuracy.max()) for c in curves)
        mean_time = means[label].first_time_reaching(mean_target)
        slopes = tuple(late_slope(c) for c in curves)
        out.append(MethodSummary(label, float(np.mean(peaks)), float(np.median(times)), float(np.median(ratios)),
                                 tuple(times), tuple(ratios), float(means[label].accuracy.max()), mean_time,
                                 _speedup(mean_base_time, mean_time), peaks, ci95(peaks), ratio_ci95(ratios),
                                 slopes, ci95(slopes)))
    return out


def _speedup(base_time: float, time: float) -> float:
    """Baseline time over this time (per seed or per mean curve); the baseline always reaches its own peak."""
    if not math.isfinite(time):
        return 0.0
    if time == 0:
        return math.inf if base_time > 0 else 1.0
    return base_time / time


def plot(groups: Mapping[str, Sequence[Curve]], path: str, title: str, *,
         by_steps: Mapping[str, Sequence[Curve]] | None = None,
         by_tokens: Mapping[str, Sequence[Curve]] | None = None) -> None:
    """Mean accuracy with a shaded 95% CI per method, as a PNG of three panels side by side:
    against the training clock (``groups``), RL steps and trained tokens. A panel
    without curves (runs that do not record its x) says so instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {"time": groups, "steps": by_steps or {}, "tokens": by_tokens or {}}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.2), dpi=120)
    # One colour per label in every panel, also where a panel lacks some labels.
    colours = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(l for p in panels.values() for l in p))}
    for ax, (x, panel) in zip(axes, panels.items()):
        _draw_panel(ax, {label: curves for label, curves in panel.items() if curves}, X_LABELS[x], colours)
    axes[0].set_ylabel("test accuracy")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _draw_panel(ax, groups: Mapping[str, Sequence[Curve]], xlabel: str, colours: Mapping[str, str]) -> None:
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if not groups:
        ax.text(0.5, 0.5, "not recorded by these runs", ha="center", va="center", transform=ax.transAxes)
        return
    grid = common_grid(groups)
    for label, curves in groups.items():
        # Drawn up to the label's earliest-ending run: past it the band would hold that run's
        # last evaluation flat (a faster method's runs end at fewer steps).
        end = min(float(c.times[-1]) for c in curves)
        # The runs' own evaluations are points too, drawn as steps: on the grid alone a last
        # evaluation between two grid points was never drawn.
        shown = np.union1d(grid[grid <= end], np.concatenate([c.times[c.times <= end] for c in curves]))
        b = band(curves, shown)
        # A dot on the last: a run of one evaluation is a point, which a line would not show.
        ax.plot(shown, b.mean, color=colours[label], label=f"{label} (n={len(curves)} seeds)", drawstyle="steps-post",
                marker="o", markevery=[len(shown) - 1], markersize=4)
        ax.fill_between(shown, b.low, b.high, color=colours[label], alpha=0.2, step="post")
    ax.legend()
