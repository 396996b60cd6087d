"""The chemistry task of setting (d): loader, prompt, the 5 % reward, and the CLI, on real SciBench rows."""

import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podsjax.data import datasets as data
from podsjax.rewards import RewardPool, chemistry_accuracy, default_rewards, parse_quantity, score_rewards
from podsjax.rewards.chemistry_grader import unit_scale
from child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "data", "chemistry", "rows.jsonl")


@pytest.fixture(scope="module")
def task():
    return data.load_task("chemistry", "test", FIXTURE)


def rows():
    with open(FIXTURE) as f:
        return [json.loads(line) for line in f]


def tagged(text):
    return f"<think>work</think><answer>{text}</answer>"


# ------------------------------------------------------------------------- loader


def test_fixture_rows_load_with_a_prompt_asking_for_the_reference_unit(task):
    assert len(task) == 10 and task.name == "chemistry"
    by_id = {e.columns["id"]: e for e in task}
    kelvin = by_id["matter-51.4(a)"]
    assert kelvin.answer == "524" and kelvin.columns["unit"] == "$ \\mathrm{~K}$"
    assert kelvin.prompt.startswith(kelvin.columns["problem"])
    assert kelvin.prompt.endswith("in units of $ \\mathrm{~K}$: write only the number, without the unit.")
    assert "$10^{-19} \\mathrm{~J}$" in by_id["chemmc-1-18"].prompt  # the power of ten is part of the unit
    assert by_id["atkins-e1.22(a)"].prompt.endswith("as a plain number, without units.")  # no unit
    assert by_id["atkins-p2.9(a)"].answer == "+17.7"


def test_no_hub_default_and_scibench_column_names(tmp_path):
    with pytest.raises(data.DataError, match="chemistry has no Hub dataset here; pass a local") as err:
        data.load_task("chemistry", "train")
    assert "\n" not in str(err.value)
    path = tmp_path / "scibench.jsonl"
    path.write_text(json.dumps({"problem_text": "How hot?", "answer_number": "5.5", "unit": "$10^3 K$"}) + "\n")
    (example,) = data.load_task("chemistry", "train", str(path))
    assert example.answer == "5.5" and example.columns["unit"] == "$10^3 K$"


def test_a_row_without_a_unit_keeps_the_unit_column_for_every_row(tmp_path):
    # A row without one gets "": had it no column, the column would be shared by no step
    # that held it, and the grader would read no row's unit (3.52 x 10^-19 J not 3.52).
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"problem": "How much?", "answer": "3.52", "unit": "$10^{-19}$ J"}) + "\n"
                    + json.dumps({"problem": "How many?", "answer": "2"}) + "\n")
    examples = data.load_task("chemistry", "train", str(path))
    assert data.reward_columns(examples)["unit"] == ["$10^{-19}$ J", ""]


@pytest.mark.parametrize("row,reason", [
    ({"problem": "q", "answer": "about five"}, "not a number"),
    ({"problem": "q", "answer": ""}, "missing or empty"),
    ({"problem": "q", "answer": "1", "unit": 3}, "'unit' is int"),
    ({"answer": "1"}, "missing field 'problem'"),
])
def test_bad_rows_name_the_file_and_line(tmp_path, row, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "ok", "answer": "1"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(data.DataError, match=f"bad.jsonl:2: .*{reason}"):
        data.load_task("chemistry", "train", str(path))


# ------------------------------------------------------------------------- reward


@pytest.mark.parametrize("text,value", [
    ("524", 524.0), ("-50", -50.0), ("+17.7", 17.7), ("11,000", 11000.0), ("1\\,000", 1000.0),
    ("3.2e-4", 3.2e-4), ("3.2 x 10^-4", 3.2e-4), ("3.2 \\times 10^{-4}", 3.2e-4), ("$4.20 \\times 10^{-2}$", 0.042),
    ("1.5×10⁻³", 1.5e-3), ("6.02 * 10**23", 6.02e23), ("10^{-4}", 1e-4), ("-1/2", -0.5), ("3 / 2", 1.5),
    ("524 K", 524.0), ("524 \\mathrm{~K}", 524.0), ("-50 kJ/mol", -50.0), ("-273 ^{\\circ} C", -273.0),
    ("\\text{5.5 kJ}", 5.5), ("\\Delta G = -50 kJ/mol", -50.0), ("T \\approx 524 K", 524.0),
    ("approximately 0.123 nm", 0.123), ("\\frac{1}{2}", 0.5), ("-\\frac{1}{2}", -0.5), ("3\\frac{1}{3}", 10 / 3),
    ("\\sqrt{2}", math.sqrt(2)), ("2^{10}", 1024.0), ("−3.8", -3.8),
])
def test_parse_quantity(text, value):
    assert parse_quantity(text) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("text", ["", "x", "the answer", "1e400", "3/0", "\\frac{1}{0}"])
def test_parse_quantity_without_a_finite_number(text):
    assert parse_quantity(text) is None


def test_unit_scale():
    assert unit_scale("$10^{-19} \\mathrm{~J}$") == 1e-19 and unit_scale("$10^3$") == 1e3
    assert unit_scale("$ \\mathrm{~K}$") == unit_scale("") == unit_scale(None) == 1.0


def test_every_fixture_row_scores_its_own_answer_and_rejects_6_percent_off():
    table = rows()
    golds, units = [r["answer"] for r in table], [r["unit"] for r in table]
    assert chemistry_accuracy([tagged(g) for g in golds], golds, units) == [1.0] * len(table)
    # As the source wrote it (LaTeX, \times 10^{-2}, \frac{1}{2}), followed by the unit.
    latex = [tagged(f"{r['answer_latex']} {r['unit']}") for r in table]
    assert chemistry_accuracy(latex, golds, units) == [1.0] * len(table)
    near = [tagged(repr(float(g) * 1.04)) for g in golds]
    assert chemistry_accuracy(near, golds, units) == [1.0] * len(table)
    # 6 % off fails; a reference of 0 needs exactly 0 (SciBench's math.isclose with rel_tol only).
    far = [tagged(repr(float(g) * 1.06) if float(g) else "0.01") for g in golds]
    assert chemistry_accuracy(far, golds, units) == [0.0] * len(table)


def test_every_row_of_the_dataset_scores_its_reference_with_the_unit_after_it(chemistry_dir):
    examples = [e for split in ("train", "test")
                for e in data.load_task("chemistry", split, chemistry_dir)]
    assert len(examples) == 223
    columns = data.reward_columns(examples)
    completions = [tagged(f"{e.answer} {e.columns['unit']}") for e in examples]
    assert chemistry_accuracy(completions, **columns) == [1.0] * len(examples)


def test_tolerance_is_relative_to_the_larger_magnitude_as_in_scibench():
    assert chemistry_accuracy([tagged("105.2")], ["100"]) == [1.0]  # |5.2| <= 0.05 * 105.2
    assert chemistry_accuracy([tagged("94.9")], ["100"]) == [0.0]


def test_power_of_ten_written_out_or_in_the_unit():
    unit = ["$10^{-19} \\mathrm{~J}$"]
    for answer in ("3.52", "3.52 \\times 10^{-19} J", "3.5e-19"):
        assert chemistry_accuracy([tagged(answer)], ["3.52"], unit) == [1.0], answer
    assert chemistry_accuracy([tagged("3.52e-18")], ["3.52"], unit) == [0.0]


def test_where_the_answer_is_read_from():
    gold = ["524"]
    assert chemistry_accuracy(["so T = \\boxed{524} K"], gold) == [1.0]  # no tag: the last box
    assert chemistry_accuracy(["<answer>\\boxed{524}</answer>"], gold) == [1.0]
    assert chemistry_accuracy(["<answer>T is 400</answer> 524"], gold) == [0.0]  # the tag wins
    assert chemistry_accuracy(["the temperature is 524 K"], gold) == [0.0]  # no tag, no box: no answer
    with pytest.raises(ValueError, match="gold answer is not a number"):
        chemistry_accuracy([tagged("1")], ["n/a"])
    with pytest.raises(ValueError, match="chemistry_accuracy: column 'answer' has 1 entries for 2 completions"):
        chemistry_accuracy(["a", "b"], ["1"])


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789.-+eE^{}x/\\ $,Kfrac()=timesqrt")), max_size=60))
def test_parse_quantity_never_raises(text):
    value = parse_quantity(text)
    assert value is None or math.isfinite(value)


@settings(max_examples=200, deadline=None)
@given(mantissa=st.floats(1.0, 9.99), exponent=st.integers(-30, 30), negative=st.booleans())
def test_scientific_notation_round_trips(mantissa, exponent, negative):
    sign = "-" if negative else ""
    value = float(f"{sign}{mantissa:.3f}e{exponent}")
    for text in (f"{sign}{mantissa:.3f}e{exponent}", f"{sign}{mantissa:.3f} \\times 10^{{{exponent}}}",
                 f"${sign}{mantissa:.3f} \\cdot 10^{{{exponent}}}$ J"):
        assert parse_quantity(text) == pytest.approx(value, rel=1e-12), text


def test_default_rewards_for_chemistry_through_the_task_columns(task):
    examples = list(task)
    completions = [tagged(e.answer) for e in examples for _ in range(2)]
    rewards = default_rewards("chemistry", format=0.01, tag_count=0.01, format_style="score")
    scores = score_rewards(completions, rewards, **data.reward_columns(examples, 2))
    assert scores.per_function["accuracy"].tolist() == [1.0] * len(completions)
    # format_score 1 (nothing outside the tags) and four tags: 1 + 0.01 + 0.01.
    assert scores.total_B.tolist() == pytest.approx([1.02] * len(completions))


def test_reward_runs_in_the_worker_pool(task):
    examples = list(task)[:3]
    completions = [tagged(e.answer) for e in examples] + [tagged("-1")]
    columns = data.reward_columns(examples + examples[:1])
    with RewardPool(max_workers=1, timeout_s=10) as pool:
        scores = pool.score(completions, default_rewards("chemistry"), **columns)
    assert scores.per_function["accuracy"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert scores.metrics["reward/errors"] == 0


# ---------------------------------------------------------------------------- CLI


def test_setting_d_resolves_for_the_chemistry_command(tmp_path):
    from experiments import cli, flags

    _, config = flags.parse("chemistry", ["--setting", "d", "--model", str(tmp_path), "--out", str(tmp_path / "o")])
    assert config.task == "chemistry" and config.model.hub_name == "Qwen/Qwen2.5-3B-Instruct"
    assert config.algorithm.aggregation == "seq-mean-token-mean" and config.run.eval_repeats == 5
    assert cli.main("chemistry", ["--setting", "a", "--model", str(tmp_path), "--out", str(tmp_path / "never")]) == 2


@pytest.mark.slow
def test_chemistry_command_trains_and_evaluates_on_the_fixture(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny_checkpoint import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run"
    env = child_env()
    env["PODSJAX_CACHE_DIR"] = str(tmp_path / "cache")
    # The tiny tokenizer spells problems out character by character: up to 876 prompt tokens.
    done = subprocess.run(
        [sys.executable, "-m", "experiments.chemistry", "--model", checkpoint, "--data", FIXTURE,
         "--eval-data", FIXTURE, "--eval-limit", "2", "--n", "4", "--m", "2", "--max-completion-length", "6",
         "--max-prompt-length", "1024", "--lora-rank", "2", "--max-steps", "2", "--no-progress",
         "--reward-workers", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.load(open(out / "config.json"))["run"]["task"] == "chemistry"
    assert "peak accuracy" in done.stdout and (out / "final_model" / "config.json").is_file()


def test_a_tower_of_powers_is_no_number_and_does_not_hang():
    # sympy's evalf of 10^{10^{10^{10}}} ran on past math-verify's timeout, which covers its parse only.
    import threading

    found = {}

    def parse_all():
        found["values"] = [parse_quantity(t, timeout_s=3) for t in ("10^{10^{10^{10}}}", "9^{9^{9^{9}}}", "2^{10}")]

    worker = threading.Thread(target=parse_all, daemon=True)
    worker.start()
    worker.join(20)
    assert found.get("values") == [None, None, 1024.0], "still evaluating after 20 s"
