"""LoRA exported in PEFT's format loads with PeftModel and computes what the merged export computes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny_checkpoint import save_tiny_checkpoint

from podsjax.models import peft_io
import podsjax.models as pm


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny checkpoint and LoRA adapters with non-zero B (as after training), on every projection."""
    base = save_tiny_checkpoint(tmp_path_factory.mktemp("peft_base"))
    model, params = pm.from_pretrained(base, dtype=jnp.float32)
    lora = pm.init_lora(jax.random.key(0), model, pm.LoraConfig(rank=4, alpha=8.0))
    keys = iter(jax.random.split(jax.random.key(1), 64))
    weights = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), lora.weights)
    return base, model, params, lora.replace(weights=weights)


@pytest.mark.slow
def test_peft_adapter_matches_the_merged_export(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, model, params, lora = trained
    targets = peft_io.save_peft_adapter(model, lora, tmp_path / "adapter", base_model_name_or_path=base)
    assert targets == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    config = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    pm.save_pretrained(model, params, tmp_path / "merged", lora=lora, tokenizer_from=base)

    ids = torch.tensor([[5, 17, 3, 42, 8, 11]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32)
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32),
                                            tmp_path / "adapter")
        plain = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        want, got, without = (m(ids).logits.numpy() for m in (merged, adapted, plain))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(without - want).max() > 1e-2  # the adapters change the output, so the match means something


def test_non_finite_adapters_and_occupied_directories_are_refused(trained, tmp_path):
    _, model, _, lora = trained
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        peft_io.save_peft_adapter(model, lora, tmp_path / "full")
    poisoned = lora.replace(weights=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), lora.weights))
    with pytest.raises(pm.CheckpointError, match="non-finite LoRA weights"):
        peft_io.save_peft_adapter(model, poisoned, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
