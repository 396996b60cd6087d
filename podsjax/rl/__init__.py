"""The RL loop: prompts -> generate -> score -> select -> update, with eval, checkpoints, metrics.

Its parts: :class:`RunConfig` (``config``); the jitted programs of a step besides generation
(``programs``, shared with ``--dry-run``); the prompts (``prompt_source``); the
:class:`Evaluator`; the run's logs (``run_files``); the weights and the update
(``weights``); one RL step (``rl_step``), whose data are typed (``step_data``); the loop's
cadence and stop (``run_loop``) and its hooks (``hooks``: metrics, divergence, evaluation
history, progress, the best model, checkpoints); and the :class:`Trainer`, which wires them
and resumes. Generator, scorer, evaluator and extra hooks are arguments of the Trainer, so a
test or a user swaps or adds any of them.

The training clock counts generation, scoring, selection and update time only;
evaluation and checkpoint writes are excluded, as in the paper's wall-clock plots.

Resume is exact: a run killed at any point and resumed from its newest checkpoint
trains the same steps with the same data, RNG keys and optimizer state as a run that
was never stopped. The logs (metrics, samples, eval history) are cut back to their
sizes at that checkpoint, so the steps redone after the restore are logged once; the
cut records are kept in ``<log>.superseded``.

SIGTERM (a preemption's first word) and SIGINT stop a run at its last whole step:
generation, scoring and evaluation in flight are dropped, an update in flight finishes,
and that step is checkpointed before :class:`~podsjax.run.run_state.StopRequested` is raised
(see :class:`~podsjax.run.run_state.StopSignals`).
"""


from podsjax.rl.evaluator import Evaluator, eval_scalars
from podsjax.rl.hooks import Hook
from podsjax.rl.run_config import EVAL_METRICS, RunConfig
from podsjax.rl.programs import (abstract_batch, abstract_state, batch_program, batch_shardings, padded_prompt_length, prompt_rows, update_program)
from podsjax.rl.prompt_source import DataStream, PromptSource
from podsjax.rl.step_data import Draw, Scored, StepResult
from podsjax.rl.trainer import Trainer, TrainingDiverged
from podsjax.run.run_files import HISTORY_FILE, LogDamaged, history_path, read_history

__all__ = [
    "DataStream", "Draw", "EVAL_METRICS", "Evaluator", "HISTORY_FILE", "Hook", "LogDamaged", "PromptSource", "RunConfig",
    "Scored", "StepResult", "Trainer", "TrainingDiverged", "abstract_batch", "abstract_state", "batch_program",
    "batch_shardings", "eval_scalars", "history_path", "padded_prompt_length", "prompt_rows", "read_history", "update_program",
]
