"""Curves across seeds: step-function lookup, 95% bands, time to 99% of the baseline's peak."""

import math

import numpy as np
import pytest

from experiments import analysis


def curve(points):
    return analysis.Curve.from_history([{"time/elapsed_train_s": t, "eval/accuracy": a} for t, a in points])


def test_evaluations_at_the_same_x_keep_their_logged_order():
    # Two evaluations at one step (a resumed run re-evaluates): the later one counts, not the best.
    history = [{"step": 0, "eval/accuracy": 0.1}, {"step": 2, "eval/accuracy": 0.5}, {"step": 2, "eval/accuracy": 0.3}]
    assert analysis.Curve.from_history(history, "steps").at(np.array([2.0])).tolist() == [0.3]


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
    # Peaks 0.7 and 0.3: mean 0.5, sample std sqrt(0.08), t(0.975, 1) = 12.7062047.
    half = 12.7062047 * math.sqrt(0.08) / math.sqrt(2)
    assert rows["pods"].seed_peaks == (0.7, 0.3)
    assert rows["pods"].peak_ci95 == pytest.approx((0.5 - half, 0.5 + half))
    # Speed-ups 4 and 2.5: a t-interval of their logs, mapped back (geometric mean sqrt(10)).
    logs = [math.log(4.0), math.log(2.5)]
    log_half = 12.7062047 * abs(logs[0] - logs[1]) / math.sqrt(2) / math.sqrt(2)
    assert rows["pods"].speedup_ci95 == pytest.approx((math.sqrt(10) * math.exp(-log_half),
                                                        math.sqrt(10) * math.exp(log_half)))
    assert all(math.isnan(x) for x in rows["slow"].speedup_ci95)  # "never" has no interval
    with pytest.raises(ValueError, match="baseline 'ppo' is not among"):
        analysis.summarize({"grpo": grpo}, "ppo")
    with pytest.raises(ValueError, match="same seeds"):
        analysis.summarize({"grpo": grpo, "pods": pods[:1]}, "grpo")


def test_a_curve_against_steps_or_trained_tokens_reads_their_keys():
    history = [{"time/elapsed_train_s": 30.0, "step": 4, "train/tokens_total": 900, "eval/accuracy": 0.5},
               {"time/elapsed_train_s": 0.0, "step": 0, "train/tokens_total": 0, "eval/accuracy": 0.2},
               {"time/elapsed_train_s": 12.0, "step": 2, "train/tokens_total": 500, "eval/accuracy": 0.4}]
    by_time = analysis.Curve.from_history(history)
    by_steps = analysis.Curve.from_history(history, x="steps")
    by_tokens = analysis.Curve.from_history(history, x="tokens")
    assert by_time.times.tolist() == [0, 12, 30] and by_time.accuracy.tolist() == [0.2, 0.4, 0.5]
    assert by_steps.times.tolist() == [0, 2, 4] and by_steps.accuracy.tolist() == [0.2, 0.4, 0.5]
    assert by_tokens.times.tolist() == [0, 500, 900] and by_tokens.accuracy.tolist() == [0.2, 0.4, 0.5]
    assert by_steps.first_time_reaching(0.4) == 2
    with pytest.raises(ValueError, match="x must be one of time, steps, tokens; got 'epochs'"):
        analysis.Curve.from_history(history, x="epochs")
    old_run = [{k: v for k, v in h.items() if k != "train/tokens_total"} for h in history]
    with pytest.raises(ValueError, match="lack 'train/tokens_total', which x='tokens' reads"):
        analysis.Curve.from_history(old_run, x="tokens")
    # curves_on leaves out the runs that do not record x instead of failing.
    on_tokens = analysis.curves_on({"grpo": [history, old_run]}, "tokens")
    assert [c.times.tolist() for c in on_tokens["grpo"]] == [[0, 500, 900]]


def figures_saved(monkeypatch):
    """The figures plot saves, kept for a look at their panels."""
    from matplotlib.figure import Figure

    saved, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k)))
    return saved


def test_plot_writes_a_png_of_three_panels(tmp_path, monkeypatch):
    saved = figures_saved(monkeypatch)
    path = tmp_path / "plot.png"
    by_time = {"grpo": [curve([(0, 0.1), (10, 0.3)])], "pods": [curve([(0, 0.1), (5, 0.4)])]}
    by_steps = {"grpo": [curve([(0, 0.1), (2, 0.3)])], "pods": [curve([(0, 0.1), (1, 0.4)])]}
    # Old runs record no trained tokens: that panel stays empty, the others are drawn.
    analysis.plot(by_time, str(path), "t", by_steps=by_steps, by_tokens={"grpo": [], "pods": []})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = saved
    assert [ax.get_xlabel() for ax in fig.axes] == ["training clock (s, evaluation excluded)",
                                                    "RL steps (generated batches)",
                                                    "trained tokens"]
    assert [len(ax.get_lines()) for ax in fig.axes] == [2, 2, 0]
    assert fig.axes[1].get_lines()[0].get_xdata().max() == 2
    # A label missing from one panel leaves the others' colours as in the rest.
    saved.clear()
    analysis.plot(by_time, str(path), "t", by_steps={"grpo": [], "pods": by_steps["pods"]})
    (partial,) = saved
    assert partial.axes[1].get_lines()[0].get_color() == partial.axes[0].get_lines()[1].get_color()
    # Each method is drawn to its own last evaluation, not held flat to the other's.
    assert fig.axes[1].get_lines()[1].get_xdata().max() <= 1
    assert fig.axes[0].get_lines()[1].get_xdata().max() <= 5
    assert [t.get_text() for t in fig.axes[2].texts] == ["not recorded by these runs"]


def test_mean_curve_averages_runs_point_by_point_cut_to_the_shortest():
    m = analysis.mean_curve([curve([(0, 0.2), (10, 0.4), (20, 0.6)]), curve([(0, 0.4), (12, 0.6)])])
    assert m.times.tolist() == [0, 11] and m.accuracy.tolist() == pytest.approx([0.3, 0.5])
    with pytest.raises(ValueError, match="no runs"):
        analysis.mean_curve([])


def test_authors_estimator_uses_the_mean_curves_next_to_the_per_seed_one():
    grpo = [curve([(0, 0.2), (100, 0.5), (200, 0.6)]), curve([(0, 0.1), (100, 0.3), (200, 0.3)])]
    pods = [curve([(0, 0.2), (50, 0.6), (200, 0.7)]), curve([(0, 0.1), (40, 0.3), (200, 0.3)])]
    never = [curve([(0, 0.2), (200, 0.3)]), curve([(0, 0.1), (200, 0.2)])]
    rows = {r.label: r for r in analysis.summarize({"grpo": grpo, "pods": pods, "slow": never}, "grpo")}
    # Mean curves: GRPO (0, 0.15), (100, 0.4), (200, 0.45); PODS (0, 0.15), (45, 0.45), (200, 0.5).
    # Target 0.99 * 0.45 = 0.4455: GRPO reaches it at 200 s, PODS at 45 s -> 200 / 45.
    assert rows["grpo"].mean_curve_peak == pytest.approx(0.45) and rows["pods"].mean_curve_peak == pytest.approx(0.5)
    assert rows["grpo"].mean_curve_time == 200 and rows["grpo"].mean_curve_speedup == 1.0
    assert rows["pods"].mean_curve_time == 45 and rows["pods"].mean_curve_speedup == pytest.approx(200 / 45)
    assert rows["slow"].mean_curve_time == math.inf and rows["slow"].mean_curve_speedup == 0.0
    # The per-seed estimator on the same runs (test above) gives 3.25: the two differ.
    assert rows["pods"].speedup == pytest.approx(3.25)


def test_the_estimators_differ_when_seeds_peak_at_different_times():
    # Each seed's peak is 1.0 but the mean curves only reach 0.5: the per-seed targets are
    # 0.99 per seed, the authors' target 0.495 on the mean curves.
    grpo = [curve([(0, 0.0), (10, 1.0), (20, 0.0)]), curve([(0, 0.0), (10, 0.0), (20, 1.0)])]
    pods = [curve([(0, 0.0), (5, 1.0), (20, 0.0)]), curve([(0, 1.0), (10, 0.0), (20, 0.0)])]
    rows = {r.label: r for r in analysis.summarize({"grpo": grpo, "pods": pods}, "grpo")}
    # Mean curves: GRPO 0, 0.5, 0.5 at 0, 10, 20 s; PODS 0.5, 0.5, 0 at 0, 7.5, 20 s.
    assert rows["grpo"].mean_curve_time == 10 and rows["pods"].mean_curve_time == 0
    assert rows["pods"].mean_curve_speedup == math.inf
    assert rows["pods"].seed_speedups == (2.0, math.inf)


def test_compare_reports_both_estimators():
    from experiments.compare import format_summary

    grpo = [curve([(0, 0.2), (100, 0.5), (200, 0.6)]), curve([(0, 0.1), (100, 0.3), (200, 0.3)])]
    pods = [curve([(0, 0.2), (50, 0.6), (200, 0.7)]), curve([(0, 0.1), (40, 0.3), (200, 0.3)])]
    table = format_summary(analysis.summarize({"grpo": grpo, "pods": pods}, "grpo"), "grpo", 2)
    assert "median of per-seed ratios" in table and "authors': mean curves" in table
    assert "| pods | 50.0% | 45 s | 3.25x | 50.0% | 45 s | 4.44x | -204.1% to 304.1% | 0.16x to 62.63x |" in table


def test_late_slope_fits_the_last_third_of_a_run_only():
    # Rising 0.1 per 100 s until 600 s, then flat: over 600-900 s the slope is 0, over a run cut at
    # 600 s it is the rise; a last third with 2 evaluations has no slope.
    rising = [(t, 0.2 + 0.001 * t) for t in range(0, 601, 20)]
    assert analysis.late_slope(curve(rising)) == pytest.approx(0.001)
    assert analysis.late_slope(curve(rising + [(t, 0.8) for t in range(620, 901, 20)])) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(analysis.late_slope(curve([(0, 0.1), (10, 0.2), (100, 0.3), (200, 0.4)])))


def test_compare_says_whether_each_method_still_gained_at_the_end():
    from experiments.compare import format_late_gains

    def run(slope, wobble):  # accuracy rising by ``slope`` per second, with a seed's own wobble
        return curve([(t, 0.3 + slope * t + wobble * (-1) ** (t // 20)) for t in range(0, 301, 20)])

    groups = {"grpo": [run(0.0005, 0.001), run(0.0004, -0.002), run(0.0006, 0.0)],
              "pods": [run(0.0003, 0.01), run(-0.0003, -0.01), run(0.0, 0.005)]}
    text = format_late_gains(analysis.summarize(groups, "grpo"))
    grpo, pods = text.splitlines()[1:]
    assert grpo.startswith("  grpo: +5.0 (95% CI +") and grpo.endswith("still rising")
    assert pods.startswith("  pods: -0.1 (") and pods.endswith("no trend its interval can tell from 0")
    single = format_late_gains(analysis.summarize({"grpo": [run(0.0005, 0.0)]}, "grpo"))
    assert single.splitlines()[1] == "  grpo: - (needs 2 seeds, each with 3 evaluations in its last third)"


def test_a_panel_draws_each_method_up_to_and_including_its_runs_last_evaluation():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # grpo's last evaluation (0.9 at x = 10) falls between two points of the shared grid,
    # which runs to pods' 10.5: it had never been drawn (the line ended at x 9.97, y 0.2).
    groups = {"grpo": [analysis.Curve(np.array([0.0, 10.0]), np.array([0.2, 0.9]))],
              "pods": [analysis.Curve(np.array([0.0, 10.5]), np.array([0.2, 0.3]))]}
    fig, ax = plt.subplots()
    analysis._draw_panel(ax, groups, "t", {"grpo": "C0", "pods": "C1"})
    ends = {line.get_label().split()[0]: (line.get_xdata()[-1], line.get_ydata()[-1]) for line in ax.get_lines()}
    plt.close(fig)
    assert ends == {"grpo": (10.0, 0.9), "pods": (10.5, 0.3)}
