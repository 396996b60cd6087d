"""A complete run: one that wrote all its exports and whose budget a resume does not raise; and
the line a stopped run prints to continue it.

``--resume`` of a complete run has nothing to do: it says so and how to train further, and
leaves the directory as it is. Imports no JAX.
"""

from __future__ import annotations

import json
import os
import shlex

from experiments import config_decoding
from experiments.config import ExperimentConfig
from experiments.usage import CONFIG_FILE

FINAL_MODEL, FINAL_ADAPTER, BEST_MODEL = "final_model", "final_adapter", "best_model"  # a run's exports
EXPORTS = (FINAL_MODEL, FINAL_ADAPTER, BEST_MODEL)
# Written after a run's last export: a stop in the middle of the exports leaves a run that
# --resume finishes, not one it calls complete.
EXPORTED_FILE = "exported.json"
# A run's budgets: (RunConfig field, its flag, the metrics.jsonl key that counts it down).
_BUDGETS = (("time_budget_s", "--time-budget", "time/elapsed_train_s"), ("max_steps", "--max-steps", "step"))


def is_complete(config: ExperimentConfig, out: str) -> bool:
    """Whether ``out`` holds a finished run (every export written) that ``config`` does not extend."""
    return os.path.isfile(os.path.join(out, EXPORTED_FILE)) and not extends(config, out)


def mark_exported(out: str, exports: list[str], run=None) -> None:
    """Records that the run in ``out`` wrote its last export (``exports``: the folders), and the
    budgets it ended under (``run``: its RunConfig, a resume's own where it changed them)."""
    path = os.path.join(out, EXPORTED_FILE)
    budgets = {field: getattr(run, field) for field, _, _ in _BUDGETS} if run is not None else {}
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"exports": exports, "budgets": budgets}, f)
    os.replace(path + ".tmp", path)


def _ended_under(out: str) -> dict:
    """The budgets the run's last export was made under (none recorded: an older run's)."""
    try:
        with open(os.path.join(out, EXPORTED_FILE), encoding="utf-8") as f:
            budgets = json.load(f).get("budgets")
    except (OSError, ValueError, AttributeError):
        return {}
    return budgets if isinstance(budgets, dict) else {}


def _last_step(out: str) -> dict:
    """The last training record of the run's metrics.jsonl (empty when there is none)."""
    from podsjax.run.metrics import read_jsonl  # imports no JAX

    path = os.path.join(out, "metrics.jsonl")
    rows = read_jsonl(path) if os.path.isfile(path) else []
    return next((r for r in reversed(rows) if "time/elapsed_train_s" in r), {})


def extends(config: ExperimentConfig, out: str) -> bool:
    """Whether ``config`` continues the complete run in ``out``: a longer --time-budget or
    --max-steps than the run was started with, and neither of ``config``'s budgets reached by
    its last training step (a run ended by its steps trains no step on a larger time budget)."""
    last = _last_step(out)
    if _spent(config.run, last):
        return False
    started, ended = config_decoding.read_run_config(out).run, _ended_under(out)
    for field, _, _ in _BUDGETS:
        # a resume that lowered a budget ended the run under it: the started one is not spent
        before = ended.get(field, getattr(started, field))
        if isinstance(before, bool) or not isinstance(before, (int, float, type(None))):
            before = getattr(started, field)  # a damaged record: the started budget, as before
        wanted = getattr(config.run, field)
        if wanted is not None and before is not None and wanted > before:
            return True
    return False


def _spent(run, last: dict) -> list[str]:
    """The budget fields of ``run`` that the last training record ``last`` has reached."""
    return [field for field, _, key in _BUDGETS
            if getattr(run, field) is not None and last.get(key, 0) >= getattr(run, field)]


def _past(budget, done):
    """Twice ``budget``, doubled again until it is past ``done`` (a resume that raised the budget
    trained past it), so the suggested command always trains further."""
    more = 2 * budget
    while more <= done:
        more *= 2
    return more


def complete_line(config: ExperimentConfig, out: str) -> str:
    """What ``--resume`` of a complete run prints: where it ended, and the command that trains it further."""
    last, run = _last_step(out), config.run
    done = f"{out} holds a complete run ({last.get('step', '?')} steps, "
    done += f"{last.get('time/elapsed_train_s', 0.0):.0f} s of training clock)" if last else "no steps logged)"
    spent = _spent(run, last)
    if not spent:  # nothing logged: the budget that ends a run first
        spent = ["max_steps" if run.max_steps is not None and run.time_budget_s is None else "time_budget_s"]
    kept = _raised_budgets(config, out)  # a budget this resume raised, which the command must say again
    budgets, raised = [], []
    for field, flag, key in _BUDGETS:
        budget, trained = getattr(run, field), last.get(key, 0)
        if field not in spent:
            if field in kept:
                raised.append(f"{flag} {budget:g}")
            continue
        if field == "max_steps":
            budgets.append(f"its --max-steps {budget}" + (f" (a resume trained it on to step {trained})"
                                                          if trained > budget else ""))
        else:  # every run ends a little past its time budget: no clause
            budgets.append(f"its --time-budget {budget:g}")
        raised.append(f"{flag} {_past(budget, trained):g}")
    command = f"python -m experiments.{run.task} --out {shlex.quote(out)} --resume {' '.join(raised)}"
    return (f"{done}: {' and '.join(budgets)} {'is' if len(budgets) == 1 else 'are'} spent, so there is nothing "
            f"to resume and nothing was changed; to train it further, resume with a larger --time-budget or "
            f"--max-steps, e.g. {command}")


def _raised_budgets(config, out: str) -> list[str]:
    """The budget fields ``config`` raises over those the run in ``out`` was started with (a
    resume that trains it further), which a resume must say again; none without its stored config."""
    try:
        started = config_decoding.read_run_config(out).run
    except Exception:  # noqa: BLE001 - the lines these feed are advice; without the stored config they name no flags
        return []
    return [field for field, _, _ in _BUDGETS
            if getattr(config.run, field) is not None
            and (getattr(started, field) is None or getattr(config.run, field) > getattr(started, field))]


def _extension_flags(config, out: str) -> str:
    """`` --time-budget X`` / `` --max-steps N`` for each budget ``config`` raises (:func:`_raised_budgets`)."""
    raised = _raised_budgets(config, out)
    return "".join(f" {flag} {getattr(config.run, field):g}" for field, flag, _ in _BUDGETS if field in raised)


def interrupted_line(exc: KeyboardInterrupt, task: str, out: str | None, config=None) -> str:
    """What a stopped run prints: where it stopped (``run_state.StopRequested`` says) and how to go on
    (with the budget flags of a resume that raised the run's budget)."""
    if type(exc).__name__ == "StopRequested":
        what = str(exc)
    else:
        what = f"interrupted by {exc.args[0]}" if exc.args and isinstance(exc.args[0], str) else "interrupted"
    if out is None or not os.path.isfile(os.path.join(out, CONFIG_FILE)):
        return f"{what}; no run was written yet"
    from experiments.run_dir import put_back_into

    if put_back_into(out):  # --resume would extend the old run, not replace it
        return f"{what}; {out} holds the run --overwrite was to replace: run the same command again to replace it"
    extension = "" if config is None else _extension_flags(config, out)
    return f"{what}; to continue: python -m experiments.{task} --out {shlex.quote(out)} --resume{extension}"
