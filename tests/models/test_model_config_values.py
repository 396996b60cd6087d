"""A ModelConfig built in code is held to what from_hf_config holds a config.json to."""

import pytest

import podsjax.models as pm
from podsjax.models.model_config import Llama3RopeScaling

SHAPE = dict(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
             num_kv_heads=1, head_dim=16)


@pytest.mark.parametrize("changes,message", [
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be True or False, got 'false'"),  # had tied
    (dict(qkv_bias=1), "qkv_bias must be True or False"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0, got nan"),  # NaN logits
    (dict(rope_theta=float("inf")), "rope_theta must be a finite number > 0"),
    (dict(rope_scaling={"factor": 8.0}), "rope_scaling must be a Llama3RopeScaling or None"),
    (dict(eos_token_id="</s>"), "eos_token_id must be token ids"),
    (dict(eos_token_id=["</s>", 2]), "eos_token_id must be token ids"),
    (dict(pad_token_id=1.5), "pad_token_id must be token ids"),
])
def test_a_value_from_hf_config_would_refuse_is_one_line(changes, message):
    with pytest.raises(ValueError, match=message):
        pm.ModelConfig(**SHAPE, **changes)


def test_good_values_still_build():
    config = pm.ModelConfig(**SHAPE, eos_token_id=[1, 2], tie_word_embeddings=True,
                            rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64))
    assert config.eos_token_id == (1, 2)
    with pytest.raises(ValueError, match="rope_scaling.factor must be a finite number"):
        Llama3RopeScaling(float("nan"), 1.0, 4.0, 64)
