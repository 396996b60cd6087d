"""experiments.compare: every variant is a typed override of one parsed config; stopped runs continue."""

import argparse
import copy
import dataclasses
import json
import math
import os

import pytest

from experiments import compare
from experiments import config_decoding
from experiments import flags as flags_lib
from experiments.usage import UsageError
from podsjax.update.algorithms import AlgorithmConfig


@pytest.fixture
def model_dir(tmp_path):
    """A directory flags.check takes for a checkpoint (nothing here loads it)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return str(path)


def prepare(tmp_path, *argv):
    return compare.prepare([*argv, "--out", str(tmp_path / "cmp")])


def test_the_n_ablation_sets_n_at_m_16_over_the_shared_config(tmp_path):
    comparison = prepare(tmp_path, "--ablation", "n", "--lr", "0.001", "--max-steps", "3")
    assert list(comparison.variants) == ["n=16", "n=32", "n=64", "n=128", "n=256"]
    for label, config in comparison.variants.items():
        assert isinstance(config.algorithm, AlgorithmConfig)
        assert (config.algorithm.algorithm, config.algorithm.n, config.algorithm.m) == ("pods", int(label[2:]), 16)
        assert config.algorithm.learning_rate == 0.001  # the shared flags' change stays
        # Only the algorithm section differs from the shared config.
        assert dataclasses.replace(config, algorithm=comparison.shared.algorithm) == comparison.shared
        assert config.run.max_steps == 3
    rule = prepare(tmp_path, "--ablation", "rule", "--n", "8", "--m", "2").variants
    assert {label: (c.algorithm.rule, c.algorithm.n, c.algorithm.m) for label, c in rule.items()} == {
        r: (r, 8, 2) for r in ("max_variance", "max_reward", "random", "percentile")}


@pytest.mark.parametrize("shared", [
    [],
    ["--n", "4", "--m", "2"],
    ["--n", "8", "--beta", "0.01", "--lr", "0.001"],
    ["--m", "8", "--grad-accum", "2"],
    ["model", "--max-steps", "2"],
    ["model", "--setting", "a", "--n", "32"],
    ["model", "--setting", "b", "--temperature", "0.7"],
])
def test_each_method_gets_the_config_its_own_command_line_would(tmp_path, model_dir, shared):
    shared = [token for s in shared for token in (["--model", model_dir] if s == "model" else [s])]
    variants = prepare(tmp_path, "--methods", "grpo,grpo-ga,pods", *shared).variants
    for method, config in variants.items():
        own_flags = shared
        if method != "pods" and "--m" in shared and "--n" in shared:  # grpo's own command line takes one of them
            own_flags = [t for i, t in enumerate(shared) if "--n" not in (t, shared[i - 1] if i else None)]
        _, own = flags_lib.parse("gsm8k", [*own_flags, "--method", method])
        assert config.algorithm == own.algorithm, method
        assert config == own, method


def test_grpo_trains_what_pods_trains(tmp_path):
    variants = prepare(tmp_path, "--n", "4", "--m", "2").variants
    assert [(c.algorithm.algorithm, c.algorithm.n, c.algorithm.m) for c in variants.values()] == [
        ("grpo", 2, 2), ("pods", 4, 2)]


def test_a_setting_without_a_method_and_bad_lists_give_one_line_and_exit_2(tmp_path, model_dir, capsys):
    for argv, message in [
        (["--methods", "grpo,pods", "--setting", "e", "--model", model_dir], "setting e has no method 'grpo'"),
        (["--methods", "grpo,ppo"], "--methods must name grpo, grpo-ga or pods"),
        (["--seeds", "0,x"], "--seeds wants comma-separated integers"),
        (["--seeds", "0,1,0"], "--seeds names seed 0 twice"),
        (["--methods", "pods,grpo,pods"], "--methods names pods twice"),
        (["--methods", "grpo,pods", "--ablation", "n"], "--methods and --ablation exclude each other"),
        (["--seeds", "-1"], "RunConfig.seed must be an integer from 0"),
        (["--seed", "1"], "--seed is set by compare itself"),
        (["--baseline", "grpo-ga"], "--baseline 'grpo-ga' is not among"),
        (["--ablation", "m", "--lr", "inf"], "learning_rate must be finite"),
        # Spelled otherwise, these had been ignored: seeds 0.. and both methods ran regardless.
        (["--seed=5"], "--seed is set by compare itself"),
        (["--run.seed", "5"], "--run.seed is set by compare itself"),
        (["--method=grpo"], "--method is set by compare itself"),
        (["--run.out_dir", "x"], "--run.out_dir is set by compare itself"),
        # A swept field given too had been overwritten in every run, or had made both arms one.
        (["--ablation", "n", "--m", "8"], "--ablation n sets algorithm.m in each run; remove --m"),
        (["--ablation", "dynamic_sampling", "--algorithm.dynamic_sampling", "true"],
         "--ablation dynamic_sampling sets algorithm.dynamic_sampling in each run; remove --algorithm.dynamic_sampling"),
        (["--ablation", "rule", "--rule=random"], "--ablation rule sets algorithm.rule in each run; remove --rule"),
        # Every run had trained, then the comparison found no evaluation to read.
        (["--eval-every", "null"], "compare reads each run's evaluations, and --eval-every null turns them off"),
    ]:
        assert compare.main([*argv, "--out", str(tmp_path / "cmp")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "cmp").exists()


def test_a_seed_sets_the_seed_the_directory_and_on_the_tiny_preset_the_shared_warm_up(tmp_path, model_dir):
    tiny = prepare(tmp_path).variants["pods"]
    run = compare.seed_config(tiny, 3, "root/pods-seed3", str(tmp_path))
    # The shared warm-up cache's, as a single run of the seed (no directory of the comparison's own) ...
    assert (run.run.seed, run.run.out_dir, run.tiny.warmup_dir) == (3, "root/pods-seed3", None)
    # ... unless an earlier comparison made its own there: it goes on with that one.
    (tmp_path / "tiny_warmup-seed3").mkdir()
    run = compare.seed_config(tiny, 3, "root/pods-seed3", str(tmp_path))
    assert run.tiny.warmup_dir == str(tmp_path / "tiny_warmup-seed3")
    with_model = prepare(tmp_path, "--model", model_dir, "--max-steps", "2").variants["pods"]
    real = compare.seed_config(with_model, 1, "o", "root")
    assert (real.run.seed, real.tiny.warmup_dir) == (1, None)


def test_a_stopped_run_continues_a_complete_one_is_read_or_extended_and_a_changed_one_is_refused(tmp_path, monkeypatch):
    from experiments import runner

    calls = []

    def fake_run(config, out_dir, *, overwrite, resume, dry_run=False, topology=None, started_at=None):
        calls.append((config, out_dir, resume))
        os.makedirs(out_dir, exist_ok=True)
        if not resume:
            with open(os.path.join(out_dir, "config.json"), "w") as f:
                json.dump(config_decoding.as_json(config), f)
        return 0

    monkeypatch.setattr(runner, "run_experiment", fake_run)
    out = str(tmp_path / "pods-seed0")
    config = compare.seed_config(prepare(tmp_path).variants["pods"], 0, out, str(tmp_path))
    assert compare.run_one(config) == []
    assert calls == [(config, out, False)]
    # Stopped before its export: the same config continues it, a longer budget too.
    longer = flags_lib.replace_run(config, time_budget_s=999.0, max_steps=7)
    compare.run_one(longer)
    assert calls[-1] == (longer, out, True)
    changed = dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm, learning_rate=0.5))
    with pytest.raises(UsageError, match="was started with --algorithm.learning_rate 0.0002, not 0.5"):
        compare.run_one(changed)
    # Complete: only its evaluations are read, with its own flags (it had been read as any other
    # comparison's, whose flags differ).
    os.makedirs(os.path.join(out, "final_model"))
    open(os.path.join(out, "final_model", "config.json"), "w").close()
    open(os.path.join(out, "exported.json"), "w").close()
    with open(os.path.join(out, "eval_history.jsonl"), "w") as f:
        f.write(json.dumps({"time/elapsed_train_s": 1.0, "eval/accuracy": 0.5}) + "\n")
    with pytest.raises(UsageError, match="was started with --algorithm.learning_rate 0.0002, not 0.5"):
        compare.run_one(changed)
    assert compare.run_one(config) == [{"time/elapsed_train_s": 1.0, "eval/accuracy": 0.5}]
    assert len(calls) == 2
    # Complete, and asked for a longer budget than it started with: it continues, until its last
    # training step reaches that budget (its last evaluation may come a step before).
    budget = config.run.time_budget_s
    longer = flags_lib.replace_run(config, time_budget_s=budget + 300)
    compare.run_one(longer)
    assert calls[-1] == (longer, out, True)
    with open(os.path.join(out, "eval_history.jsonl"), "a") as f:
        f.write(json.dumps({"time/elapsed_train_s": budget + 299, "eval/accuracy": 0.6}) + "\n")
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 9, "time/elapsed_train_s": budget + 301}) + "\n")
    assert compare.run_one(longer)[-1]["eval/accuracy"] == 0.6
    assert compare.run_one(config)[-1]["eval/accuracy"] == 0.6
    assert len(calls) == 3
    # Asked again for less than it trained: the curve up to it (the longer one had been read
    # silently), in steps, and in training clock up to the step that first reached the budget.
    with open(os.path.join(out, "eval_history.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "time/elapsed_train_s": s * budget / 3, "eval/accuracy": s / 10}) + "\n"
                     for s in (0, 3, 6))
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "time/elapsed_train_s": s * budget / 3}) + "\n" for s in range(1, 7))
    assert [e["step"] for e in compare.run_one(flags_lib.replace_run(config, max_steps=2))] == [0]
    assert [e["step"] for e in compare.run_one(config)] == [0, 3]  # the extended run, asked for its first budget
    assert len(calls) == 3


def test_the_dynamic_sampling_ablation_and_its_step_figures(tmp_path):
    variants = prepare(tmp_path, "--ablation", "dynamic_sampling", "--n", "8", "--m", "2").variants
    assert {label: (c.algorithm.algorithm, c.algorithm.dynamic_sampling) for label, c in variants.items()} == {
        "pods": ("pods", False), "pods+dynamic": ("pods", True)}
    # Two runs' metrics: the first step of each (its compile) is left out of the means.
    rows = {"a": [(0.9, 0.9, None, 50.0, 50.0), (0.5, 0.25, 0.75, 3.0, 1.0), (0.25, 0.0, 0.5, 1.0, 3.0)],
            "b": [(0.0, 0.0, None, 9.0, 9.0), (0.75, 0.5, 1.0, 2.0, 2.0)]}
    for run, steps in rows.items():
        os.makedirs(tmp_path / run)
        with open(tmp_path / run / "metrics.jsonl", "w") as f:
            f.write(json.dumps({"step": 0, "eval/accuracy": 0.1}) + "\n")
            for before, after, drawn, generation, update in steps:
                record = {"train/loss": 0.0, "reward/zero_std_groups": before,
                          "reward/zero_std_groups_selected": after, "time/generation": generation,
                          "time/scoring": 0.0, "time/selection": 0.0, "time/update": update}
                if drawn is not None:
                    record["data/zero_std_groups_drawn"] = drawn
                f.write(json.dumps(record) + "\n")
    figures = compare.step_figures([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "missing")])
    assert figures == pytest.approx({"steps": 3, "zero-variance groups drawn": 0.75, "before selection": 0.5,
                                     "after selection": 0.25, "generation share": 0.5, "scoring share": 0.0,
                                     "selection share": 0.0, "update share": 0.5})
    table = compare.format_step_figures({"pods": figures, "grpo": {"steps": 0.0}})
    assert "| pods | 3 | 75.0% | 50.0% | 25.0% | 50.0% | 0.0% | 0.0% | 50.0% |" in table
    assert "| grpo | 0 | - | - | - |" in table


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_each_evaluation_gets_the_tokens_trained_by_its_step(tmp_path):
    # Steps 1, 2 and 4 trained 100, 250 and 40 tokens; step 3 left no row; evaluation rows count nothing.
    write_jsonl(tmp_path / "metrics.jsonl", [
        {"step": 0, "eval/accuracy": 0.1}, {"step": 1, "train/num_tokens": 100.0},
        {"step": 2, "train/num_tokens": 250.0}, {"step": 2, "eval/accuracy": 0.2},
        {"step": 4, "train/num_tokens": 40.0}])
    history = [{"step": s, "eval/accuracy": 0.1} for s in (0, 2, 3, 4)]
    before = copy.deepcopy(history)
    got = compare.with_trained_tokens(history, str(tmp_path))
    assert [e["train/tokens_total"] for e in got] == [0, 350, 350, 390]
    assert [e["eval/accuracy"] for e in got] == [0.1] * 4
    assert history == before  # the caller's evaluations are not changed in place
    # A run with no token counts (an older run, or none logged) keeps its evaluations as they are.
    assert compare.with_trained_tokens(history, str(tmp_path / "missing")) == before
    (tmp_path / "old").mkdir()
    write_jsonl(tmp_path / "old" / "metrics.jsonl", [{"step": 1, "train/loss": 0.5}])
    assert compare.with_trained_tokens(history, str(tmp_path / "old")) == before


def test_report_plots_three_panels_and_stores_the_speed_up_in_steps(tmp_path, capsys):
    def run(points):
        return [{"time/elapsed_train_s": t, "step": s, "train/tokens_total": 10 * s, "eval/accuracy": a}
                for t, s, a in points]

    # GRPO reaches its peak at step 4 on both seeds; PODS reaches it at step 2 and step 1.
    histories = {"grpo": [run([(0, 0, 0.1), (40, 4, 0.5)]), run([(0, 0, 0.1), (40, 4, 0.3)])],
                 "pods": [run([(0, 0, 0.1), (30, 2, 0.5)]), run([(0, 0, 0.1), (10, 1, 0.3)])]}
    args = argparse.Namespace(task="gsm8k", ablation=None, seeds=[0, 1], out=str(tmp_path))
    assert compare.report(compare.Comparison(args, None, None, {}, "grpo"), histories) == 0
    printed = capsys.readouterr().out
    assert "  pods: 2.00x, 4.00x (median 3.00x)" in printed
    # Strict JSON, as any reader parses it: never reached or undefined is null, not NaN or Infinity.
    summary = json.load(open(tmp_path / "summary.json"), parse_constant=lambda name: pytest.fail(name))
    assert summary["step_speedups"]["pods"] == {"steps_to_target": [2, 1], "speedups": [2.0, 4.0], "median": 3.0}
    assert summary["methods"][1]["speedup"] == pytest.approx((40 / 30 + 4) / 2)  # still on the clock
    assert (tmp_path / "accuracy_vs_time.png").read_bytes()[:4] == b"\x89PNG"
    # Runs whose evaluations lack trained tokens or steps still plot; the steps table is left out.
    old = {label: [[{"time/elapsed_train_s": e["time/elapsed_train_s"], "eval/accuracy": e["eval/accuracy"]}
                    for e in h] for h in runs] for label, runs in histories.items()}
    assert compare.report(compare.Comparison(args, None, None, {}, "grpo"), old) == 0
    assert "RL steps" not in capsys.readouterr().out
    assert json.load(open(tmp_path / "summary.json"))["step_speedups"] == {}


def test_report_names_the_runs_without_evaluations_in_one_line(tmp_path, capsys):
    args = argparse.Namespace(task="gsm8k", ablation=None, seeds=[0, 1], out=str(tmp_path))
    evaluated = [{"time/elapsed_train_s": 0, "step": 0, "eval/accuracy": 0.1}]
    histories = {"grpo": [evaluated, evaluated], "pods": [evaluated, []]}
    assert compare.report(compare.Comparison(args, None, None, {}, "grpo"), histories) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no evaluations in pods-seed1 ") and "\n" not in err
    assert not (tmp_path / "summary.json").exists()


def test_a_comparison_starts_its_runs_where_its_dry_run_left_only_figures(tmp_path, monkeypatch):
    from experiments import runner

    calls = []

    def fake_run(config, out_dir, *, overwrite, resume, dry_run=False, topology=None, started_at=None):
        calls.append(resume)
        return 0

    monkeypatch.setattr(runner, "run_experiment", fake_run)
    out = tmp_path / "pods-seed0"
    config = compare.seed_config(prepare(tmp_path).variants["pods"], 0, str(out), str(tmp_path))
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config_decoding.as_json(config)))  # what its --dry-run left
    (out / "dry_run.json").write_text("{}")
    compare.run_one(config)
    assert calls == [False]


def test_an_out_that_holds_other_files_is_refused_and_an_earlier_comparison_is_not(tmp_path, capsys):
    out = tmp_path / "cmp"
    (out / "pods-seed0").mkdir(parents=True)
    (out / "n=16-seed0").mkdir()  # an ablation's run
    (out / "summary.json").write_text("{}")
    prepare(tmp_path)  # an earlier comparison's directory: it goes on there
    (out / "thesis.txt").write_text("four years of work")
    assert compare.main(["--out", str(out), "--methods", "grpo,pods", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds what no comparison wrote (thesis.txt)" in err, err
    assert sorted(os.listdir(out)) == ["n=16-seed0", "pods-seed0", "summary.json", "thesis.txt"]
    assert compare.main(["--out", str(out / "thesis.txt"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "thesis.txt exists and is not a directory" in err, err


def test_another_comparison_never_replaces_an_earlier_one_s_summary(tmp_path, capsys):
    out = tmp_path / "cmp"
    out.mkdir()
    summary = {"baseline": "grpo", "seeds": [0, 1, 2], "methods": [{"label": "grpo"}, {"label": "pods"}]}
    (out / "summary.json").write_text(json.dumps(summary))
    prepare(tmp_path, "--methods", "grpo,pods", "--seeds", "0,1,2")  # the same comparison goes on there
    for other in (["--ablation", "rule"], ["--seeds", "0"], ["--methods", "pods,grpo-ga"]):
        assert compare.main(["--out", str(out), *other, "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "holds the comparison of grpo, pods over seeds 0, 1, 2" in err, err
    assert sorted(os.listdir(out)) == ["summary.json"] and json.loads((out / "summary.json").read_text()) == summary


@pytest.mark.parametrize("methods, baseline", [("pods,grpo", "grpo"), ("pods,grpo-ga", "pods")])
def test_the_baseline_is_grpo_wherever_it_is_compared(tmp_path, methods, baseline):
    assert prepare(tmp_path, "--methods", methods, "--max-steps", "3").baseline == baseline


def test_a_method_that_never_reaches_the_target_reads_never_in_its_median():
    line = compare.format_step_speedups({"pods": {"speedups": [0.0], "steps_to_target": [math.inf], "median": 0.0}},
                                        "grpo")
    assert "pods: never (median never)" in line


@pytest.mark.parametrize("change", [["--n", "32"], ["--m", "8"], ["--lr", "0.001"]])
def test_a_stopped_run_of_another_setting_is_not_continued(tmp_path, change):
    out = tmp_path / "run"
    out.mkdir()
    _, started = flags_lib.parse("gsm8k", ["--out", str(out), "--max-steps", "2", "--n", "16", "--m", "4"])
    (out / "config.json").write_text(json.dumps(config_decoding.as_json(started)))
    _, same = flags_lib.parse("gsm8k", ["--out", str(out), "--max-steps", "4", "--n", "16", "--m", "4"])
    compare.check_resumable(same, str(out))  # a larger budget only: continued
    _, other = flags_lib.parse("gsm8k", ["--out", str(out), "--max-steps", "2", "--n", "16", "--m", "4", *change])
    with pytest.raises(UsageError, match="was started with --algorithm"):
        compare.check_resumable(other, str(out))


def test_a_complete_runs_evaluation_at_its_last_step_is_within_the_budget(tmp_path, capsys):
    _, config = flags_lib.parse("gsm8k", ["--out", str(tmp_path), "--max-steps", "10"])
    history = [{"step": 5, "accuracy": 0.5}, {"step": 10, "accuracy": 0.7}, {"step": 12, "accuracy": 0.9}]
    assert compare._within_budget(history, config, str(tmp_path)) == history[:2]
