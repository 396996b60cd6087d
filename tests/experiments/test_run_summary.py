"""The summary a run prints at its end."""

import io

from experiments import flags, runner


def _summary(history):
    _, config = flags.parse("gsm8k", [])
    out = io.StringIO()
    runner.print_summary(config, history, 9, 240.0, 250.0, "runs/x/final_model", file=out)
    return {line[:22].strip(): line[22:].strip() for line in out.getvalue().splitlines()}


def test_a_run_with_one_evaluation_says_so():
    rows = _summary([{"step": 0, "eval/accuracy": 0.324, "time/elapsed_train_s": 0.0}])
    assert rows["accuracy first / last"] == "32.4% (one evaluation, at step 0)"


def test_a_run_with_several_evaluations_gives_the_first_and_the_last():
    rows = _summary([{"step": 0, "eval/accuracy": 0.324, "time/elapsed_train_s": 0.0},
                     {"step": 9, "eval/accuracy": 0.426, "time/elapsed_train_s": 240.0}])
    assert rows["accuracy first / last"] == "32.4% / 42.6%" and rows["peak accuracy"] == "42.6% at 240 s"
    assert _summary([])["accuracy first / last"] == "- (no evaluation)"
