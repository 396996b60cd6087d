"""Accuracy-versus-training-clock curves across seeds: means, 95% CIs, peaks, speed-ups."""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Curve:
    """Step-function accuracy of one run: the last evaluation at or before each time."""

    times: np.ndarray  # [E] training-clock seconds of each evaluation, ascending
    accuracy: np.ndarray  # [E]

    @classmethod
    def from_history(cls, history: Sequence[Mapping[str, float]]) -> Curve:
        if not history:
            raise ValueError("a run has no evaluations")
        points = sorted((float(h["time/elapsed_train_s"]), float(h["eval/accuracy"])) for h in history)
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


@dataclasses.dataclass(frozen=True)
class MethodSummary:
    label: str
    peak: float  # mean over seeds of each seed's peak accuracy
    time_to_target: float  # median over seeds of the first time reaching that seed's target; inf if never
    speedup: float  # median over seeds of baseline time / this method's time on the seed; 0 if never
    seed_times: tuple[float, ...] = ()  # per seed, the first time reaching that seed's target
    seed_speedups: tuple[float, ...] = ()  # per seed, baseline time / this time


def summarize(groups: Mapping[str, Sequence[Curve]], baseline: str, fraction: float = 0.99) -> list[MethodSummary]:
    """Peak accuracy, time to ``fraction`` of the baseline's peak and speed-up, per method.

    Seeds are paired by position: curve i of every method is seed i, and on the tiny
    preset all methods of a seed start from the same warmed-up policy. Seed i's target
    is ``fraction`` times the baseline's peak on seed i (the paper's 99% of GRPO's
    peak), so one strong start does not set a bar that another seed never sees. The
    speed-up on a seed is the baseline's time to the target over the method's (0 when
    the method never reaches it); the summary reports the median over seeds.
    """
    if baseline not in groups:
        raise ValueError(f"baseline {baseline!r} is not among the methods {sorted(groups)}")
    seeds = {label: len(curves) for label, curves in groups.items()}
    if len(set(seeds.values())) != 1 or not seeds[baseline]:
        raise ValueError(f"every method needs the same seeds, paired by position; got runs per method {seeds}")
    targets = [fraction * float(c.accuracy.max()) for c in groups[baseline]]
    base_times = [c.first_time_reaching(t) for c, t in zip(groups[baseline], targets)]
    out = []
    for label, curves in groups.items():
        times = [c.first_time_reaching(t) for c, t in zip(curves, targets)]
        ratios = [_speedup(b, t) for b, t in zip(base_times, times)]
        peak = float(np.mean([c.accuracy.max() for c in curves]))
        out.append(MethodSummary(label, peak, float(np.median(times)), float(np.median(ratios)),
                                 tuple(times), tuple(ratios)))
    return out


def _speedup(base_time: float, time: float) -> float:
    """Baseline time over this time on one seed; the baseline always reaches its own peak."""
    if not math.isfinite(time):
        return 0.0
    if time == 0:
        return math.inf if base_time > 0 else 1.0
    return base_time / time


def plot(groups: Mapping[str, Sequence[Curve]], path: str, title: str) -> None:
    """Mean accuracy with a shaded 95% CI per method against the training clock, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = common_grid(groups)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for label, curves in groups.items():
        b = band(curves, grid)
        ax.plot(grid, b.mean, label=f"{label} (n={len(curves)} seeds)")
        ax.fill_between(grid, b.low, b.high, alpha=0.2)
    ax.set_xlabel("training clock (s, evaluation excluded)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
