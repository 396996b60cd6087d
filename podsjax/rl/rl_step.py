"""One RL step: draw and generate, score, refill (dynamic sampling), select, update, its metrics."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from podsjax.devices import dry_run, hosts, topology
from podsjax.rl import dynamic_sampling, perf, programs, reporting, scoring
from podsjax.rl.step_data import Draw, Scored, StepResult
from podsjax.run import metrics as metrics_lib


class RLStep:
    """Takes RL steps on a run's :class:`~podsjax.rl.weights.Weights`.

    Args:
        parts: the run's parts, read as attributes: ``model``, ``algo``, ``run_config``,
            ``tokenizer``, ``generator``, ``prompts``, ``scorer``, ``rewards``, ``eos_ids``,
            ``batch_fn``, ``compile_log``, ``weights``, ``host``, ``signals`` and ``buckets``
            (the :class:`~podsjax.rl.Trainer`).
        histograms: whether a step fetches its per-row rewards and advantages for histograms.
    """

    def __init__(self, parts, histograms: bool):
        self.parts, self.histograms = parts, histograms
        self.update_rows = programs.prompt_rows(parts.run_config, parts.algo) * parts.algo.m
        self._compiled_once = False

    def __call__(self) -> StepResult:
        """One PODS step: draw prompts, generate, score, select, update.

        With ``algo.dynamic_sampling`` the draw, generation and scoring repeat (up to
        ``max_sampling_rounds``) until the step has its groups with reward variance.
        """
        run, algo, weights, host = self.parts.run_config, self.parts.algo, self.parts.weights, self.parts.host
        timer = metrics_lib.PhaseTimer(compile_seconds=self.parts.compile_log.thread_seconds)
        # Until the update, the state and the host state are as the last step left them: a stop drops this work.
        with self.parts.signals.droppable():
            key = jax.random.fold_in(jax.random.key(run.seed + programs.ROLLOUT_SEED_OFFSET), weights.step)
            draws, scores, zero = [], [], np.zeros(0, bool)
            for round_index in range(algo.max_sampling_rounds if algo.dynamic_sampling else 1):
                with timer.phase("generation"):
                    if round_index == 0:
                        params, lora = weights.policy_params()
                    round_key = key if round_index == 0 else jax.random.fold_in(
                        jax.random.fold_in(key, programs.SAMPLING_ROUND_STREAM), round_index)
                    draws.append(self.draw_and_generate(params, lora, round_key, first_round=round_index == 0))
                    # JAX dispatches generation and returns at once; without the wait its time
                    # lands in scoring, which reads the tokens first.
                    jax.block_until_ready(draws[-1].rollouts)
                with timer.phase("scoring"):
                    scores.append(self.score(draws[-1]))
                if algo.dynamic_sampling:
                    zero = np.concatenate([zero, dynamic_sampling.zero_variance(scores[-1].total.reshape(-1, algo.n))])
                    if (~zero).sum() >= len(draws[0].examples):
                        break
            with timer.phase("selection"):
                drawn, scored, sampling_stats = draws[0], scores[0], {}
                if algo.dynamic_sampling:
                    drawn, scored, sampling_stats = self.merge_draws(draws, scores, zero)
                rollouts, p = drawn.rollouts, len(drawn.examples)
                rewards_PN = scored.total.reshape(p, algo.n)
                with self.parts.compile_log.label("select"):
                    # The rollouts stay on device: only the rewards come from the host.
                    batch, idx_PM = self.parts.batch_fn(
                        drawn.ids, drawn.prompt_mask, rollouts.tokens, rollouts.mask, rewards_PN, config=algo,
                        key=jax.random.fold_in(key, programs.SELECTION_STREAM), logprobs_BT=rollouts.logprobs)
        with timer.phase("update"):
            step_metrics, idx_PM = weights.update(batch, timer, fetch_with=idx_PM)
        phases = timer.totals()  # without the step's compiles, which are timer.compile_s
        if self._compiled_once:
            host.elapsed_train_s += hosts.agree(sum(phases.values()) + timer.compile_s)
        # The first step of a process compiles generation and the update; JAX's
        # one-time compile is left off the clock (later steps reuse the programs).
        self._compiled_once = True
        host.data_position = self.parts.prompts.stream.position
        histograms = ({"reward/total": scored.total, "train/advantages": hosts.fetch(batch.advantages)}
                      if self.histograms else {})
        selected = np.zeros((p, algo.n), bool)
        np.put_along_axis(selected, idx_PM, True, axis=1)
        generated = sum(int(s.length.sum()) for s in scores)
        scalars = {
            **self._perf(phases, draws, drawn, scored, selected, generated),
            **{f"train/{k}": float(v) for k, v in dataclasses.asdict(step_metrics).items() if v is not None},
            **scoring.reward_stats(scored, rewards_PN, selected),
            **sampling_stats,
            "data/prompts_skipped": float(drawn.skipped),
            **scoring.length_stats(scored),
            **{f"time/{k}": v for k, v in phases.items()},
            "time/compile": timer.compile_s,
            "time/tokens_per_s": metrics_lib.tokens_per_second(generated, phases["generation"]),
            "time/elapsed_train_s": host.elapsed_train_s,
        }
        return StepResult(weights.step, scalars, histograms)

    def draw_and_generate(self, params, lora, key, first_round: bool = True) -> Draw:
        """One draw of prompts, generated (``first_round``: the step's first, whose update
        compiles behind its generation)."""
        run, algo, parts = self.parts.run_config, self.parts.algo, self.parts
        examples, prompts, skipped = parts.prompts.draw(run.prompts_per_step, algo.groups_per_prompt)
        prompts = parts.buckets.fit(prompts)
        if first_round:
            parts.weights.compile_update_behind(self.update_rows, prompts.ids_PL.shape[1], run.max_new_tokens)
        ids, prompt_mask = (parts.generator.place_rows(x) for x in (prompts.ids_PL, prompts.mask_PL))
        shape = reporting.generate_shape(prompts.ids_PL, algo.n, run.max_new_tokens)
        with parts.compile_log.label("generate", shape):
            rollouts = parts.generator.generate(
                params, ids, prompt_mask, key, temperature=algo.temperature, lora=lora,
                **dry_run.rollout_options(algo, run.max_new_tokens, parts.eos_ids, prompts.pad_id))
        return Draw(examples, prompts, skipped, ids, prompt_mask, rollouts)

    def score(self, drawn: Draw) -> Scored:
        """Every host's rollouts of ``drawn`` scored (each host scores its own rows)."""
        rollouts = drawn.rollouts
        start, tokens = hosts.local_rows(rollouts.tokens)
        mask, truncated = (hosts.local_rows(x)[1] for x in (rollouts.mask, rollouts.truncated))
        return scoring.score_rollouts(self.parts.tokenizer, self.parts.scorer, self.parts.rewards, drawn.examples,
                                      self.parts.algo.n, start, tokens, mask, truncated)

    def merge_draws(self, draws: list[Draw], scores: list[Scored],
                    zero: np.ndarray) -> tuple[Draw, Scored, dict[str, float]]:
        """Dynamic sampling: the step's groups from several draws (``zero``: each drawn group's
        rewards all agree, in draw order), and what it did (``data/*`` scalars)."""
        n, wanted = self.parts.algo.n, len(draws[0].examples)
        groups, filled = dynamic_sampling.choose_groups(zero, wanted)
        stats = {"data/sampling_rounds": float(len(draws)), "data/zero_std_groups_drawn": float(zero.mean()),
                 "data/groups_filled": float(filled)}
        if len(draws) == 1:
            return draws[0], scores[0], stats
        examples = [e for d in draws for e in d.examples]
        examples = [examples[g] for g in groups]
        prompts = self.parts.prompts.prepare(examples)  # every one fit before: one padded batch of them all
        rows = dynamic_sampling.group_rows(groups, n)
        with self.parts.compile_log.label("dynamic sampling"):
            rollouts = draws[0].rollouts.replace(**{
                name: dynamic_sampling.take_rows([getattr(d.rollouts, name) for d in draws], rows)
                for name in ("tokens", "mask", "truncated", "logprobs", "lengths")})
        ids, prompt_mask = (self.parts.generator.place_rows(x) for x in (prompts.ids_PL, prompts.mask_PL))
        merged = Draw(examples, prompts, sum(d.skipped for d in draws), ids, prompt_mask, rollouts)
        return merged, dynamic_sampling.take_scored(scores, rows), stats

    def _perf(self, phases, draws: list[Draw], drawn: Draw, scored: Scored, selected_PN,
              generated: int) -> dict[str, float]:
        """``perf/*``: the step's time, tokens per second per device and MFU (``podsjax.rl.perf``)."""
        algo, model = self.parts.algo, self.parts.model
        prompt_tokens = sum(int(d.prompts.lengths_P.sum()) for d in draws)
        trained = int(drawn.prompts.lengths_P.sum()) * algo.m + int(
            scored.length.reshape(selected_PN.shape)[selected_PN].sum())
        extra = int(algo.beta > 0) + int(algo.old_logprobs == "recompute" and algo.updates_per_step > 1)
        flops = perf.step_flops(model.config.num_params, prompt_tokens=prompt_tokens, completion_tokens=generated,
                                trained_tokens=trained, passes=algo.num_iterations, extra_forwards=extra)
        chip = topology.chip(jax.devices()[0].device_kind)
        devices = 1 if model.mesh is None else model.mesh.size
        return perf.perf_scalars(seconds=sum(phases.values()), tokens=prompt_tokens * algo.n + generated, flops=flops,
                                 devices=devices, peak_flops=chip.peak_flops if chip else None)
