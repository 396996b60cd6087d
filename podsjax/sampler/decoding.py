"""What generation traces: the token draw, the layer kinds the sampler runs, and the prefill and
decode bodies (``podsjax.sampler.sampler_programs`` compiles them; ``podsjax.sampler.sampling`` runs them).

Rows are row-major by prompt: row p*n + j is sample j of prompt p.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from podsjax.devices import mesh as mesh_lib
from podsjax.models import cache as cache_lib
from podsjax.models import rollout
from podsjax.models.decoder import rollout_layers_for

# Below this (float32's smallest normal) a temperature is no number the sampler can divide by.
SMALLEST_TEMPERATURE = float(jnp.finfo(jnp.float32).tiny)


@flax.struct.dataclass
class Rollouts:
    """Sampled completions, row-major by prompt: row p*n + j is sample j of prompt p.

    Attributes:
      tokens: int32 [B*n, T]; positions after the first EOS hold the pad id.
      logprobs: float32 [B*n, T] log-probs of the sampled tokens under
        softmax(logits / temperature), before any top-p/top-k filtering (what
        the train step recomputes); temperature 0 reports temperature 1. None
        unless asked for (``generate(..., return_logprobs=True)``): the update
        recomputes them, so a training step does not pay a log-softmax per token.
      mask: bool [B*n, T], valid completion tokens up to and including the first EOS.
      lengths: int32 [B*n], number of valid tokens.
      truncated: bool [B*n], no EOS within T tokens.
    """

    tokens: jax.Array
    logprobs: jax.Array | None
    mask: jax.Array
    lengths: jax.Array
    truncated: jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings; all but ``temperature`` are static (each distinct one compiles once).

    Temperature is a traced input of the sampling program, so greedy and sampled calls of
    the same shape share one executable.
    """

    num_samples: int
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    return_logprobs: bool = False

    def __post_init__(self):
        for name in ("num_samples", "max_new_tokens", "top_k", "pad_token_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer; got {value!r}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1; got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {self.max_new_tokens}")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {self.temperature}")
        if 0 < self.temperature < SMALLEST_TEMPERATURE:
            raise ValueError(f"temperature {self.temperature} is below float32's smallest normal number "
                             f"({SMALLEST_TEMPERATURE:.4g}); use 0 for greedy")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off); got {self.top_k}")
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token (e.g. tokenizer.eos_token_id)")

    @property
    def program_key(self) -> SamplingConfig:
        """The fields the sampling program depends on: all but the temperature, a traced input."""
        return dataclasses.replace(self, temperature=1.0)


def filter_logits(logits_BV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Sets logits outside the top-k / nucleus to -inf (the highest one always survives)."""
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth_B1 = lax.top_k(logits_BV, top_k)[0][..., -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if top_p < 1.0:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[..., ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        # Mass strictly before each token; a token stays while that is < top_p.
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
    return logits_BV


def sample_tokens(logits_BV: jax.Array, key: jax.Array, temperature: jax.Array,
            cfg: SamplingConfig) -> tuple[jax.Array, jax.Array | None]:
    """One token per row and (with ``cfg.return_logprobs``) its log-prob under the
    unfiltered tempered policy.

    ``temperature`` is a traced scalar; 0 is greedy and reports log-probs at temperature 1.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    # A subnormal temperature counts as 0: XLA flushes it to 0 in some ops and not in others.
    greedy = temperature < SMALLEST_TEMPERATURE
    # Shifted by the row's max first, so a tiny temperature sends the others to -inf, never
    # the top logit to +inf (a NaN log-prob, or every logit -inf and token 0 drawn), and
    # tied top logits stay exact ties for the noise to break. The max costs a pass over
    # [B, V] that argmax(x + t * noise) would not, but that form rounds t * noise away
    # beside a large logit: at t 1e-8 two tied tokens came out 94:6.
    shifted_BV = logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)
    scaled_BV = shifted_BV / jnp.where(greedy, 1.0, temperature)
    # Both draws, then a select: XLA runs a lax.cond on a GPU by reading its predicate on the
    # host, a wait in every decode step. The extra draw is one pass over [B, V].
    sampled_B = jax.random.categorical(key, filter_logits(scaled_BV, cfg.top_k, cfg.top_p), axis=-1)
    tokens_B = jnp.where(greedy, jnp.argmax(logits_BV, axis=-1), sampled_B)
    if not cfg.return_logprobs:
        return tokens_B, None
    picked_B = jnp.take_along_axis(scaled_BV, tokens_B[:, None], axis=-1)[:, 0]
    # Each row's largest is already 0: its log-sum-exp needs no second max pass over [B, V].
    return tokens_B, picked_B - jnp.log(jnp.sum(jnp.exp(scaled_BV), axis=-1))


class Layers:
    """How the sampler runs the decoder: its KV cache and one forward over the weights it reads
    (the params and LoRA as they are, or ``rollout.rollout_weights``)."""

    def empty_cache(self, model, batch: int, max_len: int):
        raise NotImplementedError

    def cache_shardings(self, cache, mesh):
        raise NotImplementedError

    def forward(self, model, weights, ids_BL, mask_BL, cache, last_only: bool = False):
        raise NotImplementedError

    def prefill(self, model, weights, ids_BL, mask_BL, num_samples: int, max_new_tokens: int):
        """``(last logits [P, V], cache)``: each prompt run once, its KV shared by its samples
        (here repeated for them; the unrolled layout keeps one copy)."""
        b, prompt_len = ids_BL.shape
        cache = self.empty_cache(model, b, prompt_len + max_new_tokens)
        logits_BLV, cache = self.forward(model, weights, ids_BL, mask_BL, cache, last_only=True)
        return logits_BLV[:, -1], cache.repeat(num_samples)


class ScannedLayers(Layers):
    """The training layout: stacked params (+ LoRA) under the layer scan, a stacked cache."""

    def empty_cache(self, model, batch, max_len):
        return cache_lib.init_cache(model.config, batch, max_len, dtype=model.dtype)

    def cache_shardings(self, cache, mesh):
        return cache_lib.cache_shardings(cache, mesh)

    def forward(self, model, weights, ids_BL, mask_BL, cache, last_only=False):
        params, lora = weights
        out = model.apply({"params": params}, ids_BL, mask_BL, cache=cache, lora=lora,
                          logits_slice=slice(-1, None) if last_only else None)
        return out.logits_BLV, out.cache


class UnrolledLayers(Layers):
    """Merged per-layer weights and a per-layer cache (``podsjax.models.rollout``)."""

    def empty_cache(self, model, batch, max_len):
        return rollout.empty_cache(model.config, batch, max_len, model.dtype)

    def cache_shardings(self, cache, mesh):
        return rollout.cache_shardings(cache, mesh)

    def forward(self, model, weights, ids_BL, mask_BL, cache, last_only=False):
        return rollout.forward(model, weights, ids_BL, mask_BL, cache, last_only=last_only)

    def prefill(self, model, weights, ids_BL, mask_BL, num_samples, max_new_tokens):
        cache = self.empty_cache(model, *ids_BL.shape)
        logits_BLV, cache = self.forward(model, weights, ids_BL, mask_BL, cache, last_only=True)
        return logits_BLV[:, -1], rollout.GroupedCache.start(cache, num_samples, max_new_tokens)


_LAYERS = {"scanned": ScannedLayers(), "unrolled": UnrolledLayers()}


def layers_for(model) -> Layers:
    return _LAYERS[rollout_layers_for(model.rollout_layers, mesh_lib.platform(model.mesh))]


@flax.struct.dataclass
class _Carry:
    step: jax.Array
    token_B: jax.Array  # sampled for this step, not yet written
    logprob_B: jax.Array | None
    tokens_BT: jax.Array
    logprobs_BT: jax.Array | None
    done_B: jax.Array
    cache: Any


def prefill(model, num_samples: int, max_new_tokens: int, weights, prompt_ids_BL, prompt_mask_BL):
    """Prefills each prompt once and shares its cache and last logits across its n samples."""
    layers = layers_for(model)
    logits_PV, cache = layers.prefill(model, weights, prompt_ids_BL, prompt_mask_BL, num_samples, max_new_tokens)
    logits_BV = jnp.repeat(logits_PV, num_samples, axis=0)
    if model.mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, layers.cache_shardings(cache, model.mesh))
    return _constrain_rows(model, logits_BV), cache


def _constrain_rows(model, x):
    return mesh_lib.constrain(x, model.mesh, ("batch",) + (None,) * (x.ndim - 1))


# Decode steps run between two checks of the loop's stop condition. A GPU runs a
# while_loop whose length depends on data by copying the condition to the host and
# waiting for it every iteration, so the device drains and then waits on the host's
# launches once per check; a loop of a fixed count inside runs without that wait.
# Rows that finish mid-chunk run on masked, as at most this many - 1 extra steps.
MAX_STEPS_PER_CHECK = 8


def steps_per_check(max_new_tokens: int) -> int:
    """Decode steps between two stop checks: the largest divisor of ``max_new_tokens`` up to
    :data:`MAX_STEPS_PER_CHECK`, so no chunk runs past the last step."""
    return max(k for k in range(1, MAX_STEPS_PER_CHECK + 1) if max_new_tokens % k == 0)


def sample(model, cfg: SamplingConfig, weights, prompt_ids_BL, prompt_mask_BL, key, temperature) -> Rollouts:
    """Prefill and decode as one program: the KV cache is made and used up inside it, in the
    layout the compiler picks for the decode loop (a TPU packs kv heads with head_dim), with
    no copy at a program's edge; one program per shape serves rollouts and evaluation alike."""
    logits_BV, cache = prefill(model, cfg.num_samples, cfg.max_new_tokens, weights, prompt_ids_BL, prompt_mask_BL)
    return decode(model, cfg, weights, logits_BV, cache, key, temperature)


def decode(model, cfg: SamplingConfig, weights, logits_BV, cache, key, temperature) -> Rollouts:
    """Samples up to T tokens per row in one while_loop, :func:`steps_per_check` steps an
    iteration (a loop of that fixed count inside), the cache updated in place."""
    rows, t_max = logits_BV.shape[0], cfg.max_new_tokens
    eos_E = jnp.asarray(cfg.eos_token_ids, jnp.int32)
    chunk = steps_per_check(t_max)

    def cond(c: _Carry):
        return (c.step < t_max) & ~jnp.all(c.done_B)

    def draw(logits_BV, step):
        token_B, logprob_B = sample_tokens(logits_BV, jax.random.fold_in(key, step), temperature, cfg)
        return _constrain_rows(model, token_B), logprob_B

    def body(c: _Carry) -> _Carry:
        # The next token is drawn in the step that computes its logits, so the [B, V]
        # logits never enter the loop state (the state's copy was a large share of a step).
        token_B = jnp.where(c.done_B, cfg.pad_token_id, c.token_B)
        done_B = c.done_B | jnp.any(token_B[:, None] == eos_E, axis=-1)
        tokens_BT = lax.dynamic_update_index_in_dim(c.tokens_BT, token_B, c.step, axis=1)
        logprobs_BT = None
        if cfg.return_logprobs:
            logprob_B = jnp.where(c.done_B, 0.0, c.logprob_B)
            logprobs_BT = lax.dynamic_update_index_in_dim(c.logprobs_BT, logprob_B, c.step, axis=1)
        # Finished rows still run (the batch is static) but write masked slots.
        logits_B1V, cache = layers_for(model).forward(model, weights, token_B[:, None], ~c.done_B[:, None], c.cache)
        next_B, next_logprob_B = draw(_constrain_rows(model, logits_B1V[:, 0]), c.step + 1)
        return _Carry(c.step + 1, next_B, next_logprob_B, tokens_BT, logprobs_BT, done_B, cache)

    first_B, first_logprob_B = draw(logits_BV, 0)
    init = _Carry(
        step=jnp.int32(0),
        token_B=first_B,
        logprob_B=first_logprob_B,
        tokens_BT=_constrain_rows(model, jnp.full((rows, t_max), cfg.pad_token_id, jnp.int32)),
        logprobs_BT=_constrain_rows(model, jnp.zeros((rows, t_max), jnp.float32)) if cfg.return_logprobs else None,
        done_B=_constrain_rows(model, jnp.zeros((rows,), bool)),
        cache=cache,
    )
    final = lax.while_loop(cond, lambda c: lax.fori_loop(0, chunk, lambda _, c: body(c), c), init)
    is_eos_BT = jnp.any(final.tokens_BT[..., None] == eos_E, axis=-1)
    # Valid: every step up to and including the first EOS, within the steps run.
    eos_before_BT = jnp.cumsum(is_eos_BT, axis=1) - is_eos_BT
    mask_BT = (eos_before_BT == 0) & (jnp.arange(t_max) < final.step)
    rollouts = Rollouts(
        tokens=jnp.where(mask_BT, final.tokens_BT, cfg.pad_token_id),
        logprobs=jnp.where(mask_BT, final.logprobs_BT, 0.0) if cfg.return_logprobs else None,
        mask=mask_BT,
        lengths=jnp.sum(mask_BT, axis=1, dtype=jnp.int32),
        truncated=~jnp.any(is_eos_BT & mask_BT, axis=1),
    )
    return rollouts
