"""The programs a run needs before its first step, compiled side by side by the fit check.

Before its first step a run compiles generation (rollout weights, sampling) and the
update for its largest shapes (the fit check, ``podsjax.devices.dry_run.plan``), generation for
the step-0 evaluation (evaluation chunks have other shapes than the rollouts),
and the batch builder. One after another these compiles add up; XLA compiles without
holding Python's lock, so on a :class:`podsjax.devices.compilation.CompilePool` of a few threads
the start waits for about the longest one. Each program still compiles once: a program
asked for by two threads compiles on the first and the other waits for it
(``podsjax.sampler.sampler_programs.Programs``), and the steps run what was compiled here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from podsjax.data import prompts as prompts_lib
from podsjax.devices import compilation, dry_run
from podsjax.devices import mesh as mesh_lib
from podsjax.rl import programs, reporting
from podsjax.rl.evaluator import Evaluator


def compile_threads(run_config, processes: int) -> int:
    """Threads the start compiles on: ``run_config.compile_threads``; one per process in a
    run over several hosts, whose compiles side by side are not measured yet."""
    return run_config.compile_threads if processes == 1 else 1


def plan_and_compile(trainer, threads: int) -> dry_run.MemoryPlan:
    """The fit check's memory plan, with the step-0 evaluation's programs and the batch builder
    compiled beside its compiles (``threads`` at a time); a failed compile raises here."""
    run_config, algo = trainer.run_config, trainer.algo
    prompt_len = programs.padded_prompt_length(run_config)
    params, lora = trainer.policy_params()
    jobs = [lambda: _first_evaluation(trainer, params, lora, prompt_len),
            lambda: _batch_builder(trainer, params, lora, prompt_len)]
    with compilation.CompilePool(threads) as pool:
        def submit(compile_update):  # the longest compile first in line, then the rest
            update = pool.submit(compile_update)
            if threads > 1:
                for job in jobs:
                    pool.submit(job)
            return update

        memory = dry_run.plan(
            trainer.model, algo, trainer.lora_config, base_params=params,
            prompts=programs.prompt_rows(run_config, algo), prompt_len=prompt_len,
            max_new_tokens=run_config.max_new_tokens, eos_token_ids=trainer.eos_ids,
            pad_token_id=prompts_lib.pad_token_id(trainer.tokenizer), update_fn=trainer.update_fn,
            optimizer=trainer.optimizer, state=trainer.state, frozen=trainer.frozen,
            compile_log=trainer.compile_log, generator=trainer.generator, submit=submit)
        if threads == 1:  # one at a time: after the fit check's, whose compile times it reports
            for job in jobs:
                pool.submit(job)
        pool.wait()
    return memory


def _first_evaluation(trainer, params, lora, prompt_len: int) -> None:
    """Generation's programs for the evaluation at the start, when one is due and it is the
    Trainer's own :class:`Evaluator` (its prompts pad to the fit check's length)."""
    if isinstance(trainer.evaluator, Evaluator) and trainer.eval_due():
        kind = dry_run.run_device(trainer.model.mesh).device_kind
        with dry_run.refused_by_compiler("evaluation's generation", kind):  # a TPU's refusal: one line
            trainer.evaluator.compile(params, lora, prompt_len)


def _batch_builder(trainer, params, lora, prompt_len: int) -> None:
    """The first step's batch builder, for the rollouts of generation's sampling program (which
    it waits for), placed as the step's arguments are."""
    run_config, algo, mesh = trainer.run_config, trainer.algo, trainer.model.mesh
    if not hasattr(trainer.batch_fn, "lower"):
        return
    rows = programs.prompt_rows(run_config, algo)
    ids = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32,
                               sharding=mesh_lib.rows_sharding(mesh, rows, 2) if mesh is not None else None)
    with trainer.compile_log.label("generate", reporting.generate_shape(ids, algo.n, run_config.max_new_tokens)):
        # The fit check's call: the programs it compiles (or compiled), never new ones.
        generated = trainer.generator.compile(
            params, lora, prompts=rows, prompt_len=prompt_len,
            **dry_run.rollout_options(algo, run_config.max_new_tokens, trainer.eos_ids,
                                      prompts_lib.pad_token_id(trainer.tokenizer)))
    rollouts = generated["sample"].out_info
    rewards = jax.ShapeDtypeStruct((rows, algo.n), jnp.float32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    with trainer.compile_log.label("select"):
        trainer.batch_fn.lower(ids, ids, rollouts.tokens, rollouts.mask, rewards, config=algo, key=key,
                               logprobs_BT=rollouts.logprobs).compile()
