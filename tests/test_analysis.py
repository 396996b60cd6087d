"""Curves across seeds: step-function lookup, 95% bands, time to 99% of the baseline's peak."""

import math

import numpy as np
import pytest

from podsjax import analysis


def curve(points):
    return analysis.Curve.from_history([{"time/elapsed_train_s": t, "eval/accuracy": a} for t, a in points])


def test_curve_is_a_step_function_of_the_last_evaluation():
    c = curve([(10, 0.5), (0, 0.2), (20, 0.4)])  # unsorted input
    assert c.times.tolist() == [0, 10, 20]
    got = c.at(np.array([-1.0, 0.0, 5.0, 10.0, 25.0]))
    assert np.isnan(got[0]) and got[1:].tolist() == [0.2, 0.2, 0.5, 0.4]
    assert c.first_time_reaching(0.45) == 10 and c.first_time_reaching(0.9) == math.inf


def test_band_is_mean_plus_minus_t_times_standard_error():
    curves = [curve([(0, a)]) for a in (0.1, 0.2, 0.6)]
    b = analysis.band(curves, np.array([0.0]))
    # mean 0.3; sample std sqrt(((-.2)^2 + (-.1)^2 + .3^2) / 2) = sqrt(0.07); t(0.975, 2) = 4.302653
    half = 4.302653 * math.sqrt(0.07) / math.sqrt(3)
    assert b.mean[0] == pytest.approx(0.3)
    assert (b.low[0], b.high[0]) == pytest.approx((0.3 - half, 0.3 + half), abs=1e-6)


def test_speedup_to_99_percent_of_the_baseline_peak_per_seed():
    grpo = [curve([(0, 0.2), (100, 0.5), (200, 0.6)]), curve([(0, 0.1), (100, 0.3), (200, 0.3)])]
    pods = [curve([(0, 0.2), (50, 0.6), (200, 0.7)]), curve([(0, 0.1), (40, 0.3), (200, 0.3)])]
    never = [curve([(0, 0.2), (200, 0.3)]), curve([(0, 0.1), (200, 0.2)])]
    rows = {r.label: r for r in analysis.summarize({"grpo": grpo, "pods": pods, "slow": never}, "grpo")}
    # Seed 0: GRPO's peak 0.6 -> target 0.594, reached by GRPO at 200 s and PODS at 50 s.
    # Seed 1: GRPO's peak 0.3 -> target 0.297, reached by GRPO at 100 s and PODS at 40 s.
    # Median times: GRPO 150 s, PODS 45 s. Speed-ups per seed 200/50 = 4 and 100/40 = 2.5,
    # median 3.25. A shared target (mean peak 0.45) would never be reached on seed 1.
    assert rows["grpo"].time_to_target == 150 and rows["grpo"].speedup == 1.0
    assert rows["pods"].time_to_target == 45 and rows["pods"].speedup == pytest.approx(3.25)
    assert rows["pods"].peak == pytest.approx(0.5)
    assert rows["pods"].seed_times == (50, 40) and rows["pods"].seed_speedups == (4.0, 2.5)
    assert rows["slow"].time_to_target == math.inf and rows["slow"].speedup == 0.0
    with pytest.raises(ValueError, match="baseline 'ppo' is not among"):
        analysis.summarize({"grpo": grpo}, "ppo")
    with pytest.raises(ValueError, match="same seeds"):
        analysis.summarize({"grpo": grpo, "pods": pods[:1]}, "grpo")


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "plot.png"
    analysis.plot({"grpo": [curve([(0, 0.1), (10, 0.3)])], "pods": [curve([(0, 0.1), (5, 0.4)])]}, str(path), "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
