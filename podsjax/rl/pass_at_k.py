"""pass@k and maj@k of sampled evaluation: R sampled completions of each of E problems.

- **pass@k**: the chance that at least one of k completions, drawn without replacement
  from a problem's R, is correct. The unbiased estimator of Chen et al. (2021), for a
  problem with c correct of n = R, is ``1 - C(n - c, k) / C(n, k)``, computed as the product
  ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no huge binomials), then averaged over problems.
- **maj@k**: the passes are cut into ``R // k`` blocks of k consecutive ones (passes left
  over are not used). In each block the completions vote with their final answers
  (:data:`ANSWER_KEYS`); a completion whose answer cannot be read does not vote. The most
  common answer wins, a tie goes to the tied answer that appears first in the block, and a
  block where nobody votes counts as wrong. The block is right when the first completion
  that gave the winning answer is correct, so nothing is graded twice. maj@k is the mean over
  problems and blocks.

A completion is correct when its score is at least 0.5 (the tasks' accuracies are 0 or 1).
With every answer readable, pass@1 and maj@1 both equal the mean accuracy.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import numpy as np

from podsjax.rewards.answer_grader import mathd_normalize
from podsjax.rewards.chemistry_grader import extract_chemistry_answer
from podsjax.rewards.gsm8k_grader import extract_gsm8k_answer
from podsjax.rewards.mathverify import MathVerifyTimeout
from podsjax.rewards.text import extract_answer_tag, last_boxed

NO_ANSWER = -1  # the answer id of a completion whose final answer cannot be read


def _check(values_RE: np.ndarray, k: int, what: str) -> None:
    if values_RE.ndim != 2:
        raise ValueError(f"{what} must be [samples, problems]; got shape {values_RE.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= values_RE.shape[0]:
        raise ValueError(f"k must be an integer from 1 to the {values_RE.shape[0]} samples per problem; got {k!r}")


def pass_at_k_per_problem(num_samples: int, num_correct_E: np.ndarray, k: int) -> np.ndarray:
    """[E] the unbiased pass@k of each problem with ``num_correct_E`` correct of ``num_samples``.

    Args:
        num_samples: n, the samples of every problem.
        num_correct_E: [E] c, the correct samples of each problem (0 <= c <= n).
        k: the samples drawn, 1 <= k <= n.
    """
    for name, value in (("k", k), ("num_samples", num_samples)):  # k=1.5 had computed a pass@1.5
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer; got {value!r}")
    counts = np.asarray(num_correct_E)
    if counts.size and counts.dtype.kind not in "iub":  # a float count had been cut to an int
        raise ValueError(f"correct counts must be integers; got dtype {counts.dtype}")
    num_correct_E = counts.astype(np.int64)
    if not 1 <= k <= num_samples:
        raise ValueError(f"k must be from 1 to the {num_samples} samples per problem; got {k}")
    if num_correct_E.size and not (0 <= num_correct_E.min() and num_correct_E.max() <= num_samples):
        raise ValueError(f"correct counts must be from 0 to {num_samples}; got {num_correct_E.min()} to "
                         f"{num_correct_E.max()}")
    out_E = np.ones(num_correct_E.shape, np.float64)  # fewer than k wrong: every draw holds a right one
    for e, c in enumerate(num_correct_E):
        if num_samples - c >= k:
            # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
            out_E[e] = 1.0 - np.prod(1.0 - k / np.arange(num_samples - c + 1, num_samples + 1, dtype=np.float64))
    return out_E


def pass_at_k(correct_RE: np.ndarray, k: int) -> float:
    """The mean over problems of the unbiased pass@k (see the module); 0 with no problems.

    Args:
        correct_RE: [R samples, E problems] scores; at least 0.5 is correct.
        k: 1 <= k <= R.
    """
    correct_RE = np.asarray(correct_RE, np.float64)
    _check(correct_RE, k, "correct_RE")
    if not correct_RE.shape[1]:
        return 0.0
    return float(pass_at_k_per_problem(correct_RE.shape[0], (correct_RE >= 0.5).sum(axis=0), int(k)).mean())


def majority_is_correct(answers_K: np.ndarray, correct_K: np.ndarray) -> bool:
    """Whether the majority answer of one block is correct (ties and non-voters: see the module).

    Args:
        answers_K: [k] answer ids, :data:`NO_ANSWER` for an unreadable answer.
        correct_K: [k] scores; at least 0.5 is correct.
    """
    votes: dict[int, int] = {}
    first: dict[int, int] = {}  # answer -> the first completion in the block that gave it
    for i, answer in enumerate(answers_K.tolist()):
        if answer != NO_ANSWER:
            votes[answer] = votes.get(answer, 0) + 1
            first.setdefault(answer, i)
    if not votes:
        return False
    winner = max(votes, key=lambda answer: (votes[answer], -first[answer]))
    return bool(correct_K[first[winner]] >= 0.5)


def maj_at_k(answers_RE: np.ndarray, correct_RE: np.ndarray, k: int) -> float:
    """maj@k: majority votes in blocks of k consecutive samples (see the module); 0 with no problems.

    Args:
        answers_RE: [R samples, E problems] integer answer ids (:func:`answer_ids`).
        correct_RE: [R, E] scores; at least 0.5 is correct.
        k: 1 <= k <= R.
    """
    answers_RE, correct_RE = np.asarray(answers_RE), np.asarray(correct_RE, np.float64)
    _check(answers_RE, k, "answers_RE")
    if answers_RE.shape != correct_RE.shape:
        raise ValueError(f"answers_RE {answers_RE.shape} and correct_RE {correct_RE.shape} must have one shape")
    if not np.issubdtype(answers_RE.dtype, np.integer):
        raise ValueError(f"answers_RE must hold integer answer ids; got {answers_RE.dtype}")
    blocks, problems = answers_RE.shape[0] // k, answers_RE.shape[1]
    if not problems:
        return 0.0
    right = [majority_is_correct(answers_RE[b * k:(b + 1) * k, e], correct_RE[b * k:(b + 1) * k, e])
             for b in range(blocks) for e in range(problems)]
    return float(np.mean(right))


def gsm8k_answer_key(completion: str) -> str | None:
    """The GSM8K reward's final number (:func:`~podsjax.rewards.extract_gsm8k_answer`), exact: 18.00 is 18."""
    value = extract_gsm8k_answer(completion)
    return None if value is None else str(value)


def math_answer_key(completion: str) -> str | None:
    r"""The last ``<answer>`` (its ``\boxed{}`` if any), else the last ``\boxed{}``, under the MATH
    dataset's normalization (:func:`~podsjax.rewards.answer_grader.mathd_normalize`: ``\dfrac`` is
    ``\frac``, ``0.5`` is ``\frac{1}{2}``). No algebra is done, so ``2/4`` and ``1/2`` vote apart."""
    answer = extract_answer_tag(completion)
    boxed = last_boxed(completion if answer is None else answer)
    answer = boxed if boxed is not None else answer
    if answer is None:
        return None
    return mathd_normalize(answer.strip().strip("$").strip()) or None


def chemistry_answer_key(completion: str) -> str | None:
    """The chemistry reward's number (:func:`~podsjax.rewards.extract_chemistry_answer`) to 6 significant
    digits, so float noise does not split a vote."""
    try:
        value = extract_chemistry_answer(completion)
    except MathVerifyTimeout:
        return None
    return None if value is None else format(value + 0.0, ".6g")  # + 0.0: -0.0 is 0


# task -> the final answer a completion gives, as text that is equal for equal answers (None: unreadable).
ANSWER_KEYS: dict[str, Callable[[str], str | None]] = {
    "gsm8k": gsm8k_answer_key,
    "math": math_answer_key,
    "chemistry": chemistry_answer_key,
}


def task_answer_key(task: str) -> Callable[[str], str | None]:
    """The task's entry of :data:`ANSWER_KEYS`."""
    if task not in ANSWER_KEYS:
        raise ValueError(f"maj@k needs an answer key for task {task!r}; known: {', '.join(ANSWER_KEYS)}")
    return ANSWER_KEYS[task]


def answer_id(key: str | None) -> int:
    """A 31-bit id of an answer key (exact in int32, so hosts can gather it), :data:`NO_ANSWER` for None.

    Two different answers of one problem share an id with chance 2^-31, so ids, not texts, can vote.
    """
    if key is None:
        return NO_ANSWER
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=4).digest(),
                          "little") & 0x7FFFFFFF


def answer_ids(completions, answer_key: Callable[[str], str | None]) -> np.ndarray:
    """[B] int32 :func:`answer_id` of each completion's ``answer_key`` (int32: what hosts gather as it is)."""
    return np.asarray([answer_id(answer_key(text)) for text in completions], np.int32)
