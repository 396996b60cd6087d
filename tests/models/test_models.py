"""Decoder numerics: parity with transformers, padding, KV cache, LoRA, jit, checkpoint shapes.

Tiny random HF models are built locally once per session. Their weights are re-drawn at
a scale that makes logits O(1) (HF's default init gives logits near 0, where a 1e-4
tolerance would prove little), and norms/biases are randomised too so a wrong mapping
of any of them shows up.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import podsjax.models as pm

VOCAB = 256
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# Every family/feature combination the decoder supports: Qwen2 q/k/v bias, llama3 RoPE,
# GQA (K < H, including K = 1), MHA, head_dim != D / H, tied and untied heads.
CONFIGS = {
    "qwen2_tied_gqa": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                           tie_word_embeddings=True)),
    "qwen2_untied_mha": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4,
                                                             tie_word_embeddings=False, rope_theta=1e6)),
    "llama_untied_mqa_llama3": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5)),
    "llama_tied_gqa_llama3": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5)),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Redraws every weight so logits are O(1).

    Embeddings ~ N(0, 0.25^2), other matrices ~ N(0, 1/fan_in), norms ~ U(0.5, 1.5),
    biases ~ N(0, 0.3).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                std = 0.25 if "embed_tokens" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def build_hf(path, name: str, seed: int = 0):
    config_cls, model_cls, extra = CONFIGS[name]
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        max_position_embeddings=256, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    return model_cls.from_pretrained(path, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """name -> (checkpoint dir, HF torch model, podsjax model, params), built once."""
    out = {}
    for i, name in enumerate(CONFIGS):
        path = tmp_path_factory.mktemp(name)
        hf = build_hf(path, name, seed=i)
        model, params = pm.from_pretrained(path, dtype=jnp.float32)
        out[name] = (path, hf, model, params)
    return out


@pytest.fixture(scope="session")
def jit_apply():
    """One jitted apply per model (Decoder is hashable, so it is a static arg)."""
    return jax.jit(lambda model, params, ids, mask: model.apply({"params": params}, ids,
                                                                attention_mask=mask).logits_BLV,
                   static_argnums=0)


def hf_logits(hf, ids_BL, mask_BL=None, position_ids=None):
    with torch.no_grad():
        kwargs = {} if mask_BL is None else {"attention_mask": torch.tensor(mask_BL)}
        if position_ids is not None:
            kwargs["position_ids"] = torch.tensor(position_ids)
        return hf(torch.tensor(ids_BL), **kwargs).logits.numpy()


def random_ids(seed, *shape):
    return np.random.RandomState(seed).randint(0, VOCAB, shape).astype(np.int32)


# --------------------------------------------------------------------------- config


def test_from_hf_config_reads_every_feature(hf_models):
    qwen = pm.from_hf_config(hf_models["qwen2_tied_gqa"][0])
    assert (qwen.arch, qwen.qkv_bias, qwen.tie_word_embeddings) == ("qwen2", True, True)
    assert (qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (4, 2, 16)
    llama = pm.from_hf_config(hf_models["llama_untied_mqa_llama3"][0])
    assert (llama.arch, llama.qkv_bias, llama.tie_word_embeddings) == ("llama", False, False)
    assert (llama.num_kv_heads, llama.head_dim, llama.rms_norm_eps, llama.rope_theta) == (1, 32, 1e-5, 500000.0)
    assert llama.rope_scaling == pm.Llama3RopeScaling(8.0, 1.0, 4.0, 64)


def test_from_hf_config_accepts_legacy_hub_layout():
    # Hub checkpoints (transformers 4.x) keep rope_theta at the top and "type" in rope_scaling.
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
          "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
          "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
          "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}, "max_position_embeddings": 131072,
          "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
    config = pm.from_hf_config(hf)
    assert config == pm.checkpoint_shape("meta-llama/Llama-3.2-1B-Instruct")
    hash(config)  # usable as a jit static


@pytest.mark.parametrize(
    "override, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"),
        ({"architectures": ["MistralForCausalLM"]}, "supports"),
        ({"use_sliding_window": True}, "sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ],
)
def test_unsupported_configs_raise_clear_errors(override, message):
    hf = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **override}
    with pytest.raises(ValueError, match=message):
        pm.from_hf_config(hf)


def test_model_config_validation():
    base = pm.checkpoint_shape("Qwen2.5-0.5B")
    with pytest.raises(ValueError, match="hidden_size"):
        pm.ModelConfig(**{**base.__dict__, "hidden_size": 0})
    with pytest.raises(ValueError, match="arch"):
        pm.ModelConfig(**{**base.__dict__, "arch": "gpt2"})
    with pytest.raises(ValueError, match="unknown checkpoint shape"):
        pm.checkpoint_shape("Qwen2.5-14B")


# Published parameter counts of the real checkpoints.
PRESET_PARAMS = {"Qwen2.5-0.5B": 494_032_768, "Qwen2.5-1.5B": 1_543_714_304, "Qwen2.5-3B": 3_085_938_688,
                 "Qwen2.5-7B": 7_615_616_512, "Llama-3.2-1B": 1_235_814_400, "Llama-3.2-3B": 3_212_749_824}


@pytest.mark.parametrize("name", sorted(PRESET_PARAMS))
def test_presets_build_abstractly_with_published_sizes(name):
    model = pm.Decoder(pm.checkpoint_shape(name), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    shapes = pm.abstract_params(model)  # eval_shape: nothing is allocated
    leaves = jax.tree.leaves(shapes)
    assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.bfloat16 for x in leaves)
    assert sum(x.size for x in leaves) == PRESET_PARAMS[name] == model.config.num_params


# --------------------------------------------------------------------------- numerics


def test_llama3_rope_frequencies_match_transformers(hf_models):
    hf = hf_models["llama_untied_mqa_llama3"][1]
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    ours = pm.rope_inv_freq(pm.from_hf_config(hf_models["llama_untied_mqa_llama3"][0]))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=0)
    # The three llama3 bands are all exercised by this config (else the test proves little).
    plain = pm.rope_inv_freq(pm.ModelConfig(**{**pm.from_hf_config(hf.config.to_dict()).__dict__,
                                               "rope_scaling": None}))
    ratio = plain / ours
    assert np.isclose(ratio, 1.0).any() and np.isclose(ratio, 8.0).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_fp32(hf_models, jit_apply, name):
    _, hf, model, params = hf_models[name]
    ids_BL = random_ids(1, 2, 48)
    ref = hf_logits(hf, ids_BL)
    ours = np.asarray(jit_apply(model, params, jnp.asarray(ids_BL), None))
    assert ours.dtype == np.float32
    assert ref.std() > 0.5  # logits at a scale where 1e-4 means something
    assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.parametrize("name", ["qwen2_tied_gqa", "llama_untied_mqa_llama3"])
def test_left_padded_batch_matches_unpadded_sequences(hf_models, jit_apply, name):
    _, hf, model, params = hf_models[name]
    lengths, width = [40, 23, 7], 40
    ids_BL = random_ids(2, len(lengths), width)  # pad slots hold random ids on purpose
    mask_BL = np.zeros_like(ids_BL)
    for row, n in enumerate(lengths):
        mask_BL[row, width - n:] = 1
    padded = np.asarray(jit_apply(model, params, jnp.asarray(ids_BL), jnp.asarray(mask_BL)))
    for row, n in enumerate(lengths):
        alone_hf = hf_logits(hf, ids_BL[row:row + 1, width - n:])[0]
        assert np.abs(padded[row, width - n:] - alone_hf).max() <= 1e-4
    assert np.isfinite(padded).all()  # fully masked pad queries must not produce NaN


def test_long_left_padded_batches_match_transformers(hf_models):
    _, hf, model, params = hf_models["qwen2_tied_gqa"]
    lengths, width = [256, 200, 131, 64, 9], 256
    ids_BL = random_ids(5, len(lengths), width)
    mask_BL = (np.arange(width)[None] >= width - np.asarray(lengths)[:, None]).astype(np.int32)
    logits = np.asarray(jax.jit(lambda p, i, m: model.apply({"params": p}, i, attention_mask=m).logits_BLV)(
        params, jnp.asarray(ids_BL), jnp.asarray(mask_BL)))
    for row, n in enumerate(lengths):
        alone_hf = hf_logits(hf, ids_BL[row:row + 1, width - n:])[0]
        assert np.abs(logits[row, width - n:] - alone_hf).max() <= 1e-4
    assert np.isfinite(logits).all()


def numpy_attention(q_BLHE, k_BSKE, v_BSKE, allowed_BLS):
    """Plain float64 softmax attention with K/V heads repeated for GQA: the reference."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_BLHE, k_BSKE, v_BSKE))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("blhe,bshe->bhls", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.asarray(allowed_BLS)[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhls,bshe->blhe", probs, v)


def attention_inputs(length=40, pad=13):
    b, h, k, e = 2, 4, 2, 8
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, length, h, e))
    kk = jax.random.normal(keys[1], (b, length, k, e))
    v = jax.random.normal(keys[2], (b, length, k, e))
    mask = jnp.ones((b, length), bool).at[1, :pad].set(False)  # a left-padded row
    causal = jnp.tril(jnp.ones((length, length), bool))[None]
    allowed = (causal & mask[:, None, :]) | jnp.eye(length, dtype=bool)[None]
    return q, kk, v, allowed


def test_attention_paths_match_a_numpy_reference_without_repeating_kv():
    from podsjax.models import decoder

    q, kk, v, allowed = attention_inputs()
    ref = numpy_attention(q, kk, v, allowed)
    flash_path = np.asarray(jax.jit(decoder.attend)(q, kk, v, allowed))
    cached_path = np.asarray(jax.jit(decoder.attend_cached)(q, kk.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                                            allowed))
    # The GPU's one-query path (sums over the cache instead of matmuls), run here on the CPU.
    one_query = np.asarray(jax.jit(functools.partial(decoder.attend_cached, platform="gpu"))(
        q[:, -1:], kk.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), allowed[:, -1:]))
    np.testing.assert_allclose(flash_path, ref, atol=1e-5)
    np.testing.assert_allclose(cached_path, ref, atol=1e-5)
    np.testing.assert_allclose(one_query, ref[:, -1:], atol=1e-5)
    # GQA reads each kv head as is: with 10 queries over 40 keys, no K or V of H = 4 heads
    # ([2, 40, 4, 8]) appears anywhere in the optimized program.
    hlo = jax.jit(decoder.attend).lower(q[:, -10:], kk, v, allowed[:, -10:]).compile().as_text()
    assert "f32[2,40,2,8]" in hlo and "[2,40,4,8]" not in hlo


@pytest.mark.parametrize("length, keys", [(77, 77), (10, 77), (77, 40)])
def test_attention_padded_to_even_lengths_gives_the_unpadded_result(length, keys):
    # cuDNN refuses odd lengths in its masked backward pass; its path pads them. Here the
    # padding wraps the XLA path, so the CPU checks it: padded keys are never attended,
    # the padded query is sliced off, and the gradients are those of the unpadded call.
    from podsjax.models import attention

    q, kk, v, allowed = attention_inputs(77, 13)
    q, allowed = q[:, -length:], allowed[:, -length:, :keys]
    kk, v = kk[:, :keys], v[:, :keys]
    allowed = allowed.at[:, :, 0].set(True)  # every query sees a key within the first `keys`

    def plain(q, k, v, allowed):
        return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None])

    def loss(fn, q, k, v):
        out = fn(q, k, v, allowed)
        return jnp.sum(jnp.sin(out)), out

    (_, want), want_grads = jax.value_and_grad(functools.partial(loss, plain), (0, 1, 2), has_aux=True)(q, kk, v)
    padded = attention._even_lengths(plain)
    (_, got), got_grads = jax.value_and_grad(functools.partial(loss, padded), (0, 1, 2), has_aux=True)(q, kk, v)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU")
def test_cudnn_attention_matches_the_xla_path_in_bf16():
    from podsjax.models import decoder

    q, kk, v, allowed = (x.astype(jnp.bfloat16) if x.dtype != bool else x for x in attention_inputs(256, 77))
    assert decoder.attention_implementation("auto", jnp.bfloat16, q.shape[-1]) == "cudnn"

    def loss(impl, q, kk, v):
        out = decoder.attend(q, kk, v, allowed, impl).astype(jnp.float32)
        return jnp.sum(out * out), out

    (xla_loss, xla_out), xla_grads = jax.jit(jax.value_and_grad(functools.partial(loss, "xla"), (0, 1, 2),
                                                                has_aux=True))(q, kk, v)
    (dnn_loss, dnn_out), dnn_grads = jax.jit(jax.value_and_grad(functools.partial(loss, "cudnn"), (0, 1, 2),
                                                                has_aux=True))(q, kk, v)
    np.testing.assert_allclose(np.asarray(dnn_out), np.asarray(xla_out), atol=2e-2)  # bf16 precision
    for got, ref in zip(dnn_grads, xla_grads):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=5e-2)


SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.slow
def test_optimized_program_size_does_not_grow_with_depth():
    config = dataclasses.replace(pm.checkpoint_shape("Qwen2.5-0.5B"), **SMALL)

    def hlo_size(layers):
        model = pm.Decoder(dataclasses.replace(config, num_layers=layers))
        params = pm.abstract_params(model)
        ids = jax.ShapeDtypeStruct((2, 32), jnp.int32)
        loss = lambda p, i: jnp.mean(model.apply({"params": p}, i).logits_BLV ** 2)  # noqa: E731
        return len(jax.jit(jax.value_and_grad(loss)).lower(params, ids).compile().as_text())

    shallow, deep = hlo_size(2), hlo_size(24)
    assert deep <= 1.5 * shallow, (shallow, deep)


def test_positions_come_from_the_attention_mask(hf_models):
    # RoPE is shift-invariant, so logits barely depend on a per-row position offset; check
    # the default positions bit-for-bit against explicit mask-derived ones instead.
    _, _, model, params = hf_models["llama_untied_mqa_llama3"]
    ids_BL = jnp.asarray(random_ids(13, 2, 12))
    mask_BL = jnp.ones((2, 12), jnp.int32).at[1, :5].set(0)
    from_mask_BL = jnp.asarray([list(range(12)), [0] * 5 + list(range(7))])
    run = jax.jit(lambda pos: model.apply({"params": params}, ids_BL, attention_mask=mask_BL,
                                          positions_BL=pos).logits_BLV)
    default = np.asarray(jax.jit(lambda: model.apply({"params": params}, ids_BL, attention_mask=mask_BL).logits_BLV)())
    np.testing.assert_array_equal(default, np.asarray(run(from_mask_BL)))
    shifted = np.asarray(run(jnp.broadcast_to(jnp.arange(12), (2, 12))))
    assert not np.array_equal(default[1, 5:], shifted[1, 5:])  # the check above can fail


def test_jit_matches_no_jit_and_does_not_recompile(hf_models):
    _, _, model, params = hf_models["qwen2_tied_gqa"]
    traces = []

    def forward(params, ids, mask):
        traces.append(1)
        return model.apply({"params": params}, ids, attention_mask=mask).logits_BLV

    jitted = jax.jit(forward)
    ids_BL, mask_BL = jnp.asarray(random_ids(3, 2, 16)), jnp.ones((2, 16), jnp.int32).at[0, :5].set(0)
    eager = np.asarray(forward(params, ids_BL, mask_BL))
    compiled = np.asarray(jitted(params, ids_BL, mask_BL))
    assert np.abs(eager - compiled).max() <= 1e-5
    new_params = jax.tree.map(lambda x: x * 1.01, params)
    second = jitted(new_params, jnp.asarray(random_ids(4, 2, 16)), mask_BL.at[1, :3].set(0))
    assert len(traces) == 2  # one eager run + one trace; new values reuse the executable
    assert not np.allclose(np.asarray(second), compiled)


def test_bf16_compute_with_fp32_params_stays_close_and_returns_fp32_logits(hf_models, jit_apply):
    path, _, model, params = hf_models["llama_tied_gqa_llama3"]
    bf16_model = pm.Decoder(model.config, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    ids_BL = jnp.asarray(random_ids(5, 2, 24))
    low = np.asarray(jit_apply(bf16_model, params, ids_BL, None))
    high = np.asarray(jit_apply(model, params, ids_BL, None))
    assert low.dtype == np.float32
    assert np.abs(low - high).max() < 0.25 * np.abs(high).max()  # bf16 noise, not a different model
    assert np.abs(low - high).max() > 0  # and bf16 really was used


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_gives_same_values_and_gradients(hf_models, remat):
    _, _, model, params = hf_models["qwen2_untied_mha"]
    ids_BL = jnp.asarray(random_ids(6, 2, 12))

    def loss(m):
        return jax.jit(jax.value_and_grad(lambda p: jnp.mean(m.apply({"params": p}, ids_BL).logits_BLV ** 2)))(params)

    (v0, g0), (v1, g1) = loss(model.clone(remat="none")), loss(model.clone(remat=remat))
    assert abs(float(v0) - float(v1)) <= 1e-6
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), g0, g1))
    assert max(diffs) <= 1e-6


def test_remat_and_attention_names_are_checked():
    with pytest.raises(ValueError, match="remat must be one of"):
        pm.Decoder(pm.checkpoint_shape("Qwen2.5-0.5B"), remat="some")
    with pytest.raises(ValueError, match="attention must be one of"):
        pm.Decoder(pm.checkpoint_shape("Qwen2.5-0.5B"), attention="flash")


# --------------------------------------------------------------------------- KV cache


@pytest.fixture(scope="session")
def cached_fns():
    prefill = jax.jit(lambda model, params, ids, mask, cache: pm.prefill(model, params, ids, mask, cache),
                      static_argnums=0)
    step = jax.jit(lambda model, params, tok, cache: pm.decode_step(model, params, tok, cache),
                   static_argnums=0, donate_argnums=3)
    return prefill, step


@pytest.mark.parametrize("name", ["qwen2_tied_gqa", "llama_untied_mqa_llama3"])
def test_prefill_then_decode_matches_full_forward(hf_models, jit_apply, cached_fns, name):
    _, _, model, params = hf_models[name]
    prefill, step = cached_fns
    prompt_lengths, width, new = [10, 6, 3], 10, 8
    ids_BT = random_ids(7, 3, width + new)
    mask_BT = np.ones_like(ids_BT)
    for row, n in enumerate(prompt_lengths):
        mask_BT[row, :width - n] = 0
    full = np.asarray(jit_apply(model, params, jnp.asarray(ids_BT), jnp.asarray(mask_BT)))

    cache = pm.init_cache(model.config, batch=3, max_len=width + new, dtype=jnp.float32)
    logits, cache = prefill(model, params, jnp.asarray(ids_BT[:, :width]), jnp.asarray(mask_BT[:, :width]), cache)
    got = [np.asarray(logits[:, -1])]
    for t in range(width, width + new - 1):
        logits_BV, cache = step(model, params, jnp.asarray(ids_BT[:, t:t + 1]), cache)
        got.append(np.asarray(logits_BV))
    want = full[:, width - 1:width + new - 1]
    assert np.abs(np.stack(got, axis=1) - want).max() <= 1e-5
    np.testing.assert_array_equal(np.asarray(cache.index_B), [width + new - 1] * 3)
    np.testing.assert_array_equal(np.asarray(cache.positions_B), np.array(prompt_lengths) + new - 1)


def test_prefill_last_only_equals_the_last_position_of_the_full_logits(hf_models, jit_apply):
    for name in ("qwen2_tied_gqa", "qwen2_untied_mha"):  # tied and untied heads
        _, _, model, params = hf_models[name]
        ids_BL = random_ids(15, 2, 9)
        mask_BL = np.ones_like(ids_BL)
        mask_BL[1, :5] = 0
        full = np.asarray(jit_apply(model, params, jnp.asarray(ids_BL), jnp.asarray(mask_BL)))
        cache = pm.init_cache(model.config, batch=2, max_len=12, dtype=jnp.float32)
        last, cache = jax.jit(lambda p, i, m, c: pm.prefill(model, p, i, m, c, last_only=True))(
            params, jnp.asarray(ids_BL), jnp.asarray(mask_BL), cache)
        assert last.shape == (2, 1, VOCAB)
        assert np.abs(np.asarray(last) - full[:, -1:]).max() <= 1e-5
        np.testing.assert_array_equal(np.asarray(cache.index_B), [9, 9])


def test_shared_prefill_repeated_over_samples_decodes_in_while_loop(hf_models, jit_apply, cached_fns):
    """The sampler's pattern: prefill P prompts once, repeat n times, decode in a loop."""
    _, _, model, params = hf_models["llama_tied_gqa_llama3"]
    prefill, _ = cached_fns
    num_prompts, n, width, new = 2, 3, 7, 5
    prompts_PL = random_ids(8, num_prompts, width)
    prompt_mask_PL = np.ones_like(prompts_PL)
    prompt_mask_PL[1, :4] = 0
    completions_BT = random_ids(9, num_prompts * n, new)

    @jax.jit
    def sample(params, prompts_PL, prompt_mask_PL, completions_BT):
        cache = pm.init_cache(model.config, num_prompts, width + new, jnp.float32)
        logits_PLV, cache = pm.prefill(model, params, prompts_PL, prompt_mask_PL, cache)
        cache = cache.repeat(n)
        first_BV = jnp.repeat(logits_PLV[:, -1], n, axis=0)

        def body(t, carry):
            cache, out_BTV = carry
            logits_BV, cache = pm.decode_step(model, params, completions_BT[:, t][:, None], cache)
            return cache, out_BTV.at[:, t + 1].set(logits_BV)

        out_BTV = jnp.zeros((num_prompts * n, new, VOCAB), jnp.float32).at[:, 0].set(first_BV)
        _, out_BTV = jax.lax.fori_loop(0, new - 1, body, (cache, out_BTV))
        return out_BTV

    got = np.asarray(sample(params, prompts_PL, prompt_mask_PL, completions_BT))
    full_ids = np.concatenate([np.repeat(prompts_PL, n, 0), completions_BT], axis=1)
    full_mask = np.concatenate([np.repeat(prompt_mask_PL, n, 0), np.ones_like(completions_BT)], axis=1)
    full = np.asarray(jit_apply(model, params, jnp.asarray(full_ids), jnp.asarray(full_mask)))
    assert np.abs(got - full[:, width - 1:width + new - 1]).max() <= 1e-5
    # Rows of one prompt share the prompt but not the completion.
    assert np.abs(got[0, 1:] - got[1, 1:]).max() > 1e-2


# --------------------------------------------------------------------------- LoRA


@jax.jit
def with_random_b(lora, seed):
    """A trained-looking adapter: B ~ N(0, 0.05^2) instead of its zero init."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(lora)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [
        0.05 * jax.random.normal(key, x.shape) if path[-1].key == "b" else x
        for key, (path, x) in zip(keys, leaves, strict=True)])


def test_lora_with_zero_b_equals_base_exactly(hf_models, jit_apply):
    _, _, model, params = hf_models["qwen2_tied_gqa"]
    lora = pm.init_lora(jax.random.key(0), model, pm.LoraConfig(rank=4, alpha=8.0))
    assert lora.scale == 2.0
    ids_BL = jnp.asarray(random_ids(10, 2, 16))
    mask_BL = jnp.ones((2, 16), jnp.int32).at[1, :4].set(0)
    apply = jax.jit(lambda p, adapters: model.apply({"params": p}, ids_BL, attention_mask=mask_BL,
                                                    lora=adapters).logits_BLV)
    base = np.asarray(jit_apply(model, params, ids_BL, mask_BL))
    np.testing.assert_array_equal(np.asarray(apply(params, lora)), base)
    assert all(float(jnp.abs(ab).max()) > 0 for ab in jax.tree.leaves(lora.weights)[::2])  # A is not zero


@pytest.mark.slow
@pytest.mark.parametrize("targets", [pm.DEFAULT_TARGETS, ("q", "v")])
def test_lora_equals_merged_weights_and_base_is_lora_off(hf_models, jit_apply, targets):
    _, _, model, params = hf_models["llama_untied_mqa_llama3"]
    lora = pm.init_lora(jax.random.key(1), model, pm.LoraConfig(rank=4, alpha=16.0, targets=targets))
    lora = with_random_b(lora, seed=2)
    ids_BL = jnp.asarray(random_ids(11, 2, 20))
    adapted = np.asarray(jax.jit(
        lambda adapters: model.apply({"params": params}, ids_BL, lora=adapters).logits_BLV)(lora))
    merged_params = pm.merge_lora(params, lora)
    merged = np.asarray(jit_apply(model, merged_params, ids_BL, None))
    base = np.asarray(jit_apply(model, params, ids_BL, None))
    assert np.abs(adapted - base).max() > 1e-2  # the adapter really changes the model
    assert np.abs(adapted - merged).max() <= 1e-4
    if "down" not in targets:  # merge_lora leaves untargeted kernels alone
        np.testing.assert_array_equal(merged_params["layers"]["mlp"]["down"]["kernel"],
                                      params["layers"]["mlp"]["down"]["kernel"])


def test_lora_gradients_flow_only_through_adapters(hf_models):
    _, _, model, params = hf_models["qwen2_untied_mha"]
    lora = pm.init_lora(jax.random.key(3), model, pm.LoraConfig(rank=2, alpha=2.0))
    ids_BL = jnp.asarray(random_ids(12, 2, 8))
    loss = lambda adapters: jnp.mean(  # noqa: E731
        model.apply({"params": params}, ids_BL, lora=adapters).logits_BLV ** 2)
    grads = jax.jit(jax.grad(loss))(lora)
    assert isinstance(grads, pm.LoraParams) and grads.scale == lora.scale
    q = grads.weights["layers"]["attn"]["q"]
    # With B = 0 the A-gradient is exactly zero and the B-gradient is not.
    assert float(jnp.abs(q["a"]).max()) == 0.0 and float(jnp.abs(q["b"]).max()) > 0.0
    names = pm.lora_logical_axes(lora)
    assert names["layers"]["attn"]["o"] == {"a": ("layers", "q_heads", "head_dim", "lora_rank"),
                                            "b": ("layers", "lora_rank", "embed")}


def test_lora_config_validation():
    with pytest.raises(ValueError, match="rank"):
        pm.LoraConfig(rank=0)
    with pytest.raises(ValueError, match="targets"):
        pm.LoraConfig(targets=("q", "w_in"))


@pytest.mark.parametrize("fields,message", [
    (dict(rank=0), "LoRA rank must be a positive integer, got 0"),
    (dict(rank=8.0), "LoRA rank must be a positive integer, got 8.0"),
    (dict(alpha=-1.0), "LoRA alpha must be a finite number > 0, got -1.0"),
    (dict(alpha=float("nan")), "LoRA alpha must be a finite number > 0"),
    (dict(targets=("q", "lm_head")), "LoRA targets must be a non-empty subset"),
])
def test_a_bad_lora_config_is_one_line(fields, message):
    with pytest.raises(ValueError, match=message):
        pm.LoraConfig(**fields)


def test_keys_configs_and_dtypes_of_the_wrong_kind_are_one_line(hf_models):
    # Each had failed deep inside JAX (an int key, a dict config, an int param dtype).
    path, _, model, _ = next(iter(hf_models.values()))
    with pytest.raises(TypeError, match="lora_config must be a LoraConfig"):
        pm.init_lora(jax.random.key(0), model, {"rank": 2})
    for call in (lambda: pm.init_lora(0, model, pm.LoraConfig(rank=2)), lambda: pm.init_params(model, 0)):
        with pytest.raises(TypeError, match=r"rng must be a PRNG key \(jax.random.key\(seed\)\); got 0"):
            call()
    for dtype in (jnp.int32, "float8", jnp.float8_e4m3fn, "bf16"):  # float8: a float no layer computes in
        with pytest.raises(ValueError, match="dtype must be one of jnp.float32, jnp.bfloat16"):
            pm.from_pretrained(path, dtype=dtype)
        with pytest.raises(ValueError, match="param_dtype must be one of jnp.float32"):
            pm.Decoder(model.config, param_dtype=dtype)
    with pytest.raises(ValueError, match="compute_dtype must be one of jnp.float32"):
        pm.from_pretrained(path, compute_dtype=jnp.int8)
    with pytest.raises(TypeError, match="Decoder config must be a ModelConfig; got dict"):
        pm.Decoder({"arch": "qwen2"})
    params = pm.init_params(model, jax.random.key(0))
    with pytest.raises(ValueError, match=r"positions_BL must be \[B, L\] = \(1, 4\); got \(1, 3\)"):
        model.apply({"params": params}, jnp.ones((1, 4), jnp.int32), positions_BL=jnp.arange(3)[None])
    for key in (jax.random.PRNGKey(0), np.asarray(jax.random.PRNGKey(0))):  # legacy key data, NumPy's too
        assert jax.tree.leaves(pm.init_lora(key, model, pm.LoraConfig(rank=2)).weights)
    with pytest.raises(TypeError, match="rng must be a PRNG key"):
        pm.init_lora(jnp.zeros(3, jnp.uint32), model, pm.LoraConfig(rank=2))  # no key of the default kind
