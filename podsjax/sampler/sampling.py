"""Sampling from a policy: a :class:`Generator` owns its compiled programs and runs them.

Each prompt is prefilled once and its KV cache shared by its samples; decode runs in a
``while_loop`` of the same program (``podsjax.sampler.decoding`` holds the traced bodies,
``podsjax.sampler.sampler_programs`` compiles them once per signature).

Example:
    >>> gen = Generator(model)  # hold it: its programs are reused by every later call
    >>> rollouts = gen.generate(params, ids_PL, mask_PL, jax.random.key(0),
    ...                         num_samples=16, max_new_tokens=512, temperature=0.9,
    ...                         eos_token_ids=(tokenizer.eos_token_id,))
    >>> rollouts.tokens.shape  # [P * 16, 512], rows p*16 .. p*16+15 belong to prompt p
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from podsjax.devices import mesh as mesh_lib
from podsjax.models import token_ids
from podsjax.sampler import sampler_programs
from podsjax.sampler.decoding import Rollouts, SamplingConfig

__all__ = ["Generator", "Rollouts", "SamplingConfig", "generate"]


class Generator:
    """Samples completions from one model and owns the programs it compiles for that.

    Each program (the unrolled layout's rollout weights, sampling) compiles once per
    signature of its inputs and is kept, the oldest dropped past ``max_programs``; a lock
    makes each compile happen once when several threads ask. Two generators share nothing.
    ``compiler_options`` (XLA's debug options by name, e.g. ``{"xla_gpu_autotune_level": 0}``)
    go to each of its compiles.

    Attributes:
        model: the :class:`podsjax.models.Decoder` sampled from (its ``mesh`` places the rows).
    """

    def __init__(self, model, max_programs: int = 192, compiler_options: dict | None = None):
        self.model = model
        self._programs = sampler_programs.Programs(max_programs, compiler_options)

    @property
    def compiles(self) -> dict[str, int]:
        """Programs this generator compiled so far, per stage ("weights", "sample")."""
        return {stage: self._programs.compiles[stage] for stage in sampler_programs.STAGES}

    def stages(self, cfg: SamplingConfig, params: Any, lora: Any, prompt_ids_BL: Any, *,
               timings: dict | None = None) -> tuple:
        """The compiled ``(weights, sample)`` for these inputs (arrays or ``ShapeDtypeStruct``s).

        ``weights(params, lora) -> RolloutWeights`` (``podsjax.models.rollout``: merged, a
        buffer per layer; None for the scanned layout, whose decode reads the params
        themselves) and ``sample(weights, ids_BL, mask_BL, key, temperature) -> Rollouts``
        (prefill and decode in one program, ``podsjax.sampler.sampler_programs``).

        Args:
            timings: filled with the seconds of each stage this call compiled.
        """
        return sampler_programs.stages(self._programs, self.model, cfg, params, lora, prompt_ids_BL, timings)[:2]

    def compile(self, params: Any, lora: Any, *, prompts: int, prompt_len: int, num_samples: int,
                max_new_tokens: int, top_p: float = 1.0, top_k: int = 0, eos_token_ids=(0,),
                pad_token_id: int = 0, return_logprobs: bool = False) -> dict:
        """Compiles the generation stages ahead of time for one prompt shape.

        ``params`` and ``lora`` may be concrete or ``jax.ShapeDtypeStruct`` trees (with
        shardings under a mesh), so the memory of a run can be known before any weight is
        loaded. A later :meth:`generate` of the same shapes runs these programs.

        Returns:
            ``{"weights": Compiled or None, "sample": Compiled, "kv_cache_bytes": int,
            "rollout_weights_bytes": int, "weights_read_bytes": int,
            "compile_s": {"weights": s, "sample": s}}``, bytes per device (0 s for a program
            compiled before). ``weights`` merges the unrolled layout's rollout weights (None for
            the scanned layout, whose decode reads the params themselves); the KV cache lives
            inside ``sample``, among its temporaries.
        """
        cfg = self._config(num_samples, max_new_tokens, 1.0, top_p, top_k, eos_token_ids, pad_token_id,
                           return_logprobs)
        prompts, prompt_len = _index(prompts, "prompts"), _index(prompt_len, "prompt_len")
        if prompts < 1 or prompt_len < 1:
            raise ValueError(f"prompts and prompt_len must be >= 1; got {prompts} and {prompt_len}")
        timings = dict.fromkeys(sampler_programs.STAGES, 0.0)
        weights, sample, cache = sampler_programs.stages(
            self._programs, self.model, cfg, params, lora, jax.ShapeDtypeStruct((prompts, prompt_len), jnp.int32),
            timings)
        # What decode reads of the weights: the unrolled layout's copy, or the params themselves.
        read = mesh_lib.bytes_per_device(weights.out_info if weights is not None else (params, lora))
        return {"weights": weights, "sample": sample, "kv_cache_bytes": mesh_lib.bytes_per_device(cache),
                "rollout_weights_bytes": read if weights is not None else 0, "weights_read_bytes": read,
                "compile_s": timings}

    def _config(self, num_samples, max_new_tokens, temperature, top_p, top_k, eos_token_ids, pad_token_id,
                return_logprobs) -> SamplingConfig:
        """The sampling options, each checked by name (one line for a wrong kind or range)."""
        if isinstance(eos_token_ids, (int, np.integer)) or getattr(eos_token_ids, "ndim", None) == 0:
            eos_token_ids = (eos_token_ids,)  # one id (a NumPy int too); any other iterable is ids
        try:
            eos = tuple(operator.index(t) for t in eos_token_ids)
        except TypeError:
            raise TypeError(f"eos_token_ids must be ints; got {eos_token_ids!r}") from None
        # An id past int32 is outside every vocabulary, so it never ends a completion, as -1 never
        # does; as itself it had failed inside the trace (int32 overflow).
        eos = tuple(t if -2**31 <= t < 2**31 else -1 for t in eos)
        cfg = SamplingConfig(
            num_samples=_index(num_samples, "num_samples"),
            max_new_tokens=_index(max_new_tokens, "max_new_tokens"),
            temperature=_number(temperature, "temperature"),
            top_p=_number(top_p, "top_p"),
            top_k=_index(top_k, "top_k"),
            eos_token_ids=eos,
            pad_token_id=_index(pad_token_id, "pad_token_id"),
            return_logprobs=_flag(return_logprobs, "return_logprobs"),
        )
        vocab = self.model.config.vocab_size
        if not 0 <= cfg.pad_token_id < vocab:  # it fills the rows' ends, which a tokenizer then decodes
            raise ValueError(f"pad_token_id must be a token id in [0, {vocab}); got {cfg.pad_token_id}")
        return cfg

    def place_rows(self, x: Any) -> jax.Array:
        """A ``[B, ...]`` host array that every process holds whole, as one global array: split
        over the mesh's batch axes when its rows divide evenly, else replicated (as prefill
        takes its prompts). Each process transfers only the rows its own devices hold; an
        array already spread over processes is returned as it is."""
        return _place_rows(x, self.model.mesh)

    def generate(
        self,
        params: Any,
        prompt_ids_BL: jax.Array,
        prompt_mask_BL: jax.Array,
        key: jax.Array,
        *,
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_token_ids,
        pad_token_id: int = 0,
        lora=None,
        return_logprobs: bool = False,
    ) -> Rollouts:
        """Samples ``num_samples`` completions per left-padded prompt.

        Each prompt is prefilled once and its KV cache shared by its samples; in the same
        program a ``lax.while_loop`` decodes until every row has emitted an EOS or
        ``max_new_tokens`` are done. With ``model.mesh`` set the
        prompt batch is sharded over the mesh's batch axes (:meth:`place_rows`). The same key gives the
        same rollouts; prompts of a new padded length compile once more, so bucket
        lengths (``podsjax.data.prompts`` does).

        Args:
          params: the model's params.
          prompt_ids_BL: int [B, L] prompt tokens, left-padded.
          prompt_mask_BL: [B, L], 1 (nonzero) for real prompt tokens.
          key: PRNG key.
          num_samples: n, completions per prompt.
          max_new_tokens: T.
          temperature: sampling temperature; 0 is greedy.
          top_p: nucleus mass kept (1 = off).
          top_k: keep the k most likely tokens (0 = off).
          eos_token_ids: an int or ints that end a completion (an id outside the vocabulary never
            does: EOS off).
          pad_token_id: fills positions after EOS.
          lora: optional LoRA params to sample from the adapted policy.
          return_logprobs: also return each sampled token's log-prob (``Rollouts.logprobs``;
            costs a log-softmax over the vocabulary per token).

        Returns:
          :class:`Rollouts` with B*n rows.
        """
        given = (params, lora, prompt_ids_BL, prompt_mask_BL, key, temperature, top_p, top_k)
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(given)):
            raise TypeError("Generator.generate runs compiled programs of its own: call it outside jax.jit, "
                            "grad and vmap (it was given traced values)")
        cfg = self._config(num_samples, max_new_tokens, temperature, top_p, top_k, eos_token_ids, pad_token_id,
                           return_logprobs)
        prompt_ids_BL = token_ids.as_ids(prompt_ids_BL, self.model.config.vocab_size, "prompt")  # pads' ids too
        try:
            prompt_mask_BL = jnp.asarray(prompt_mask_BL)
        except TypeError:  # text, objects
            raise ValueError(f"the prompt mask must be numbers (nonzero: a real token); got "
                             f"{np.asarray(prompt_mask_BL).dtype} values") from None
        if prompt_ids_BL.ndim != 2 or prompt_mask_BL.shape != prompt_ids_BL.shape:
            raise ValueError(
                f"prompt ids and mask must both be [B, L]; got {prompt_ids_BL.shape} and {prompt_mask_BL.shape}"
            )
        if not jnp.issubdtype(prompt_ids_BL.dtype, jnp.integer):
            raise ValueError(f"prompt ids must be integers; got dtype {prompt_ids_BL.dtype}")
        if jnp.issubdtype(prompt_mask_BL.dtype, jnp.floating):
            prompt_mask_BL = prompt_mask_BL != 0  # nonzero is a real token, as the Decoder reads it
        if not (prompt_mask_BL.dtype == jnp.bool_ or jnp.issubdtype(prompt_mask_BL.dtype, jnp.integer)):
            raise ValueError(f"the prompt mask must be bool, integer or float (nonzero: a real token); "
                             f"got dtype {prompt_mask_BL.dtype}")
        if 0 in prompt_ids_BL.shape:
            raise ValueError(f"prompts must hold at least one row and one position; got shape {prompt_ids_BL.shape}")
        _check_left_padded(prompt_mask_BL)
        mesh: Mesh | None = self.model.mesh
        if mesh is not None:
            batch_shards = mesh_lib.shard_count(mesh, "batch")
            rows = prompt_ids_BL.shape[0] * num_samples
            if rows % batch_shards:
                raise ValueError(
                    f"prompts x num_samples = {rows} rows must divide evenly over the mesh's "
                    f"{batch_shards} batch shards (data x fsdp)"
                )
        if not isinstance(key, jax.Array):
            raise TypeError(f"key must be a PRNG key (jax.random.key(seed)); got {type(key).__name__}")
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            if key.dtype != jnp.uint32 or key.shape != (2,):
                raise ValueError(f"key must be a PRNG key (jax.random.key(seed)) or jax.random.PRNGKey's uint32[2]; "
                                 f"got {key.dtype}{list(key.shape)}")
            key = jax.random.wrap_key_data(key)  # a jax.random.PRNGKey
        if key.shape != ():
            raise ValueError(f"key must be one PRNG key; got shape {key.shape}")
        weights_fn, sample_fn = self.stages(cfg, params, lora, prompt_ids_BL)
        if weights_fn is not None:
            weights = weights_fn(*_placed((params, lora), weights_fn.input_shardings[0]))
        else:
            weights = _placed((params, lora), sample_fn.input_shardings[0][0])
        prompt_ids_BL, prompt_mask_BL = (self.place_rows(x.astype(jnp.int32)) for x in (prompt_ids_BL, prompt_mask_BL))
        return sample_fn(weights, prompt_ids_BL, prompt_mask_BL, key, jnp.float32(cfg.temperature))


def _place_rows(x: Any, mesh: Mesh | None) -> jax.Array:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x  # already global: every process placed its rows
    if mesh is None:
        return jnp.asarray(x)
    sharding = mesh_lib.rows_sharding(mesh, x.shape[0], x.ndim)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _placed(tree: Any, shardings: Any) -> Any:
    """``tree`` (the params and LoRA) on the shardings a compiled program takes (it does not
    move its inputs itself, as ``jax.jit`` would). Arrays across processes are left as they are."""
    def place(x, sharding):
        if x is None or (isinstance(x, jax.Array) and (not x.is_fully_addressable or x.sharding == sharding)):
            return x
        return jax.device_put(x, sharding)

    return jax.tree.map(place, tree, shardings, is_leaf=lambda x: x is None)


def _number(value, name: str) -> float:
    """``value`` as a float; a string, bool, None or array is a one-line error naming ``name``."""
    if value is None or isinstance(value, (bool, str)) or np.ndim(value) != 0:
        raise ValueError(f"{name} must be a number; got {value!r}")
    return float(value)


def _flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):  # bool("no") is True
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return bool(value)


def _index(value, name: str) -> int:
    """``value`` as an int; a float, string or bool is a one-line error naming ``name``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer; got {value!r}") from None


def _check_left_padded(mask_BL: jax.Array) -> None:
    """Left padding, checked on the host where the prompts are at hand (not under a trace, nor
    when spread over several processes): a right-padded row would continue from a pad slot.
    (The ids are checked against the vocabulary as they come in: ``token_ids.as_ids``.)"""
    if not token_ids.concrete(mask_BL):
        return
    mask = np.asarray(mask_BL) != 0
    if not mask[:, -1].all():
        row = int(np.argmin(mask[:, -1]))
        raise ValueError(f"prompts must be left-padded, each row's last position a real token (mask 1); row {row} "
                         f"ends in padding{' (it has no real token)' if not mask[row].any() else ''}")


def generate(model, params: Any, prompt_ids_BL: jax.Array, prompt_mask_BL: jax.Array, key: jax.Array,
             **options) -> Rollouts:
    """``Generator(model).generate(params, prompt_ids_BL, prompt_mask_BL, key, **options)``: one call.

    The options are :meth:`Generator.generate`'s (``num_samples``, ``max_new_tokens``,
    ``temperature``, ``eos_token_ids``, ...). It builds a new :class:`Generator`, so every
    call compiles; hold a Generator to reuse its programs.
    """
    return Generator(model).generate(params, prompt_ids_BL, prompt_mask_BL, key, **options)
