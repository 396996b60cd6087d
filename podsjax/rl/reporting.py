"""The console lines of a run: progress, evaluations, step phases and compile labels."""

from __future__ import annotations

import numpy as np

from podsjax.rl.run_config import RunConfig
from podsjax.run.run_state import HostState


def phases_text(scalars: dict[str, float]) -> str:
    """``step 1.23 s (generation 0.80, scoring 0.10, selection 0.01, update 0.32)``, and
    ``; compiles 12.25`` when the step compiled (a first step): its compiles are no phase's."""
    phases = [(name, scalars.get(f"time/{name}")) for name in ("generation", "scoring", "selection", "update")]
    compiles = scalars.get("time/compile") or 0.0
    total = sum(v for _, v in phases if v is not None) + compiles
    text = ", ".join(f"{n} {v:.2f}" for n, v in phases if v is not None)
    return f"step {total:.2f} s ({text}" + (f"; compiles {compiles:.2f})" if compiles >= 0.005 else ")")


def progress_line(step: int, scalars: dict[str, float], accuracy: float, host: HostState, run_config: RunConfig) -> str:
    """One line of how the run goes, for a console without a progress bar."""
    of = f"/{run_config.max_steps}" if run_config.max_steps is not None else ""
    budget = f"/{run_config.time_budget_s:.0f}" if run_config.time_budget_s is not None else ""
    acc = "-" if accuracy != accuracy else f"{accuracy:.1%}"
    return (f"step {step}{of} | train clock {host.elapsed_train_s:.0f}{budget} s | "
            f"reward {scalars['reward/mean']:.3f} | eval acc {acc} | {phases_text(scalars)}")


def eval_line(evaluation: dict[str, float], run_config: RunConfig) -> str:
    """``eval at step 3: accuracy 41.2% (mean of 5 passes at temperature 0.9, std 1.1%) on 1319 examples``,
    then ``; pass@k ..., maj@k ...`` for each k of ``eval_k``."""
    what = "accuracy" if run_config.eval_metric == "accuracy" else "answer and format correct"
    line = f"eval at step {evaluation['step']}: {what} {evaluation['eval/accuracy']:.1%}"
    if run_config.eval_repeats > 1:
        line += (f" (mean of {run_config.eval_repeats} passes at temperature {run_config.eval_temperature:g}, "
                 f"std {evaluation['eval/accuracy_std']:.1%})")
    line = f"{line} on {int(evaluation['eval/examples'])} examples"
    for k in run_config.eval_k:  # logged as eval/pass_at_<k> and eval/maj_at_<k>
        line += f"; pass@{k} {evaluation[f'eval/pass_at_{k}']:.1%}, maj@{k} {evaluation[f'eval/maj_at_{k}']:.1%}"
    return line


def generate_shape(ids_PL, samples: int, new_tokens: int) -> str:
    """``"8 prompts x 16 samples, 128 + 48 tokens"``: what a generate compile is for."""
    prompts, length = np.shape(ids_PL)
    return f"{prompts} prompts x {samples} samples, {length} + {new_tokens} tokens"
