"""Evaluation: greedy or the paper's sampled passes, the Llama metric, and one decode program."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_checkpoint import save_tiny_checkpoint

from podsjax import rl
from podsjax.data import datasets as data, prompts
from podsjax.sampler import decoding, sampling
import podsjax.models as pm
from experiments import paper_settings
from podsjax import rewards as rewards_lib
from podsjax.rewards import format_correct
from podsjax.rl.pass_at_k import gsm8k_answer_key

QUESTIONS = [("What is 2 + 2?", "4"), ("What is 3 + 4?", "7"), ("What is 5 - 1?", "4"), ("What is 6 / 2?", "3")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("eval_ckpt"))
    model, params = pm.from_pretrained(checkpoint, dtype=jnp.float32)
    examples = [data.Example(q, a) for q, a in QUESTIONS]
    return model, params, prompts.load_tokenizer(checkpoint), examples


# One generator per model for the module: its tests share the compiled programs.
shared_generator = functools.cache(sampling.Generator)


def make_trainer(setup, out_dir, rewards=None, generator=None, scorer=None, eval_examples=None, log=None, **run_fields):
    model, params, tokenizer, examples = setup
    run = rl.RunConfig(out_dir=str(out_dir), max_steps=1, prompts_per_step=2, max_new_tokens=7,
                       reward_workers=1, progress=False, console=False, **run_fields)
    algo = paper_settings.method_config("pods", n=4, m=2)
    return rl.Trainer(model, params, tokenizer, examples, eval_examples or examples, algo, run,
                      lora=pm.LoraConfig(rank=2, alpha=4.0), rewards=rewards,
                      generator=generator or shared_generator(model), scorer=scorer, log=log)


class InProcessScorer:
    """Stands in for the reward pool, so test-local reward functions need no worker process."""

    def score(self, completions, rewards, **columns):
        return rewards_lib.score_rewards(completions, rewards, **columns)

    def close(self):
        pass


@pytest.mark.parametrize("text,expected", [
    ("<think>a</think><answer>4</answer>", True),
    ("\n<think>a</think>\n<answer>4</answer>\n", True),
    ("<think>a</think> <answer>4</answer>\n\n", True),  # re.match's "$" also matches before a final newline
    ("<think>a</think><answer></answer>", True),  # the authors' check allows a blank answer
    ("<think>a</think><think>b</think><answer>4</answer>", True),  # and repeated tags
    ("x<think>a</think><answer>4</answer>", False),
    ("<think>a</think>  <answer>4</answer>", False),  # at most one space or newline between blocks
    ("<think>a</think><answer>4</answer> x", False),
    ("<answer>4</answer>", False),
])
def test_format_correct_is_the_authors_strict_check(text, expected):
    assert format_correct(text) is expected
    assert rewards_lib.get_reward("strict_format")([text]) == [float(expected)]


def test_eval_scalars_average_the_passes_and_multiply_the_metrics_parts():
    values_RE = {"accuracy": np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
                 "strict_format": np.array([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])}
    plain = rl.eval_scalars(values_RE, rl.EVAL_METRICS["accuracy"])
    assert plain["eval/accuracy"] == pytest.approx(0.5)
    assert plain["eval/accuracy_std"] == pytest.approx(np.std([2 / 3, 1 / 3], ddof=1), abs=1e-12)
    both = rl.eval_scalars(values_RE, rl.EVAL_METRICS["accuracy_and_format"])
    assert both["eval/accuracy"] == pytest.approx(1 / 3) and both["eval/accuracy_std"] == 0.0
    assert both["eval/answer_accuracy"] == pytest.approx(0.5) and both["eval/format_accuracy"] == pytest.approx(0.5)
    assert both["eval/examples"] == 3.0
    one = rl.eval_scalars({k: v[:1] for k, v in values_RE.items()}, rl.EVAL_METRICS["accuracy"])
    assert one["eval/accuracy_std"] == 0.0  # one pass: no spread to report
    empty = rl.eval_scalars({k: v[:, :0] for k, v in values_RE.items()}, rl.EVAL_METRICS["accuracy"])
    assert empty["eval/accuracy"] == 0.0 and empty["eval/examples"] == 0.0


class RecordingGenerator:
    """The shared generator, noting each call's key, temperature, samples and prompt rows."""

    def __init__(self, model):
        self.inner, self.model, self.calls = shared_generator(model), model, []

    def place_rows(self, x):
        return self.inner.place_rows(x)

    def generate(self, params, ids, mask, key, **kwargs):
        self.calls.append((tuple(np.asarray(jax.random.key_data(key)).ravel()), kwargs["temperature"],
                           kwargs["num_samples"], ids.shape[0]))
        return self.inner.generate(params, ids, mask, key, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["scanned", "unrolled"])
def test_sampled_passes_draw_their_own_keys_and_evaluation_compiles_its_program_once(setup, tmp_path, layers):
    model = setup[0].clone(rollout_layers=layers)
    recorder = RecordingGenerator(model)
    calls = recorder.calls
    trainer = make_trainer((model, *setup[1:]), tmp_path / "run", generator=recorder, eval_repeats=3,
                           eval_temperature=0.9, eval_examples=setup[3] * 3)
    decodes = []
    try:
        first = trainer.evaluate()
        decodes.append(trainer.compile_counts.get("generate[sample]", 0))
        trainer.rl_step()
        decodes.append(trainer.compile_counts.get("generate[sample]", 0))
        second = trainer.evaluate()
        decodes.append(trainer.compile_counts.get("generate[sample]", 0))
    finally:
        trainer.close()
    evals = [c for c in calls if c[2] == 3]  # an example's 3 passes are 3 samples of its prompt
    # 8 rows / 3 passes, rounded up to prompts x 3 a multiple of 8 rows: chunks of 8 prompts x 3
    # samples, so the 12 examples in 2 calls.
    assert len(evals) == 4 and {c[1] for c in evals} == {0.9} and {c[3] for c in evals} == {8}
    assert len({c[0] for c in evals[:2]}) == 2  # a key per chunk
    assert [c[0] for c in evals[:2]] == [c[0] for c in evals[2:]]  # the same keys at every evaluation
    assert [(c[3], c[1]) for c in calls if c[2] == 4] == [(2, 0.9)]  # the step's 2 prompts x 4 samples
    # At most one compile (none when an earlier test in this process built the same program),
    # and the next evaluation compiles nothing. 8 prompts x 3 samples is another sampling
    # program than the step's 2 prompts x 4: the step compiles its own, once.
    assert isinstance(decoding.layers_for(model), decoding.UnrolledLayers) == (layers == "unrolled")
    assert decodes[0] <= 1 and decodes[0] <= decodes[1] <= decodes[0] + 1, trainer.compile_counts
    assert decodes[2] == decodes[1], trainer.compile_counts
    for result in (first, second):
        assert result["eval/examples"] == 12.0 and result["eval/accuracy_std"] >= 0.0
        assert {"eval/answer_accuracy", "eval/format_accuracy"} <= set(result)


def test_greedy_is_one_pass_at_temperature_zero_by_default(setup, tmp_path):
    recorder = RecordingGenerator(setup[0])
    calls = recorder.calls
    trainer = make_trainer(setup, tmp_path / "run", generator=recorder)
    try:
        result = trainer.evaluate()
    finally:
        trainer.close()
    assert [(c[1], c[2]) for c in calls] == [(0.0, 1)] and result["eval/accuracy_std"] == 0.0
    with pytest.raises(ValueError, match="eval_repeats 2 needs eval_temperature > 0"):
        rl.RunConfig(out_dir="unused", max_steps=1, eval_repeats=2)


class StubGenerator:
    """Records each call's sampling arguments and decodes nothing (empty completions)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def place_rows(self, x):
        return jnp.asarray(x)

    def generate(self, params, ids, mask, key, *, max_new_tokens, **kwargs):
        self.calls.append({name: kwargs[name] for name in ("temperature", "top_k", "num_samples")})
        empty = jnp.zeros((ids.shape[0] * kwargs["num_samples"], max_new_tokens), jnp.int32)
        return types.SimpleNamespace(tokens=empty, mask=empty.astype(bool))


@pytest.mark.parametrize("top_k", [0, 3])
def test_evaluation_samples_among_the_protocols_top_k(setup, tmp_path, top_k):
    # The evaluation protocol's top-k, not the rollouts' (0 here), reaches every pass: the 4
    # examples' 2 passes in one call (8 rows // 2 passes = 4 prompts a chunk).
    stub = StubGenerator(setup[0])
    trainer = make_trainer(setup, tmp_path / "run", generator=stub, scorer=InProcessScorer(), eval_repeats=2,
                           eval_temperature=0.9, eval_top_k=top_k)
    try:
        trainer.evaluate()
    finally:
        trainer.close()
    assert stub.calls == [{"temperature": 0.9, "top_k": top_k, "num_samples": 2}]


def by_position(pattern):
    """A reward function that scores the i-th completion of a call ``pattern[i]``."""
    def fn(completions, **_):
        return [float(pattern[i % len(pattern)]) for i in range(len(completions))]
    return fn


def test_accuracy_and_format_counts_an_answer_only_with_the_strict_format(setup, tmp_path):
    rewards = [rewards_lib.WeightedReward(by_position([1, 0, 1, 0]), 1.0, "accuracy"),
               rewards_lib.WeightedReward(by_position([1, 1, 0, 0]), 0.0, "strict_format")]
    results = {}
    for metric in rl.EVAL_METRICS:
        trainer = make_trainer(setup, tmp_path / metric, rewards=rewards, scorer=InProcessScorer(), eval_metric=metric)
        try:
            results[metric] = trainer.evaluate()
        finally:
            trainer.close()
    assert results["accuracy"]["eval/accuracy"] == 0.5
    assert results["accuracy_and_format"]["eval/accuracy"] == 0.25  # both right only for the first
    assert results["accuracy_and_format"]["eval/answer_accuracy"] == 0.5
    assert results["accuracy_and_format"]["eval/format_accuracy"] == 0.5


def test_sampled_accuracy_is_the_mean_over_passes_with_their_spread(setup, tmp_path):
    # One chunk of 8 prompts (4 examples, 4 copies) x 3 passes, prompt-major (row i is pass
    # i % 3 of its prompt): every example right at passes 0 and 2, wrong at pass 1.
    rewards = [rewards_lib.WeightedReward(by_position([1, 0, 1]), 1.0, "accuracy")]
    trainer = make_trainer(setup, tmp_path / "run", rewards=rewards,
                           scorer=InProcessScorer(), eval_repeats=3, eval_temperature=0.9)
    try:
        result = trainer.evaluate()
    finally:
        trainer.close()
    assert result["eval/accuracy"] == pytest.approx(2 / 3) and result["eval/examples"] == 4.0
    assert result["eval/accuracy_std"] == pytest.approx(np.std([1, 0, 1], ddof=1))


def test_the_trainer_adds_the_strict_format_check_to_evaluation_only(setup, tmp_path):
    trainer = make_trainer(setup, tmp_path / "run", rewards=rewards_lib.default_rewards("gsm8k", format=0.01))
    trainer.close()
    assert [w.name for w in trainer.rewards] == ["accuracy", "format", "tag_count"]
    assert [(w.name, w.weight) for w in trainer.evaluator.rewards][-1] == ("strict_format", 0.0)


# Four passes of the four questions: each completion's grade and final answer (None: unreadable).
CORRECT_RE = [[1, 0, 1, 1],
              [0, 0, 0, 1],
              [0, 1, 0, 1],
              [0, 0, 0, 1]]
ANSWERS_RE = [["a", None, "e", "g"],
              ["b", None, "f", "g"],
              ["b", "c", "e", "g"],
              [None, "d", "f", "g"]]


def test_pass_and_maj_at_k_come_from_the_passes_grades_and_answers(setup, tmp_path):
    # 8 rows // 4 passes: chunks of 2 questions, each with its 4 passes as samples, prompt-major.
    order = [(k, 2 * chunk + p) for chunk in range(2) for p in range(2) for k in range(4)]
    questions = [q for q, _ in QUESTIONS]
    answers = [ANSWERS_RE[k][e] for k, e in order]  # the answer key sees the rows in this order

    def accuracy(completions, prompt, **_):
        return [float(CORRECT_RE[i % 4][questions.index(q)]) for i, q in enumerate(prompt)]

    def answer_key(text):
        return answers.pop(0)

    rewards = [rewards_lib.WeightedReward(accuracy, 1.0, "accuracy")]
    trainer = make_trainer(setup, tmp_path / "run", rewards=rewards, scorer=InProcessScorer(), eval_repeats=4,
                           eval_temperature=0.9, eval_k=(1, 2, 4))
    try:
        evaluator = rl.Evaluator(trainer.generator, trainer.prompts, InProcessScorer(), setup[3],
                                 trainer.run_config, rows=8, rewards=rewards, eos_ids=trainer.eos_ids,
                                 answer_key=answer_key)
        result, samples = evaluator(*trainer.policy_params())
    finally:
        trainer.close()
    # The logged samples: the first pass of each question, in order.
    assert [(x["prompt"], x["accuracy"]) for x in samples] == [(q, float(c)) for q, c in zip(questions, CORRECT_RE[0])]
    assert result["eval/accuracy"] == pytest.approx(7 / 16, abs=1e-12)
    assert result["eval/pass_at_1"] == pytest.approx(7 / 16, abs=1e-12)
    # Three questions right once in 4 (1 - C(3,2)/C(4,2) = 1/2), one right every time.
    assert result["eval/pass_at_2"] == pytest.approx((3 * 0.5 + 1) / 4, abs=1e-12)
    assert result["eval/pass_at_4"] == 1.0
    # Blocks of passes (0, 1) and (2, 3). Q1: a (tie, first) right; b wrong. Q2: nobody votes;
    # c (tie, first) right. Q3: e right at pass 0; e wrong at pass 2. Q4: right twice.
    assert result["eval/maj_at_2"] == pytest.approx(5 / 8, abs=1e-12)
    # One block: Q1 b (2 to 1) wrong; Q2 c (tie with d) right; Q3 e (tie with f) right at pass 0; Q4 right.
    assert result["eval/maj_at_4"] == pytest.approx(3 / 4, abs=1e-12)
    assert result["eval/maj_at_1"] == pytest.approx(7 / 16, abs=1e-12)  # the unreadable ones are wrong too


def test_the_tasks_answer_key_votes_by_default_and_eval_k_off_logs_nothing_new(setup, tmp_path):
    # One chunk of the 4 questions x 2 passes, prompt-major: questions 1 and 3 right at both passes.
    rewards = [rewards_lib.WeightedReward(by_position([1, 1, 0, 0]), 1.0, "accuracy")]
    results = {}
    for eval_k in ((), (1, 2)):
        trainer = make_trainer(setup, tmp_path / str(len(eval_k)), rewards=rewards, scorer=InProcessScorer(),
                               eval_repeats=2, eval_temperature=0.9, eval_k=eval_k)
        try:
            assert trainer.evaluator.answer_key is (gsm8k_answer_key if eval_k else None)
            results[eval_k] = trainer.evaluate()
        finally:
            trainer.close()
    assert not any("_at_" in name for name in results[()])
    on = results[(1, 2)]
    assert on["eval/pass_at_1"] == on["eval/accuracy"] == 0.5 and on["eval/pass_at_2"] == 0.5
    assert 0.0 <= on["eval/maj_at_2"] <= 0.5 and 0.0 <= on["eval/maj_at_1"] <= 0.5


def test_an_evaluation_where_no_prompt_fits_is_an_error_not_zero_accuracy(setup, tmp_path):
    _, _, tokenizer, examples = setup
    fits = int(prompts.prepare_prompts(tokenizer, [e.prompt for e in examples], max_prompt_length=10**6).lengths_P.max())
    too_long = [data.Example(e.prompt * 8, e.answer) for e in examples]  # the training prompts fit; these do not
    trainer = make_trainer(setup, tmp_path / "run", eval_examples=too_long, max_prompt_length=fits)
    try:
        with pytest.raises(prompts.PromptError, match=f"^no evaluation example fits in max_prompt_length {fits} tokens: "
                                                      f"all {len(too_long)} are longer; raise --max-prompt-length") as info:
            trainer.evaluate()
    finally:
        trainer.close()
    assert "\n" not in str(info.value)


def test_an_evaluation_that_leaves_prompts_out_says_so_once(setup, tmp_path):
    _, _, tokenizer, examples = setup
    fits = int(prompts.prepare_prompts(tokenizer, [e.prompt for e in examples], max_prompt_length=10**6).lengths_P.max())
    mixed = examples + [data.Example(e.prompt * 8, e.answer) for e in examples[:3]]
    lines = []
    trainer = make_trainer(setup, tmp_path / "run", eval_examples=mixed, log=lines.append, max_prompt_length=fits)
    try:
        for _ in range(2):
            assert trainer.evaluate()["eval/examples"] == len(examples)
    finally:
        trainer.close()
    said = [line for line in lines if line.startswith("evaluating on")]
    assert said == [f"evaluating on {len(examples)} of {len(mixed)} examples: the other 3 are longer than "
                    f"max_prompt_length {fits} tokens (each evaluation's count: eval/examples)"], lines
