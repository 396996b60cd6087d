"""Jit generation: prefill each prompt once, share its KV cache, decode in a while_loop.

Example:
    >>> rollouts = generate(model, params, ids_PL, mask_PL, jax.random.key(0),
    ...                     num_samples=16, max_new_tokens=512, temperature=0.9,
    ...                     eos_token_ids=(tokenizer.eos_token_id,))
    >>> rollouts.tokens.shape  # [P * 16, 512], rows p*16 .. p*16+15 belong to prompt p
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
import time
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podsjax import mesh as mesh_lib
from podsjax.models import cache as cache_lib
from podsjax.models import rollout
from podsjax.models.decoder import rollout_layers_for


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

    Temperature is a traced input of the decode program, so greedy evaluation and
    sampled rollouts of the same shape share one executable; ``num_samples`` only
    shapes the prefill.
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
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1; got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy); got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off); got {self.top_k}")
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token (e.g. tokenizer.eos_token_id)")

    @property
    def decode_key(self) -> SamplingConfig:
        """The fields the decode program depends on (temperature and sample count left out)."""
        return dataclasses.replace(self, num_samples=1, temperature=1.0)

    @property
    def prefill_key(self) -> tuple[int, int]:
        return self.num_samples, self.max_new_tokens


def _filter_logits(logits_BV: jax.Array, top_k: int, top_p: float) -> jax.Array:
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


def _sample(logits_BV: jax.Array, key: jax.Array, temperature: jax.Array,
            cfg: SamplingConfig) -> tuple[jax.Array, jax.Array | None]:
    """One token per row and (with ``cfg.return_logprobs``) its log-prob under the
    unfiltered tempered policy.

    ``temperature`` is a traced scalar; 0 is greedy and reports log-probs at temperature 1.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    greedy = temperature <= 0

    def scaled():
        return logits_BV / jnp.where(greedy, 1.0, temperature)

    def sampled():  # scaled inside the branch, so the draw reads the logits once
        return jax.random.categorical(key, _filter_logits(scaled(), cfg.top_k, cfg.top_p), axis=-1)

    tokens_B = lax.cond(greedy, lambda: jnp.argmax(logits_BV, axis=-1), sampled)
    if not cfg.return_logprobs:
        return tokens_B, None
    scaled_BV = scaled()
    picked_B = jnp.take_along_axis(scaled_BV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, picked_B - jax.nn.logsumexp(scaled_BV, axis=-1)


class _Layers:
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


class _Scanned(_Layers):
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


class _Unrolled(_Layers):
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


_LAYERS = {"scanned": _Scanned(), "unrolled": _Unrolled()}


def _layers(model) -> _Layers:
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


def _prefill(model, num_samples: int, max_new_tokens: int, weights, prompt_ids_BL, prompt_mask_BL):
    """Prefills each prompt once and shares its cache and last logits across its n samples."""
    layers = _layers(model)
    logits_PV, cache = layers.prefill(model, weights, prompt_ids_BL, prompt_mask_BL, num_samples, max_new_tokens)
    logits_BV = jnp.repeat(logits_PV, num_samples, axis=0)
    if model.mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, layers.cache_shardings(cache, model.mesh))
    return _constrain_rows(model, logits_BV), cache


def _constrain_rows(model, x):
    return mesh_lib.constrain(x, model.mesh, ("batch",) + (None,) * (x.ndim - 1))


def _decode(model, cfg: SamplingConfig, weights, logits_BV, cache, key, temperature) -> tuple[Rollouts, Any]:
    """Samples up to T tokens per row in one while_loop.

    The final cache is returned so the donated input cache aliases it and the
    loop updates one buffer in place.
    """
    rows, t_max = logits_BV.shape[0], cfg.max_new_tokens
    eos_E = jnp.asarray(cfg.eos_token_ids, jnp.int32)

    def cond(c: _Carry):
        return (c.step < t_max) & ~jnp.all(c.done_B)

    def draw(logits_BV, step):
        token_B, logprob_B = _sample(logits_BV, jax.random.fold_in(key, step), temperature, cfg)
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
        logits_B1V, cache = _layers(model).forward(model, weights, token_B[:, None], ~c.done_B[:, None], c.cache)
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
    final = lax.while_loop(cond, body, init)
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
    return rollouts, final.cache


def _signature(tree: Any, mesh: Mesh | None) -> tuple:
    """A hashable key of a tree's structure, shapes, dtypes and (under a mesh) partition specs.

    Concrete arrays and the dry run's ``ShapeDtypeStruct``s of the same placement give the
    same key, so the programs the dry run compiles are the ones the first step runs."""
    leaves, treedef = jax.tree.flatten(tree)

    def spec(x):
        sharding = getattr(x, "sharding", None)
        if mesh is None or sharding is None:
            return None
        parts = tuple(p[0] if isinstance(p, tuple) and len(p) == 1 else p
                      for p in getattr(sharding, "spec", (str(sharding),)))
        while parts and parts[-1] is None:
            parts = parts[:-1]
        return parts

    return treedef, tuple((tuple(x.shape), str(x.dtype), spec(x)) for x in leaves)


def _on_mesh(x: jax.ShapeDtypeStruct, mesh: Mesh | None) -> jax.ShapeDtypeStruct:
    """An input placed off the model's mesh (a LoRA tree made without one) is taken
    replicated on it; ``generate`` moves it there, as jit would."""
    sharding = x.sharding
    if mesh is None or (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def _cache_formats(layers: _Layers, cache, mesh: Mesh | None, layout) -> Any:
    """in/out shardings of a cache argument: ``layout(x, sharding)`` for its keys and values
    (every array of 4 or more dims), the others as the mesh places them."""
    shardings = layers.cache_shardings(cache, mesh) if mesh is not None else jax.tree.map(lambda _: None, cache)
    return jax.tree.map(lambda x, s: layout(x, s) if x.ndim >= 4 else s, cache, shardings,
                        is_leaf=lambda x: x is None)


_PROGRAMS: dict = {}  # compiled stages, keyed by model, static settings and input signatures
_MAX_PROGRAMS = 192  # the oldest go first (a run has a few prompt buckets, tests many models)
_LOCK = threading.RLock()


def _remember(key: tuple, value):
    _PROGRAMS[key] = value
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        del _PROGRAMS[next(iter(_PROGRAMS))]
    return value


def _compiled(key: tuple, build, timings: dict | None):
    if key not in _PROGRAMS:
        start = time.perf_counter()
        _remember(key, build())
        if timings is not None:
            timings[key[0]] = time.perf_counter() - start
    return _PROGRAMS[key]


def compiled_stages(model, cfg: SamplingConfig, params: Any, lora: Any, prompt_ids_BL: Any, *,
                    timings: dict | None = None):
    """The compiled ``(weights, prefill, decode)`` for these inputs (arrays or ``ShapeDtypeStruct``s).

    ``weights(params, lora) -> RolloutWeights`` (``podsjax.models.rollout``: merged, a
    buffer per layer), ``prefill(weights, ids_BL, mask_BL) -> (logits_BV, cache)`` and
    ``decode(weights, logits_BV, cache, key, temperature) -> (Rollouts, cache)``.

    Decode is compiled first with the KV cache's layout left to the compiler, and prefill
    then writes the cache in the layout decode chose. A while loop may want another layout
    than the default: XLA's TPU compiler packs kv heads with head_dim, and given a
    default-layout cache argument it copied the whole cache on the way in and out (decode
    temporaries as large as the cache). Each program compiles once per signature; greedy
    evaluation and sampled rollouts of the same row count share one decode program.

    Args:
        timings: filled with the seconds of each stage this call compiled.
    """
    return _stages(model, cfg, params, lora, prompt_ids_BL, timings)[:3]


def _stages(model, cfg: SamplingConfig, params, lora, prompt_ids_BL, timings):
    with _LOCK:  # one compile per program, whichever thread asks first
        return _stages_locked(model, cfg, params, lora, prompt_ids_BL, timings)


def _stages_locked(model, cfg: SamplingConfig, params, lora, prompt_ids_BL, timings):
    mesh: Mesh | None = model.mesh
    params, lora = jax.tree.map(lambda x: _on_mesh(mesh_lib.abstract(x), mesh), (params, lora))
    ids = jax.ShapeDtypeStruct(tuple(prompt_ids_BL.shape), jnp.int32)
    inputs = (_signature(params, mesh), _signature(lora, mesh))
    call = ("stages", model, cfg.prefill_key, cfg.decode_key, inputs, ids.shape)
    if call in _PROGRAMS:  # the steady state: no tracing, no lookups by abstract values
        return _PROGRAMS[call]
    layers = _layers(model)
    weights_fn, weights = None, (params, lora)  # the scanned layout reads the params themselves
    if isinstance(layers, _Unrolled):
        merge = functools.partial(rollout.rollout_weights, model)
        weights = jax.eval_shape(merge, params, lora)
        placed = rollout.weights_shardings(weights, mesh) if mesh is not None else None
        if mesh is not None:
            weights = jax.tree.map(lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p), weights, placed)

        def build_weights():
            return jax.jit(merge, out_shardings=placed).lower(params, lora).compile()

        weights_fn = _compiled(("weights", model) + inputs, build_weights, timings)
    prefill_fn = functools.partial(_prefill, model, *cfg.prefill_key)
    logits, cache = jax.eval_shape(prefill_fn, weights, ids, ids)
    if mesh is not None:
        logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=mesh_lib.batch_sharding(mesh, logits.ndim))
        cache = jax.tree.map(lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p), cache,
                             layers.cache_shardings(cache, mesh))
    key_sig = _signature(weights, mesh)

    def build_decode():
        auto = _cache_formats(layers, cache, mesh, lambda x, s: Format(Layout.AUTO, s))
        fn = jax.jit(functools.partial(_decode, model, cfg.decode_key), donate_argnums=2,
                     in_shardings=(None, None, auto, None, None), out_shardings=(None, auto))
        key = jax.eval_shape(lambda: jax.random.key(0))
        return fn.lower(weights, logits, cache, key, jax.ShapeDtypeStruct((), jnp.float32)).compile()

    # Keyed without the prompt count: evaluation and rollouts with as many rows share it.
    decode = _compiled(("decode", model, cfg.decode_key, key_sig, _signature((logits, cache), mesh)), build_decode,
                       timings)

    def build_prefill():
        chosen = iter(f for x, f in zip(jax.tree.leaves(cache), jax.tree.leaves(decode.input_formats[0][2]))
                      if x.ndim >= 4)
        # Prompt rows placed as hosts.place_rows places them on every process.
        rows = mesh_lib.rows_sharding(mesh, ids.shape[0], ids.ndim) if mesh is not None else None
        fn = jax.jit(prefill_fn, in_shardings=(None, rows, rows),
                     out_shardings=(getattr(logits, "sharding", None),
                                    _cache_formats(layers, cache, mesh, lambda x, s: next(chosen))))
        return fn.lower(weights, ids, ids).compile()

    prefill = _compiled(("prefill",) + call[1:], build_prefill, timings)
    return _remember(call, (weights_fn, prefill, decode, cache))


def compile_generate(model, params, lora, *, prompts: int, prompt_len: int, num_samples: int, max_new_tokens: int,
                     top_p: float = 1.0, top_k: int = 0, eos_token_ids=(0,), pad_token_id: int = 0) -> dict:
    """Compiles the generation stages ahead of time for one prompt shape.

    ``params`` and ``lora`` may be concrete or ``jax.ShapeDtypeStruct`` trees (with
    shardings under a mesh), so the memory of a run can be known before any weight is
    loaded. A later :func:`generate` of the same shapes runs these programs.

    Returns:
        ``{"weights": Compiled or None, "prefill": Compiled, "decode": Compiled,
        "kv_cache_bytes": int, "rollout_weights_bytes": int, "weights_read_bytes": int,
        "compile_s": {"weights": s, "prefill": s, "decode": s}}``, bytes per device (0 s for
        a program compiled before). ``weights`` merges the unrolled layout's rollout
        weights (None for the scanned layout, whose decode reads the params themselves).
    """
    cfg = SamplingConfig(num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=1.0, top_p=top_p,
                         top_k=top_k, eos_token_ids=tuple(eos_token_ids), pad_token_id=pad_token_id)
    timings = {"weights": 0.0, "prefill": 0.0, "decode": 0.0}
    weights, prefill, decode, cache = _stages(model, cfg, params, lora,
                                              jax.ShapeDtypeStruct((prompts, prompt_len), jnp.int32), timings)
    # The cache as the device stores it: decode's donated input (a TPU layout pads head_dim
    # 64 to 128 lanes); the logical size where the backend reports no aliasing.
    analysis = decode.memory_analysis()
    stored = int(analysis.alias_size_in_bytes) if analysis is not None else 0
    # What decode reads of the weights: the unrolled layout's copy, or the params themselves.
    read = mesh_lib.bytes_per_device(weights.out_info if weights is not None else (params, lora))
    return {"weights": weights, "prefill": prefill, "decode": decode,
            "kv_cache_bytes": stored or mesh_lib.bytes_per_device(cache),
            "rollout_weights_bytes": read if weights is not None else 0, "weights_read_bytes": read,
            "compile_s": timings}


def _placed(tree: Any, shardings: Any) -> Any:
    """``tree`` on the shardings a compiled program takes (it does not move its inputs
    itself, as ``jax.jit`` would). Arrays across processes are left as they are: the loop
    places them (``hosts.place_rows``)."""
    def place(x, sharding):
        if x is None or (isinstance(x, jax.Array) and (not x.is_fully_addressable or x.sharding == sharding)):
            return x
        return jax.device_put(x, sharding)

    return jax.tree.map(place, tree, shardings, is_leaf=lambda x: x is None)


def generate(
    model,
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

    Each prompt is prefilled once; its KV cache is repeated for its samples
    and donated to the decode stage, which runs one ``lax.while_loop`` that stops when every row has
    emitted an EOS or ``max_new_tokens`` are done. With ``model.mesh`` set the
    prompt batch is sharded over the mesh's batch axes. The same key gives the
    same rollouts; prompts of a new padded length compile once more, so bucket
    lengths (``podsjax.prompts`` does).

    Args:
      model: a :class:`podsjax.models.Decoder`.
      params: its params.
      prompt_ids_BL: int [B, L] prompt tokens, left-padded.
      prompt_mask_BL: [B, L], 1 for real prompt tokens.
      key: PRNG key.
      num_samples: n, completions per prompt.
      max_new_tokens: T.
      temperature: sampling temperature; 0 is greedy.
      top_p: nucleus mass kept (1 = off).
      top_k: keep the k most likely tokens (0 = off).
      eos_token_ids: an int or ints that end a completion.
      pad_token_id: fills positions after EOS.
      lora: optional LoRA params to sample from the adapted policy.
      return_logprobs: also return each sampled token's log-prob (``Rollouts.logprobs``;
        costs a log-softmax over the vocabulary per token).

    Returns:
      :class:`Rollouts` with B*n rows.
    """
    if isinstance(eos_token_ids, int):
        eos_token_ids = (eos_token_ids,)
    try:
        eos = tuple(operator.index(t) for t in eos_token_ids)
    except TypeError:
        raise TypeError(f"eos_token_ids must be ints; got {eos_token_ids!r}") from None
    cfg = SamplingConfig(
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        eos_token_ids=eos,
        pad_token_id=int(pad_token_id),
        return_logprobs=bool(return_logprobs),
    )
    prompt_ids_BL = jnp.asarray(prompt_ids_BL)
    prompt_mask_BL = jnp.asarray(prompt_mask_BL)
    if prompt_ids_BL.ndim != 2 or prompt_mask_BL.shape != prompt_ids_BL.shape:
        raise ValueError(
            f"prompt ids and mask must both be [B, L]; got {prompt_ids_BL.shape} and {prompt_mask_BL.shape}"
        )
    if not jnp.issubdtype(prompt_ids_BL.dtype, jnp.integer):
        raise ValueError(f"prompt ids must be integers; got dtype {prompt_ids_BL.dtype}")
    mesh: Mesh | None = model.mesh
    if mesh is not None:
        batch_shards = mesh_lib.shard_count(mesh, "batch")
        rows = prompt_ids_BL.shape[0] * num_samples
        if rows % batch_shards:
            raise ValueError(
                f"prompts x num_samples = {rows} rows must divide evenly over the mesh's "
                f"{batch_shards} batch shards (data x fsdp)"
            )
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # a jax.random.PRNGKey
    if key.shape != ():
        raise ValueError(f"key must be one PRNG key; got shape {key.shape}")
    weights_fn, prefill_fn, decode_fn = compiled_stages(model, cfg, params, lora, prompt_ids_BL)
    if weights_fn is not None:
        weights = weights_fn(*_placed((params, lora), weights_fn.input_shardings[0]))
    else:
        weights = _placed((params, lora), prefill_fn.input_shardings[0][0])
    prompt_ids_BL, prompt_mask_BL = _placed((prompt_ids_BL.astype(jnp.int32), prompt_mask_BL.astype(jnp.int32)),
                                            prefill_fn.input_shardings[0][1:])
    logits_BV, cache = prefill_fn(weights, prompt_ids_BL, prompt_mask_BL)
    rollouts, _ = decode_fn(weights, logits_BV, cache, key, jnp.float32(cfg.temperature))
    return rollouts
