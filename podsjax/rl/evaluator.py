"""Evaluation: every eval example decoded once per pass and scored by the run's metric."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import numpy as np

from podsjax import rewards as rewards_lib
from podsjax.data import datasets as data_lib
from podsjax.data import prompts as prompts_lib
from podsjax.devices import compilation
from podsjax.devices import hosts
from podsjax.devices import mesh as mesh_lib
from podsjax.rl import pass_at_k as pass_at_k_lib
from podsjax.rl import reporting
from podsjax.rl.buckets import BucketReuse
from podsjax.rl.programs import EVAL_STREAM
from podsjax.rl.prompt_source import PromptSource
from podsjax.rl.run_config import EVAL_METRICS, RunConfig

# The breakdown entries evaluation keeps: whatever some EVAL_METRICS entry multiplies.
EVAL_PARTS = tuple(dict.fromkeys(name for names in EVAL_METRICS.values() for name in names))
# Beside them with eval_k: each completion's answer id (podsjax.rl.pass_at_k.answer_ids), for maj@k.
ANSWERS = "answer_id"
# Evaluation's rows come in multiples of this: XLA pads a bf16 GEMM's rows to it for a GPU's
# tensor cores, a pad kernel around each GEMM (60 rows of Qwen2.5-1.5B: 440 kernels a decode
# step for an H100, 80 rows: 300).
ROW_ALIGN = 8


class Evaluator:
    """The eval split's ``eval_metric``, averaged over ``eval_repeats`` passes at ``eval_temperature``
    and ``eval_top_k``.

    Each pass decodes every example once. An example's passes are samples of its prompt in one
    call, so the prompt is prefilled once and its KV cache read once a step for all of them.
    Every evaluation draws the same keys (one per chunk of examples, from the run's seed):
    common random numbers, so two evaluations, or two methods run with one seed, differ by
    their policies rather than their draws.

    Args:
        generator: the :class:`podsjax.sampler.sampling.Generator` the rollouts use.
        prompts: templates and tokenizes the questions as training does.
        scorer: scores completions (``score(completions, rewards, **columns)``).
        examples: the eval split.
        run_config: the run's config (its eval_* fields, seed and max_new_tokens).
        rows: rows per evaluation chunk when ``eval_batch_size`` is unset (a step's rollout
            rows): enough prompts for that many rows with their passes, rounded up to a
            multiple of :data:`ROW_ALIGN` rows that splits over the mesh's batch shards.
            Temperature is an input of the compiled program; evaluation's prompts x passes
            compile one program of their own.
        rewards: the run's reward specs; the strict format check is added at weight 0.
        eos_ids: the tokenizer's end-of-sequence ids.
        compile_log: reports generate's compiles.
        log: prints one console line (the first evaluation that leaves prompts out says so).
        answer_key: a completion's final answer as text, for maj@k (default: the task's entry
            of :data:`podsjax.rl.pass_at_k.ANSWER_KEYS`; read only when ``eval_k`` is set).
    """

    def __init__(self, generator, prompts: PromptSource, scorer, examples: Sequence[data_lib.Example],
                 run_config: RunConfig, *, rows: int, rewards, eos_ids,
                 compile_log: compilation.CompileLog | None = None,
                 answer_key: Callable[[str], str | None] | None = None, buckets: BucketReuse | None = None,
                 log: Callable[[str], None] | None = None):
        self.generator, self.prompts, self.scorer = generator, prompts, scorer
        self._log, self._skips_said = log or (lambda line: None), False
        self.buckets = buckets  # the run's compiled prompt lengths, which evaluation pads to
        self.examples = list(examples[: run_config.eval_limit] if run_config.eval_limit else examples)
        self.run_config, self.eos_ids = run_config, eos_ids
        self.rewards = with_strict_format(rewards_lib.as_weighted(rewards))
        shards = mesh_lib.shard_count(generator.model.mesh, "batch")
        size, repeats = run_config.eval_batch_size or rows, run_config.eval_repeats
        # A chunk decodes each of its prompts' passes as samples of that prompt, so their prefill
        # and prompt KV are shared: at least ``size`` rows, a multiple of ROW_ALIGN that splits
        # evenly over the batch shards. Every chunk has the same rows (a short last one or
        # dropped prompts would be a new shape, so a new compile).
        align = math.lcm(shards, ROW_ALIGN)
        step = align // math.gcd(align, repeats)
        prompts_needed = -(-size // repeats)
        self.prompts_per_chunk = -(-prompts_needed // step) * step
        self.rows = self.prompts_per_chunk * repeats
        self.compile_log = compile_log or compilation.CompileLog()
        self.answer_key = None
        if run_config.eval_k:
            self.answer_key = answer_key or pass_at_k_lib.task_answer_key(run_config.task)

    def compile(self, params: Any, lora: Any, prompt_len: int) -> None:
        """Compiles ahead of time the generation programs of an evaluation whose prompts run
        at ``prompt_len`` tokens (``params`` and ``lora`` may be abstract), so that it runs
        what is compiled; nothing without eval examples."""
        if not self.examples:
            return
        run_config = self.run_config
        ids = jax.ShapeDtypeStruct((self.prompts_per_chunk, prompt_len), np.int32)
        with self.compile_log.label("generate", reporting.generate_shape(ids, run_config.eval_repeats,
                                                                         run_config.max_new_tokens)):
            self.generator.compile(params, lora, prompts=self.prompts_per_chunk, prompt_len=prompt_len,
                                   **self._generate_options(prompts_lib.pad_token_id(self.prompts.tokenizer)))

    def _generate_options(self, pad_token_id: int) -> dict[str, Any]:
        """The options an evaluation generates with, which key its programs (:meth:`compile`'s too)."""
        run_config = self.run_config
        return dict(num_samples=run_config.eval_repeats, max_new_tokens=run_config.max_new_tokens,
                    top_k=run_config.eval_top_k, eos_token_ids=self.eos_ids, pad_token_id=pad_token_id)

    def __call__(self, params: Any, lora: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """``(scalars, samples)`` of the policy ``(params, lora)``.

        Returns:
            scalars: ``eval/accuracy``: the metric, mean over passes; ``eval/accuracy_std``:
            its standard deviation over passes (ddof 1; 0 with one pass);
            ``eval/pass_at_<k>`` and ``eval/maj_at_<k>`` for each k of ``eval_k``, from the metric
            and the answers of the passes (:mod:`podsjax.rl.pass_at_k`);
            ``eval/answer_accuracy`` and ``eval/format_accuracy``: the task's accuracy and the
            authors' strict format check, means over passes; ``eval/examples``: examples per
            pass (prompts longer than ``max_prompt_length`` are left out).
            samples: the first pass's completions on this process, with their scores.
        """
        run_config = self.run_config
        eval_key = jax.random.fold_in(jax.random.key(run_config.seed), EVAL_STREAM)
        kept = EVAL_PARTS + ((ANSWERS,) if self.answer_key else ())
        parts: dict[str, list[np.ndarray]] = {name: [] for name in kept}  # name -> chunks of [R, e]
        samples: list[dict[str, Any]] = []
        evaluated = 0
        repeats, per_chunk = run_config.eval_repeats, self.prompts_per_chunk
        for index, start in enumerate(range(0, len(self.examples), per_chunk)):
            chunk = self.examples[start : start + per_chunk]
            prompts = self.prompts.prepare(chunk)
            if self.buckets is not None:
                prompts = self.buckets.fit(prompts, count=False)
            chunk = [chunk[i] for i in prompts.kept_P]
            evaluated += len(chunk)
            if not chunk:
                continue
            # The last prompt repeats to fill the chunk; its copies' results are dropped.
            ids, prompt_mask = (self.generator.place_rows(x) for x in prompts.padded_rows(per_chunk))
            padded = chunk + [chunk[-1]] * (per_chunk - len(chunk))
            key = jax.random.fold_in(eval_key, index)
            with self.compile_log.label("generate", reporting.generate_shape(ids, repeats, run_config.max_new_tokens)):
                r = self.generator.generate(params, ids, prompt_mask, key, temperature=run_config.eval_temperature,
                                            lora=lora, **self._generate_options(prompts.pad_id))
            # Row p * repeats + k is pass k of prompt p.
            first, tokens = hosts.local_rows(r.tokens)
            mask = hosts.local_rows(r.mask)[1]
            mine = [padded[row // repeats] for row in range(first, first + len(tokens))]
            texts = prompts_lib.decode_completions(self.prompts.tokenizer, tokens, mask)
            scores = self.scorer.score(texts, self.rewards, **data_lib.reward_columns(mine, 1)).per_function
            local = {name: np.asarray(scores[name], np.float64) for name in EVAL_PARTS}
            if self.answer_key:
                local[ANSWERS] = pass_at_k_lib.answer_ids(texts, self.answer_key)
            whole = hosts.gather_rows(first, local, self.rows)
            for name in kept:
                dtype = np.int64 if name == ANSWERS else np.float64
                parts[name].append(np.asarray(whole[name], dtype).reshape(per_chunk, repeats)[: len(chunk)].T)
            # The first pass's completions of this host's rows (process 0's are the first).
            samples.extend({"prompt": e.prompt, "completion": t, "answer": e.answer, "accuracy": float(a),
                            "format_correct": float(f)}
                           for row, e, t, a, f in zip(range(first, first + len(tokens)), mine, texts,
                                                      scores["accuracy"], scores["strict_format"])
                           if row % repeats == 0 and row // repeats < len(chunk))
        if evaluated < len(self.examples) and evaluated and not self._skips_said:
            self._log(f"evaluating on {evaluated} of {len(self.examples)} examples: the other "
                      f"{len(self.examples) - evaluated} are longer than max_prompt_length "
                      f"{self.prompts.max_prompt_length} tokens (each evaluation's count: eval/examples)")
            self._skips_said = True
        if self.examples and not evaluated:  # an accuracy of nothing would read as 0 %
            raise prompts_lib.PromptError(
                f"no evaluation example fits in max_prompt_length {self.prompts.max_prompt_length} tokens: all "
                f"{len(self.examples)} are longer; raise --max-prompt-length or filter the test set")
        values_RE = {name: np.concatenate(chunks, axis=1) if chunks
                     else np.zeros((run_config.eval_repeats, 0), np.int64 if name == ANSWERS else np.float64)
                     for name, chunks in parts.items()}
        return eval_scalars(values_RE, EVAL_METRICS[run_config.eval_metric], run_config.eval_k), samples


def with_strict_format(rewards: tuple[rewards_lib.WeightedReward, ...]) -> tuple[rewards_lib.WeightedReward, ...]:
    """``rewards`` plus the strict format check at weight 0: scored for evaluation, never in the total."""
    if any(w.name == "strict_format" for w in rewards):
        return rewards
    return (*rewards, rewards_lib.WeightedReward(rewards_lib.strict_format_reward, 0.0, "strict_format"))


def eval_scalars(values_RE: dict[str, np.ndarray], metric: tuple[str, ...],
                 eval_k: Sequence[int] = ()) -> dict[str, float]:
    """Evaluation's scalars from each part's [R passes, E examples] values (see :class:`Evaluator`).

    pass@k and maj@k (for each k of ``eval_k``) count a completion correct by ``metric``, so
    pass@1 is ``eval/accuracy``; maj@k reads the answer ids in ``values_RE["answer_id"]``.
    """
    if eval_k and ANSWERS not in values_RE:
        raise ValueError(f"eval_k needs each completion's answer id (values_RE[{ANSWERS!r}]) for maj@k")
    repeats, count = values_RE[metric[0]].shape
    metric_RE = np.prod([values_RE[name] for name in metric], axis=0)
    per_pass_R = metric_RE.mean(axis=1) if count else np.zeros(repeats)
    scalars = {
        "eval/accuracy": float(per_pass_R.mean()),
        "eval/accuracy_std": float(per_pass_R.std(ddof=1)) if repeats > 1 else 0.0,
        "eval/answer_accuracy": float(values_RE["accuracy"].mean()) if count else 0.0,
        "eval/format_accuracy": float(values_RE["strict_format"].mean()) if count else 0.0,
        "eval/examples": float(count),
    }
    for k in eval_k:  # '@' is out of names W&B can sort and filter: pass_at_<k>
        scalars[f"eval/pass_at_{k}"] = pass_at_k_lib.pass_at_k(metric_RE, k)
        scalars[f"eval/maj_at_{k}"] = pass_at_k_lib.maj_at_k(values_RE[ANSWERS], metric_RE, k)
    return scalars
