"""Dynamic sampling's choice of groups, the step's zero-variance and length scalars, perf, the eval line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podsjax.devices import mesh as mesh_lib
from podsjax.rl import dynamic_sampling, perf, scoring
from podsjax.rl.step_data import Scored


def test_zero_variance_marks_groups_whose_rewards_all_agree():
    rewards = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5000001], [0.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(dynamic_sampling.zero_variance(rewards), [True, False, False, True])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=24), st.integers(1, 24))
def test_choose_groups_keeps_the_first_informative_groups_then_fills_in_draw_order(zero, wanted):
    zero = np.array(zero)
    if wanted > len(zero):
        with pytest.raises(ValueError, match=f"{len(zero)} groups drawn cannot fill {wanted}"):
            dynamic_sampling.choose_groups(zero, wanted)
        return
    chosen, filled = dynamic_sampling.choose_groups(zero, wanted)
    # Reference: walk the draws once, informative groups first.
    informative = [g for g in range(len(zero)) if not zero[g]][:wanted]
    flat = [g for g in range(len(zero)) if zero[g]][: wanted - len(informative)]
    assert list(chosen) == sorted(informative + flat)
    assert filled == len(flat) == max(0, wanted - int((~zero).sum()))
    assert len(set(chosen.tolist())) == wanted


def test_group_rows_and_take_scored_pick_whole_groups_and_sum_the_counts():
    rows = dynamic_sampling.group_rows(np.array([1, 3]), n=2)
    np.testing.assert_array_equal(rows, [2, 3, 6, 7])
    first, second = (Scored(np.arange(4.0) + offset, np.arange(4) + offset, np.zeros(4),
                            {"reward/accuracy": np.arange(4.0) + offset}, {"reward/errors": errors})
                     for offset, errors in ((0, 1.0), (4, 2.0)))
    taken = dynamic_sampling.take_scored([first, second], rows)
    np.testing.assert_array_equal(taken.total, [2.0, 3.0, 6.0, 7.0])
    np.testing.assert_array_equal(taken.length, [2, 3, 6, 7])
    np.testing.assert_array_equal(taken.per_function["reward/accuracy"], [2.0, 3.0, 6.0, 7.0])
    assert taken.failures == {"reward/errors": 3.0}


@pytest.mark.cpu_mesh
def test_take_rows_gathers_across_draws_and_keeps_the_placement():
    mesh = mesh_lib.make_mesh(8)
    sharding = mesh_lib.batch_sharding(mesh, 2)
    parts = [jax.device_put(jnp.arange(16 * 3).reshape(16, 3) + 100 * i, sharding) for i in range(2)]
    rows = dynamic_sampling.group_rows(np.array([0, 3, 5, 6]), n=4)  # groups of 4 rows, across both draws
    taken = dynamic_sampling.take_rows(parts, rows)
    expected = np.concatenate([np.asarray(p) for p in parts])[rows]
    np.testing.assert_array_equal(np.asarray(taken), expected)
    assert taken.sharding == sharding
    assert dynamic_sampling.take_rows([None, None], rows) is None


def test_reward_stats_count_zero_variance_groups_before_and_after_selection():
    rewards = np.array([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    selected = np.array([[True, False, True, False], [True, True, False, False], [True, True, False, False]])
    flat = rewards.reshape(-1)
    stats = scoring.reward_stats(Scored(flat, np.ones(flat.shape, np.int32), np.zeros_like(flat)), rewards, selected)
    assert stats["reward/zero_std_groups"] == pytest.approx(1 / 3)
    assert stats["reward/zero_std_groups_selected"] == pytest.approx(2 / 3)  # groups 1 and 2 kept equal rewards


def test_length_stats_as_trl_and_verl_report_them():
    stats = scoring.length_stats(Scored(np.zeros(4), np.array([3, 8, 5, 8]), np.array([0.0, 1.0, 0.0, 1.0])))
    assert stats == {"completion/length_mean": 6.0, "completion/length_min": 3.0, "completion/length_max": 8.0,
                     "completion/truncated_frac": 0.5, "completion/terminated_length_mean": 4.0}
    assert np.isnan(scoring.length_stats(Scored(np.zeros(1), np.array([8]), np.array([1.0])))[
        "completion/terminated_length_mean"])


def test_step_flops_and_mfu_by_hand():
    # N = 1e9: generation 2N (100 + 400); update (6 * 2 + 2 * 1) N * 300.
    flops = perf.step_flops(10**9, prompt_tokens=100, completion_tokens=400, trained_tokens=300, passes=2,
                            extra_forwards=1)
    assert flops == pytest.approx(2e9 * 500 + 14e9 * 300)
    out = perf.perf_scalars(seconds=2.0, tokens=1000, flops=flops, devices=4, peak_flops=1e12)
    assert out == pytest.approx({"perf/time_per_step": 2.0, "perf/throughput": 125.0,
                                 "perf/mfu": flops / (2.0 * 4 * 1e12)})
    assert "perf/mfu" not in perf.perf_scalars(seconds=2.0, tokens=1000, flops=flops, devices=1, peak_flops=None)


def test_the_eval_line_adds_pass_and_maj_at_k():
    from podsjax.rl import RunConfig, reporting

    run = RunConfig(out_dir="unused", max_steps=1, eval_repeats=4, eval_temperature=0.9, eval_k=(1, 4))
    evaluation = {"step": 3, "eval/accuracy": 0.25, "eval/accuracy_std": 0.01, "eval/examples": 8.0,
                  "eval/pass_at_1": 0.25, "eval/maj_at_1": 0.25, "eval/pass_at_4": 0.5, "eval/maj_at_4": 0.375}
    assert reporting.eval_line(evaluation, run) == (
        "eval at step 3: accuracy 25.0% (mean of 4 passes at temperature 0.9, std 1.0%) on 8 examples; "
        "pass@1 25.0%, maj@1 25.0%; pass@4 50.0%, maj@4 37.5%")


def test_a_step_logs_every_failure_count_the_scorer_reports_restarts_too(monkeypatch):
    from podsjax.data import prompts as prompts_lib
    from podsjax.data.datasets import Example
    from podsjax.rewards.combine import RewardScores

    monkeypatch.setattr(prompts_lib, "decode_completions", lambda tokenizer, tokens, mask: ["x"] * len(tokens))
    counts = {"reward/timeouts": 1, "reward/crashes": 0, "reward/memory_errors": 2, "reward/errors": 0,
              "reward/restarts": 3, "reward/seconds": 0.5}

    class Scorer:
        def score(self, completions, rewards, **columns):
            ones = np.ones(len(completions), np.float32)
            return RewardScores(ones, {"accuracy": ones}, np.zeros(len(completions), bool), dict(counts))

    examples = [Example("q", "1", {}, "here")]
    scored = scoring.score_rollouts(None, Scorer(), [], examples, 2, 0, np.zeros((2, 3), np.int32),
                                    np.ones((2, 3), np.int32), np.zeros(2, bool))
    # Counts of what went wrong (restarts of dead or stuck workers among them), not timings.
    assert scored.failures == {k: float(v) for k, v in counts.items() if k != "reward/seconds"}


def test_odd_inputs_of_the_group_helpers_are_one_line():
    with pytest.raises(ValueError, match="wanted must be an integer >= 0; got -1"):  # had taken all but the last
        dynamic_sampling.choose_groups(np.zeros(4, bool), -1)
    with pytest.raises(ValueError, match=r"rewards must be \[groups, n\]; got shape \(4,\)"):
        dynamic_sampling.zero_variance(np.zeros(4))


def test_a_step_s_mfu_counts_each_prompt_once_per_trained_row(monkeypatch):
    # 2 prompts of 10 and 6 tokens, n 4, m 2: the update trains each prompt m times (not n),
    # plus the selected completions' 3 + 5 + 1 + 8 tokens.
    from types import SimpleNamespace

    from podsjax.devices import topology
    from podsjax.rl import rl_step

    monkeypatch.setattr(topology, "chip", lambda kind: SimpleNamespace(peak_flops=1e12))
    algo = SimpleNamespace(n=4, m=2, beta=0.0, old_logprobs="reuse", updates_per_step=1, num_iterations=1)
    model = SimpleNamespace(config=SimpleNamespace(num_params=10**6), mesh=None)
    prompts = SimpleNamespace(lengths_P=np.array([10, 6]))
    draw = SimpleNamespace(prompts=prompts)
    lengths = np.array([3, 9, 5, 2, 7, 4, 1, 8])
    selected = np.array([[True, False, True, False], [False, False, True, True]])
    out = rl_step.RLStep._perf(SimpleNamespace(parts=SimpleNamespace(algo=algo, model=model)), {"generate": 2.0},
                               [draw], draw, Scored(np.zeros(8), lengths, np.ones(8)), selected, generated=39)
    trained = (10 + 6) * 2 + (3 + 5 + 1 + 8)
    flops = perf.step_flops(10**6, prompt_tokens=16, completion_tokens=39, trained_tokens=trained, passes=1,
                            extra_forwards=0)
    assert out["perf/mfu"] == pytest.approx(flops / (2.0 * 1e12))
    assert out["perf/throughput"] == pytest.approx((16 * 4 + 39) / 2.0)
