"""The sampler's rollout weights: LoRA merged group by group of layers equals each layer merged alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import podsjax.models as pm
from podsjax.models import rollout

# Nine layers merge as a group of 8, then a group of 1 that waits for the first (an
# optimization barrier between groups keeps one group's fp32 temporaries at a time).
CONFIG = pm.ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=9, num_heads=4,
                        num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=True, eos_token_id=2,
                        pad_token_id=0)


def test_the_merge_in_groups_of_layers_equals_each_layer_merged_alone():
    assert rollout.layers_per_merge(CONFIG.num_layers) == 8
    model = pm.Decoder(CONFIG, dtype=jnp.float32, param_dtype=jnp.float32)
    params = pm.init_params(model, jax.random.key(0))
    lora = pm.init_lora(jax.random.key(1), model, pm.LoraConfig(rank=4, alpha=8.0))
    leaves, treedef = jax.tree.flatten(lora.weights)  # B starts at zero: draw every factor, so each delta counts
    keys = jax.random.split(jax.random.key(2), len(leaves))
    lora = lora.replace(weights=jax.tree.unflatten(
        treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]))
    weights = jax.jit(functools.partial(rollout.rollout_weights, model))(params, lora)
    merged = pm.merge_lora(params, lora)["layers"]
    assert len(weights.layers) == CONFIG.num_layers
    for y, layer in enumerate(weights.layers):
        def kernel(group, name, n_in=1):
            k = merged[group][name]["kernel"][y]
            return k.reshape(int(np.prod(k.shape[:n_in])), -1)

        expected = {"qkv": jnp.concatenate([kernel("attn", p) for p in "qkv"], axis=-1),
                    "o": kernel("attn", "o", 2), "down": kernel("mlp", "down"),
                    "gate_up": jnp.concatenate([kernel("mlp", "gate"), kernel("mlp", "up")], axis=-1)}
        for name, want in expected.items():
            np.testing.assert_allclose(getattr(layer, name), want, rtol=1e-6, atol=1e-6, err_msg=f"layer {y} {name}")
        assert not np.allclose(layer.gate_up, jnp.concatenate(  # the LoRA delta is in it
            [params["layers"]["mlp"][n]["kernel"][y] for n in ("gate", "up")], axis=-1), atol=1e-3)
