"""The update's forward: the policy's and the reference's hidden-state functions, and the
completion tokens' log-probs from them, per row or with each prompt computed once.

Per row, every row of the batch is prompt + completion. With a shared prefix, rows that
continue one prompt are one group: the prompt runs through the layers once and its
completions attend to its keys and values (``podsjax.models.shared_prefix``). Both give
the same log-probs, and autodiff gives the same gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from podsjax.core import logprobs
from podsjax.models.shared_prefix import PrefixDecoder


@dataclasses.dataclass(frozen=True)
class HiddenFn:
    """A hidden-state function of the update, per row when called, and its shared-prefix form.

    Attributes:
      rows: ``rows(*weights, ids_BL, mask_BL, positions) -> (hidden_BTD, head_VD)`` at the
        static slice ``positions`` of each row prompt + completion.
      shared_prefix: ``shared_prefix(*weights, prompt_ids_GP, prompt_mask_GP,
        completion_ids_BT, completion_mask_BT) -> (hidden_BTD, head_VD)`` at the positions
        that predict the completion tokens, each of the G prompts computed once for its
        B / G completions.
    """

    rows: Callable
    shared_prefix: Callable

    def __call__(self, *args, **kwargs):
        return self.rows(*args, **kwargs)


def completion_logprobs(hidden_fn: Callable, batch: Any, temperature: float) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies [B, T] of a ``train.TrainBatch``'s completion tokens under ``hidden_fn``'s policy.

    ``hidden_fn(ids_BL, mask_BL, positions)`` returns ``(hidden_BTD, head_VD)`` for the
    positions in the static slice ``positions``: the LM head then runs only on the
    positions that predict completion tokens, in chunks (``logprobs.head_logprobs``).
    """
    t = batch.completion_length
    hidden_BTD, head_VD = hidden_fn(batch.input_ids, batch.attention_mask, slice(-t - 1, -1))
    return logprobs.head_logprobs(hidden_BTD, head_VD, batch.input_ids[:, -t:], temperature=temperature)


def prompt_rows(rows: int, group_size: int) -> int:
    """Consecutive rows of a (micro-)batch of ``rows`` that share one prompt computation:
    the largest run that lies in one group of ``group_size`` and never crosses the batch's edge."""
    return math.gcd(rows, group_size)


def _check_prompt_length(length: int, completion_length: int) -> None:
    if length <= completion_length:
        raise ValueError(f"rows of {length} tokens hold no prompt before their {completion_length} completion tokens")


def mismatched_prompt_groups(batch: Any, group_size: int, micro_batches: int = 1) -> jax.Array:
    """How many runs of rows that :func:`shared_prefix_logprobs` reads one prompt for hold
    rows with different prompts: an int32 scalar, 0 for ``train.build_batch``'s layout.

    A row's prompt is its tokens before the completion under the attention mask, so both
    the real tokens and where the padding lies must match; ids under padding are never
    read and may differ.

    Args:
      batch: a ``train.TrainBatch``.
      group_size: rows per prompt.
      micro_batches: how many micro-batches of consecutive rows the update splits the batch into.
    """
    t = batch.completion_length
    b, length = batch.input_ids.shape
    _check_prompt_length(length, t)
    shared = prompt_rows(b // micro_batches, group_size)
    real_BP = batch.attention_mask[:, :length - t] > 0
    ids_BP = jnp.where(real_BP, batch.input_ids[:, :length - t], 0)

    def differs_R(x_BP):
        x_RSP = x_BP.reshape(b // shared, shared, length - t)
        return jnp.any(x_RSP != x_RSP[:, :1], axis=(1, 2))

    return jnp.sum(differs_R(ids_BP) | differs_R(real_BP), dtype=jnp.int32)


def mismatched_prompts_error(count: int) -> ValueError:
    """The error for a batch with ``count`` > 0 :func:`mismatched_prompt_groups`."""
    return ValueError(
        f"{count} prompt group(s) of the update batch hold rows with different prompts, so the shared-prefix "
        "update (which reads each group's prompt from its first row) would train on the wrong prompts and was not "
        "applied: lay out groups of m consecutive rows with one prompt (as train.build_batch does), or set "
        "shared_prefix=False (--algorithm.shared_prefix false)")


def shared_prefix_logprobs(prefix_fn: Callable, batch: Any, temperature: float,
                           group_size: int) -> tuple[jax.Array, jax.Array]:
    """:func:`completion_logprobs` with each prompt computed once for its rows.

    Args:
      prefix_fn: ``prefix_fn(prompt_ids_GP, prompt_mask_GP, completion_ids_BT,
        completion_mask_BT) -> (hidden_BTD, head_VD)``, as ``HiddenFn.shared_prefix``.
      batch: a ``train.TrainBatch`` whose rows come in groups of ``group_size`` consecutive
        rows with one prompt (``train.build_batch``'s layout); the prompt of each
        :func:`prompt_rows` run is read from its first row.
      temperature: > 0.
      group_size: rows per prompt.
    """
    t = batch.completion_length
    b, length = batch.input_ids.shape
    _check_prompt_length(length, t)
    shared = prompt_rows(b, group_size)

    def first_of_each_group(x_BL):
        return x_BL[:, :length - t].reshape(b // shared, shared, length - t)[:, 0]

    completion_ids_BT = batch.input_ids[:, -t:]
    hidden_BTD, head_VD = prefix_fn(first_of_each_group(batch.input_ids), first_of_each_group(batch.attention_mask),
                                    completion_ids_BT, batch.attention_mask[:, -t:])
    return logprobs.head_logprobs(hidden_BTD, head_VD, completion_ids_BT, temperature=temperature)


def _hidden_and_head(model, params, ids, mask, positions, lora=None) -> tuple[jax.Array, jax.Array]:
    """``(hidden_BTD, head_VD)`` of ``model`` at the static slice ``positions``."""
    out = model.apply({"params": params}, ids, attention_mask=mask, lora=lora, logits_slice=positions,
                      return_hidden=True)
    return out.hidden_BLD, out.head_VD


def _prefix_hidden_and_head(model, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                            lora=None) -> tuple[jax.Array, jax.Array]:
    out = PrefixDecoder.of(model).apply({"params": params}, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                        lora=lora)
    return out.hidden_BLD, out.head_VD


def lora_apply_fn(model) -> tuple[HiddenFn, HiddenFn]:
    """(policy, reference) hidden-state functions for LoRA training on a frozen base."""

    def policy(lora, base, ids, mask, positions=None):
        return _hidden_and_head(model, base, ids, mask, positions, lora)

    def reference(base, ids, mask, positions=None):
        return _hidden_and_head(model, base, ids, mask, positions)

    def policy_prefix(lora, base, *prompt_and_completion):
        return _prefix_hidden_and_head(model, base, *prompt_and_completion, lora=lora)

    reference_prefix = functools.partial(_prefix_hidden_and_head, model)
    return HiddenFn(policy, policy_prefix), HiddenFn(reference, reference_prefix)


def full_apply_fn(model) -> tuple[HiddenFn, HiddenFn]:
    """(policy, reference) hidden-state functions for full fine-tuning; ``frozen`` holds the reference params."""

    def policy(params, reference_params, ids, mask, positions=None):
        del reference_params
        return _hidden_and_head(model, params, ids, mask, positions)

    def policy_prefix(params, reference_params, *prompt_and_completion):
        del reference_params
        return _prefix_hidden_and_head(model, params, *prompt_and_completion)

    reference = functools.partial(_hidden_and_head, model)
    reference_prefix = functools.partial(_prefix_hidden_and_head, model)
    return HiddenFn(policy, policy_prefix), HiddenFn(reference, reference_prefix)
