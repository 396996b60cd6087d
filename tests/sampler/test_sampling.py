"""The jit sampler: token-exact greedy parity with transformers, log-probs, EOS, sharding."""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats
from jax.sharding import NamedSharding, PartitionSpec
from test_models import build_hf

from podsjax.core import logprobs
from podsjax.devices import mesh as mesh_lib
from podsjax.sampler import decoding, sampling
import podsjax.models as pm

pytestmark = pytest.mark.cpu_mesh

FAMILIES = ["qwen2_tied_gqa", "llama_untied_mqa_llama3"]
EOS = 3
PAD = 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (HF torch model, podsjax model, params), built once."""
    out = {}
    for i, name in enumerate(FAMILIES):
        path = tmp_path_factory.mktemp(f"sampling_{name}")
        hf = build_hf(path, name, seed=10 + i)
        model, params = pm.from_pretrained(path, dtype=jnp.float32)
        out[name] = (hf, model, params)
    return out


@pytest.fixture(scope="module")
def generator_for():
    """model -> the one Generator this module samples it with, so its tests share compiled programs."""
    generators = {}

    def generator(model):
        if model not in generators:
            generators[model] = sampling.Generator(model)
        return generators[model]

    return generator


def left_padded_prompts(seed=0):
    rng = np.random.RandomState(seed)
    lengths = [7, 4, 1]
    ids = np.full((3, 8), PAD, np.int32)
    mask = np.zeros((3, 8), np.int32)
    for row, length in enumerate(lengths):
        ids[row, 8 - length :] = rng.randint(4, 256, length)  # never the EOS or pad id
        mask[row, 8 - length :] = 1
    return ids, mask


def hf_greedy(hf, ids, mask, max_new_tokens):
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    return out[:, ids.shape[1] :].numpy()


@pytest.mark.parametrize("layers", ["scanned", "unrolled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_token_exact_with_transformers_on_a_left_padded_batch(tiny, generator_for, family, layers):
    hf, model, params = tiny[family]
    model = model.clone(rollout_layers=layers)
    gen = generator_for(model)
    ids, mask = left_padded_prompts()
    ours = gen.generate(params, ids, mask, jax.random.key(0), num_samples=1, max_new_tokens=12,
                        temperature=0.0, eos_token_ids=EOS, pad_token_id=PAD)
    theirs = hf_greedy(hf, ids, mask, 12)
    tokens = np.asarray(ours.tokens)
    for row in range(len(ids)):
        n_valid = int(ours.lengths[row])
        assert tokens[row, :n_valid].tolist() == theirs[row, :n_valid].tolist(), row
        # HF pads after EOS with pad_token_id too, or ran out of tokens.
        assert theirs[row, n_valid:].tolist() == [PAD] * (theirs.shape[1] - n_valid)


def test_top_k_one_equals_greedy(tiny, generator_for):
    _, model, params = tiny["qwen2_tied_gqa"]
    gen = generator_for(model)
    ids, mask = left_padded_prompts(1)
    greedy = gen.generate(params, ids, mask, jax.random.key(0), num_samples=2, max_new_tokens=10,
                          temperature=0.0, eos_token_ids=EOS)
    top1 = gen.generate(params, ids, mask, jax.random.key(5), num_samples=2, max_new_tokens=10,
                        temperature=0.7, top_k=1, eos_token_ids=EOS)
    assert np.array_equal(np.asarray(top1.tokens), np.asarray(greedy.tokens))
    assert np.array_equal(np.asarray(top1.mask), np.asarray(greedy.mask))


def completion_logprobs(model, params, prompt_ids, prompt_mask, rollouts, num_samples, temperature):
    """Recomputes the sampled tokens' log-probs with one full forward pass, as the train step does."""
    ids = np.concatenate([np.repeat(prompt_ids, num_samples, 0), np.asarray(rollouts.tokens)], axis=1)
    mask = np.concatenate([np.repeat(prompt_mask, num_samples, 0), np.asarray(rollouts.mask)], axis=1)
    logits = model.apply({"params": params}, jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits_BLV
    lp = prompt_ids.shape[1]
    targets = jnp.asarray(ids[:, lp:])
    return np.asarray(logprobs.token_logprobs(logits[:, lp - 1 : -1], targets, temperature=temperature))


@pytest.mark.slow
def test_sampled_logprobs_match_a_full_forward_pass(tiny, generator_for):
    _, model, params = tiny["llama_untied_mqa_llama3"]
    gen = generator_for(model)
    ids, mask = left_padded_prompts(2)
    n, temperature = 3, 0.8
    # Greedy (temperature 0) reports log-probs at temperature 1; above 1 the draw divides.
    for t, top_p, reported in ((0.0, 1.0, 1.0), (1.5, 1.0, 1.5), (temperature, 0.9, temperature)):
        rollouts = gen.generate(params, ids, mask, jax.random.key(1), num_samples=n, max_new_tokens=10,
                                temperature=t, top_p=top_p, eos_token_ids=EOS, return_logprobs=True)
        recomputed = completion_logprobs(model, params, ids, mask, rollouts, n, reported)
        valid = np.asarray(rollouts.mask)
        np.testing.assert_allclose(np.asarray(rollouts.logprobs)[valid], recomputed[valid], atol=1e-5, err_msg=t)
        assert np.all(np.asarray(rollouts.logprobs)[~valid] == 0)
    # Off by default (the update recomputes them), and the tokens do not depend on it.
    plain = gen.generate(params, ids, mask, jax.random.key(1), num_samples=n, max_new_tokens=10,
                         temperature=temperature, top_p=0.9, eos_token_ids=EOS)
    assert plain.logprobs is None
    np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(rollouts.tokens))


def test_mask_lengths_and_truncation_follow_the_first_eos(tiny, generator_for):
    _, model, params = tiny["qwen2_tied_gqa"]
    gen = generator_for(model)
    ids, mask = left_padded_prompts(3)
    # Temperature 3 makes EOS likely early in some rows and absent in others.
    r = gen.generate(params, ids, mask, jax.random.key(2), num_samples=8, max_new_tokens=12,
                     temperature=3.0, eos_token_ids=(EOS, 4), pad_token_id=PAD)
    tokens, valid = np.asarray(r.tokens), np.asarray(r.mask)
    saw_eos = saw_truncated = False
    for row in range(tokens.shape[0]):
        stops = np.flatnonzero(np.isin(tokens[row], [EOS, 4]))
        if len(stops):
            first = stops[0]
            saw_eos = True
            assert valid[row].tolist() == [True] * (first + 1) + [False] * (12 - first - 1)
            assert not bool(r.truncated[row]) and int(r.lengths[row]) == first + 1
            assert np.all(tokens[row, first + 1 :] == PAD)
        else:
            saw_truncated = True
            assert valid[row].all() and bool(r.truncated[row]) and int(r.lengths[row]) == 12
    assert saw_eos and saw_truncated, "the seed should give both kinds of rows"


def test_an_eos_id_past_int32_never_ends_a_completion(tiny, generator_for):
    # It had failed inside the trace with an int32 OverflowError; outside the vocabulary, it is EOS off.
    _, model, params = tiny["qwen2_tied_gqa"]
    ids, mask = left_padded_prompts(2)
    r = generator_for(model).generate(params, ids, mask, jax.random.key(0), num_samples=2, max_new_tokens=3,
                                      temperature=1.0, eos_token_ids=(2**31,), pad_token_id=PAD)
    assert np.asarray(r.mask).all() and np.asarray(r.truncated).all()


def test_steps_between_stop_checks_divide_the_length():
    assert [decoding.steps_per_check(t) for t in (512, 12, 7, 11, 1)] == [8, 6, 7, 1, 1]


@pytest.mark.parametrize("eos", [(EOS, 4), tuple(range(4, 200))], ids=["some_rows_stop", "every_row_stops_early"])
def test_rollouts_are_the_same_whether_steps_run_in_chunks_or_one_by_one(tiny, generator_for, monkeypatch, eos):
    # 12 new tokens run as 2 chunks of 6; a loop that ends mid-chunk runs the chunk out masked.
    _, model, params = tiny["qwen2_tied_gqa"]
    ids, mask = left_padded_prompts(3)
    kwargs = dict(num_samples=8, max_new_tokens=12, temperature=3.0, eos_token_ids=eos, pad_token_id=PAD,
                  return_logprobs=True)
    chunked = generator_for(model).generate(params, ids, mask, jax.random.key(2), **kwargs)
    monkeypatch.setattr(decoding, "MAX_STEPS_PER_CHECK", 1)
    stepped = sampling.Generator(model).generate(params, ids, mask, jax.random.key(2), **kwargs)
    for got, want in zip(jax.tree.leaves(chunked), jax.tree.leaves(stepped)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if len(eos) > 2:  # the loop stopped before its last chunk
        assert int(np.asarray(stepped.lengths).max()) <= 6


def test_same_key_same_rollouts_and_samples_differ(tiny, generator_for):
    _, model, params = tiny["qwen2_tied_gqa"]
    gen = generator_for(model)
    ids, mask = left_padded_prompts(4)
    kwargs = dict(num_samples=4, max_new_tokens=8, temperature=1.0, eos_token_ids=EOS)
    a = gen.generate(params, ids, mask, jax.random.key(3), **kwargs)
    b = gen.generate(params, ids, mask, jax.random.key(3), **kwargs)
    c = gen.generate(params, ids, mask, jax.random.key(4), **kwargs)
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    raw = gen.generate(params, ids, mask, jax.random.PRNGKey(3), **kwargs)  # a raw key: as its typed key
    assert np.array_equal(np.asarray(raw.tokens), np.asarray(a.tokens))
    # The n samples of one prompt are not copies of each other.
    first_prompt = np.asarray(a.tokens)[:4]
    assert len({tuple(row) for row in first_prompt}) > 1


def test_each_step_draws_with_a_key_of_its_own(tiny, generator_for):
    # All-zero weights give uniform logits at every step: two steps drawn with one key would
    # pick the same token in every row, not in about 1 of V.
    _, model, params = tiny["qwen2_tied_gqa"]
    zeros = jax.tree.map(jnp.zeros_like, params)
    ids, mask = left_padded_prompts(4)
    r = generator_for(model).generate(zeros, ids, mask, jax.random.key(5), num_samples=32, max_new_tokens=8,
                                      temperature=1.0, eos_token_ids=EOS)
    tokens = np.asarray(r.tokens)
    same = [(tokens[:, t] == tokens[:, t + 1]).mean() for t in range(7)]
    assert max(same) < 0.1, same


def test_any_nonzero_prompt_mask_value_is_a_real_token(tiny, generator_for):
    _, model, params = tiny["qwen2_tied_gqa"]
    ids, mask = left_padded_prompts(6)
    kwargs = dict(num_samples=2, max_new_tokens=4, temperature=1.0, eos_token_ids=EOS)
    as_bool = generator_for(model).generate(params, ids, mask.astype(bool), jax.random.key(2), **kwargs)
    as_half = generator_for(model).generate(params, ids, 0.5 * mask.astype(np.float32), jax.random.key(2), **kwargs)
    np.testing.assert_array_equal(np.asarray(as_half.tokens), np.asarray(as_bool.tokens))


def test_prefill_runs_once_per_prompt_not_per_sample(tiny):
    from podsjax.sampler import decoding

    _, model, params = tiny["qwen2_tied_gqa"]
    ids, mask = left_padded_prompts(5)
    jaxpr = jax.make_jaxpr(lambda p, i, m: decoding.prefill(model, 16, 4, (p, None), i, m))(params, ids, mask)

    def dot_shapes(jaxpr):  # the layers run inside a scan: walk nested jaxprs too
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield from (v.aval.shape for v in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from dot_shapes(sub)

    shapes = list(dot_shapes(jaxpr.jaxpr))
    prompt_len = ids.shape[1]
    # Projections run as [rows, features] matmuls over the flattened batch and length.
    assert any(s[0] == 3 * prompt_len for s in shapes)  # the model runs on the 3 prompts
    assert not any(s[0] == 48 * prompt_len for s in shapes)  # never on 3 x 16 copies


def test_the_unrolled_cache_holds_each_prompt_once_and_each_sample_its_completion(tiny):
    from podsjax.models import rollout
    from podsjax.sampler import decoding

    _, model, params = tiny["qwen2_tied_gqa"]
    model = model.clone(rollout_layers="unrolled")
    ids, mask = left_padded_prompts(5)
    weights = jax.eval_shape(lambda p: rollout.rollout_weights(model, p), params)
    _, cache = jax.eval_shape(lambda w, i, m: decoding.prefill(model, 16, 4, w, i, m), weights, ids, mask)
    cfg = model.config
    assert isinstance(cache, rollout.GroupedCache)
    assert cache.prompts.keys[0].shape == (3, cfg.num_kv_heads, ids.shape[1], cfg.head_dim)
    assert cache.rows.keys[0].shape == (48, cfg.num_kv_heads, 4, cfg.head_dim)
    assert cache.rows.values[0].shape == (48, cfg.num_kv_heads, cfg.head_dim, 4)  # slots last
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda w, i, m: decoding.prefill(model, 16, 4, w, i, m)[1])(
        rollout.rollout_weights(model, params), ids, mask).rows.positions_B), np.repeat(np.asarray(mask).sum(1), 16))


def test_unrolled_layers_sample_what_the_scanned_layers_sample_with_lora_and_on_a_mesh(tiny, generator_for):
    # The unrolled layout folds LoRA into merged per-layer weights (fp32 here, so the
    # merge rounds at fp32) and splits rows over the mesh; the same key gives the same rollouts.
    _, model, params = tiny["llama_untied_mqa_llama3"]
    scanned_gen = generator_for(model.clone(rollout_layers="scanned"))
    lora = pm.init_lora(jax.random.key(1), model, pm.LoraConfig(rank=4, alpha=8.0))
    lora = lora.replace(weights=jax.tree.map(lambda x: x + 0.05, lora.weights))  # B = 0 would leave the base
    ids, mask = left_padded_prompts(8)
    kwargs = dict(num_samples=4, max_new_tokens=6, temperature=0.8, top_p=0.95, eos_token_ids=EOS,
                  return_logprobs=True, lora=lora)
    scanned = scanned_gen.generate(params, ids[:2], mask[:2], jax.random.key(4), **kwargs)
    mesh = mesh_lib.make_mesh("data=2,fsdp=4")
    sharded = pm.Decoder(model.config, mesh=mesh, rollout_layers="unrolled")
    placed = jax.device_put(params, pm.param_shardings(sharded, mesh))
    unrolled = sampling.Generator(sharded).generate(placed, ids[:2], mask[:2], jax.random.key(4), **kwargs)
    assert np.array_equal(np.asarray(unrolled.tokens), np.asarray(scanned.tokens))
    np.testing.assert_allclose(np.asarray(unrolled.logprobs), np.asarray(scanned.logprobs), atol=1e-4)
    # The adapters change what is sampled.
    base = scanned_gen.generate(params, ids[:2], mask[:2], jax.random.key(4), **{**kwargs, "lora": None})
    assert not np.array_equal(np.asarray(base.tokens), np.asarray(scanned.tokens))


def test_the_decode_kernel_writes_and_reads_each_steps_keys_as_the_xla_form_does(tiny, generator_for, monkeypatch):
    # On a GPU grouped decode runs podsjax.models.decode_kernel, which writes each step's key
    # and value into the cache itself (no scatter); here in Pallas's interpreter, step after
    # step, against the scatter and the XLA form.
    from podsjax.models import decode_kernel, rollout

    _, model, params = tiny["qwen2_tied_gqa"]
    model = model.clone(rollout_layers="unrolled")
    ids, mask = left_padded_prompts(9)
    kwargs = dict(num_samples=4, max_new_tokens=6, temperature=0.8, eos_token_ids=EOS, return_logprobs=True)
    want = generator_for(model).generate(params, ids[:2], mask[:2], jax.random.key(5), **kwargs)
    monkeypatch.setattr(rollout, "decode_kernel_fits", lambda *_: True)
    monkeypatch.setattr(decode_kernel, "grouped_decode_attention",
                        functools.partial(decode_kernel.grouped_decode_attention, interpret=True))
    got = sampling.Generator(model).generate(params, ids[:2], mask[:2], jax.random.key(5), **kwargs)
    assert np.array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)


def test_more_than_one_key_is_refused_in_one_line(tiny, generator_for):
    _, model, params = tiny["qwen2_tied_gqa"]
    gen = generator_for(model)
    ids, mask = left_padded_prompts(6)
    with pytest.raises(ValueError, match="key must be one PRNG key; got shape"):
        gen.generate(params, ids, mask, jax.random.split(jax.random.key(5)), num_samples=2, max_new_tokens=4,
                     temperature=1.0, eos_token_ids=EOS)


def test_second_call_with_new_prompts_does_not_recompile(tiny, generator_for):
    _, model, params = tiny["qwen2_tied_gqa"]
    gen = generator_for(model)
    kwargs = dict(num_samples=2, max_new_tokens=4, temperature=1.0, eos_token_ids=EOS)
    ids, mask = left_padded_prompts(6)
    before = gen.compiles
    gen.generate(params, ids, mask, jax.random.key(0), **kwargs)
    first = gen.compiles
    ids2, mask2 = left_padded_prompts(7)
    gen.generate(params, ids2, mask2, jax.random.key(1), **kwargs)
    assert gen.compiles == first
    assert first["sample"] <= before["sample"] + 1


@pytest.mark.slow
def test_greedy_and_sampled_calls_of_one_shape_share_the_sampling_program(tiny, generator_for):
    _, model, params = tiny["qwen2_tied_gqa"]
    gen = generator_for(model)
    ids, mask = left_padded_prompts(6)  # 3 prompts
    sampled = gen.generate(params, ids, mask, jax.random.key(0), num_samples=1, max_new_tokens=5,
                           temperature=0.9, eos_token_ids=EOS)
    before = gen.compiles
    greedy = gen.generate(params, ids, mask, jax.random.key(0), num_samples=1, max_new_tokens=5,
                          temperature=0.0, eos_token_ids=EOS)
    assert gen.compiles == before  # one executable served both: the temperature is traced
    # ...and the traced temperature still decides: greedy rows follow the argmax.
    logits = np.asarray(model.apply({"params": params}, jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits_BLV)
    np.testing.assert_array_equal(np.asarray(greedy.tokens)[:, 0], logits[:, -1].argmax(-1))
    assert sampled.tokens.shape == greedy.tokens.shape



def test_each_generator_owns_its_programs_and_compiles_each_signature_once(tiny):
    _, model, params = tiny["qwen2_tied_gqa"]
    model = model.clone(rollout_layers="unrolled")  # both stages: weights, sample
    shapes = dict(prompt_len=8, max_new_tokens=4, eos_token_ids=(EOS,))
    first, other = sampling.Generator(model), sampling.Generator(model)
    compiled = first.compile(params, None, prompts=2, num_samples=2, **shapes)
    assert all(seconds > 0 for seconds in compiled["compile_s"].values()), compiled["compile_s"]
    again = first.compile(params, None, prompts=2, num_samples=2, **shapes)
    assert again["compile_s"] == {"weights": 0.0, "sample": 0.0}
    assert again["sample"] is compiled["sample"]
    # A new prompt count compiles sampling again and reuses the weights program, whose
    # inputs are the same.
    first.compile(params, None, prompts=4, num_samples=1, **shapes)
    assert first.compiles == {"weights": 1, "sample": 2}
    # Another generator of the same model compiles its own.
    own = other.compile(params, None, prompts=2, num_samples=2, **shapes)
    assert own["sample"] is not compiled["sample"] and own["compile_s"]["sample"] > 0
    assert other.compiles == {"weights": 1, "sample": 1}
    with pytest.raises(ValueError, match="max_programs must be >= 1"):
        sampling.Generator(model, max_programs=0)


def test_a_generator_compiles_each_program_with_its_compiler_options_and_refuses_a_bad_one_in_one_line(
        tiny, tmp_path):
    _, model, params = tiny["qwen2_tied_gqa"]
    model = model.clone(rollout_layers="unrolled")
    shapes = dict(prompts=1, prompt_len=8, num_samples=2, max_new_tokens=4, eos_token_ids=(EOS,))
    sampling.Generator(model, compiler_options={"xla_dump_to": str(tmp_path)}).compile(params, None, **shapes)
    dumped = {name.split(".")[1] for name in (p.name for p in tmp_path.iterdir()) if name.startswith("module_")}
    assert {"jit_rollout_weights", "jit_sample"} <= dumped, dumped
    with pytest.raises(ValueError, match="compiler_options .*xla_no_such_option") as info:
        sampling.Generator(model, compiler_options={"xla_no_such_option": 1}).compile(params, None, **shapes)
    assert "\n" not in str(info.value)


def test_place_rows_splits_rows_that_divide_over_the_batch_shards_and_replicates_others(tiny):
    _, model, _ = tiny["qwen2_tied_gqa"]
    mesh = mesh_lib.make_mesh("data=2,fsdp=4")
    gen = sampling.Generator(pm.Decoder(model.config, mesh=mesh))
    even = np.arange(16 * 3, dtype=np.int32).reshape(16, 3)
    placed = gen.place_rows(even)
    assert placed.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(("data", "fsdp"))), 2)
    assert {shard.data.shape for shard in placed.addressable_shards} == {(2, 3)}
    np.testing.assert_array_equal(np.asarray(placed), even)
    assert gen.place_rows(placed).sharding == placed.sharding
    uneven = np.arange(6 * 2, dtype=np.int32).reshape(6, 2)  # 6 rows over 8 batch shards
    replicated = gen.place_rows(uneven)
    assert replicated.sharding.is_fully_replicated and len(replicated.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(replicated), uneven)
    np.testing.assert_array_equal(np.asarray(sampling.Generator(model).place_rows(uneven)), uneven)  # no mesh

@pytest.mark.slow
def test_sharded_generation_matches_single_device(tmp_path):
    path = tmp_path / "ckpt"
    build_hf(path, "qwen2_tied_gqa", seed=20)
    mesh = mesh_lib.make_mesh("data=2,fsdp=4")
    model, params = pm.from_pretrained(path, dtype=jnp.float32)
    sharded_model, sharded_params = pm.from_pretrained(path, dtype=jnp.float32, mesh=mesh)
    ids, mask = left_padded_prompts(8)
    ids, mask = np.concatenate([ids, ids[:1]]), np.concatenate([mask, mask[:1]])  # 4 prompts x 2 = 8 rows
    kwargs = dict(num_samples=2, max_new_tokens=6, temperature=0.0, eos_token_ids=EOS, return_logprobs=True)
    ref = sampling.Generator(model).generate(params, ids, mask, jax.random.key(0), **kwargs)
    out = sampling.Generator(sharded_model).generate(sharded_params, ids, mask, jax.random.key(0), **kwargs)
    assert np.array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
    expected = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    assert out.tokens.sharding.is_equivalent_to(expected, 2)


def test_bad_arguments_raise_one_line_errors(tiny, generator_for):
    _, model, params = tiny["qwen2_tied_gqa"]
    ids, mask = left_padded_prompts()
    base = dict(num_samples=1, max_new_tokens=4, temperature=1.0, eos_token_ids=EOS)
    vocab = model.config.vocab_size
    cases = [
        (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(num_samples=0), "num_samples must be >= 1"),
        (dict(num_samples=2.5), "num_samples must be an integer; got 2.5"),
        (dict(num_samples="2"), "num_samples must be an integer; got '2'"),
        (dict(eos_token_ids=()), "eos_token_ids must name at least one token"),
        (dict(eos_token_ids=["</s>"]), "eos_token_ids must be ints"),
        (dict(pad_token_id=vocab), rf"pad_token_id must be a token id in \[0, {vocab}\); got {vocab}"),
        (dict(pad_token_id=-1), "got -1"),
        (dict(temperature=None), "temperature must be a number; got None"),
        (dict(temperature="0.9"), "temperature must be a number; got '0.9'"),  # had been taken as 0.9
        (dict(top_p=np.ones(2)), "top_p must be a number"),
        (dict(return_logprobs="no"), "return_logprobs must be True or False; got 'no'"),  # had been True
    ]
    for override, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            sampling.generate(model, params, ids, mask, jax.random.key(0), **{**base, **override})
    for eos in (np.int64(EOS), {EOS}):  # a NumPy int is one id, as an int is; a set is ids
        one = generator_for(model).generate(params, ids, mask, jax.random.key(0), **{**base, "eos_token_ids": eos})
        assert one.tokens.shape[0] == ids.shape[0]
    with pytest.raises(ValueError, match=r"must both be \[B, L\]"):
        sampling.generate(model, params, ids, mask[:, :3], jax.random.key(0), **base)
    with pytest.raises(TypeError, match="key must be a PRNG key"):
        sampling.generate(model, params, ids, mask, 0, **base)
    with pytest.raises(ValueError, match=r"at least one row and one position; got shape \(1, 0\)"):
        sampling.generate(model, params, np.zeros((1, 0), np.int32), np.zeros((1, 0), np.int32), jax.random.key(0),
                          **base)
    # A 0/1 float mask is a mask, as the Decoder reads it (it had been refused).
    generator = generator_for(model)
    as_ints = generator.generate(params, ids, mask, jax.random.key(0), **base)
    as_floats = generator.generate(params, ids, np.asarray(mask, np.float32), jax.random.key(0), **base)
    np.testing.assert_array_equal(np.asarray(as_floats.tokens), np.asarray(as_ints.tokens))
    with pytest.raises(ValueError, match="the prompt mask must be bool, integer or float"):
        sampling.generate(model, params, ids, np.asarray(mask, np.complex64), jax.random.key(0), **base)
    with pytest.raises(ValueError, match="the prompt mask must be numbers"):  # JAX's own error had named no argument
        sampling.generate(model, params, ids, np.asarray(mask).astype(str), jax.random.key(0), **base)
    for key in (jnp.zeros(2, jnp.float32), jnp.zeros(3, jnp.uint32)):
        with pytest.raises(ValueError, match=r"key must be a PRNG key \(jax.random.key\(seed\)\) or"):
            sampling.generate(model, params, ids, mask, key, **base)
    # Under the caller's jit: one line, not a concretization error from inside.
    with pytest.raises(TypeError, match="call it outside jax.jit, grad and vmap"):
        jax.jit(lambda i: generator.generate(params, i, mask, jax.random.key(0), **base).tokens)(ids)
    with pytest.raises(TypeError, match="call it outside jax.jit, grad and vmap"):
        jax.jit(lambda k: generator.generate(params, ids, mask, k, **base).tokens)(jax.random.key(0))


@pytest.mark.parametrize("changes,message", [
    (dict(eos_token_ids="2"), "eos_token_ids must be ints"),
    (dict(prompts=0), "prompts and prompt_len must be >= 1; got 0"),
    (dict(top_p="0.9"), "top_p must be a number; got '0.9'"),
    (dict(pad_token_id=10**6), r"pad_token_id must be a token id in \[0, "),
    (dict(num_samples=0), "num_samples must be >= 1"),
])
def test_compiling_ahead_checks_what_generate_checks(tiny, changes, message):
    # Generator.compile had taken these to a ZeroDivisionError or a TypeError from inside, or accepted them.
    _, model, params = tiny["qwen2_tied_gqa"]
    options = {**dict(prompts=1, prompt_len=4, num_samples=2, max_new_tokens=2, eos_token_ids=EOS), **changes}
    with pytest.raises((ValueError, TypeError), match=message):
        sampling.Generator(model).compile(params, None, **options)


def test_prompts_that_would_sample_from_padding_or_outside_the_vocabulary_are_refused(tiny):
    # Prefill continues from each row's last position: a right-padded row would continue from
    # a pad slot, and an id past the vocabulary embeds as NaN; both sampled without a word.
    _, model, params = tiny["qwen2_tied_gqa"]
    ids, mask = (np.asarray(x) for x in left_padded_prompts())
    base = dict(num_samples=1, max_new_tokens=4, temperature=1.0, eos_token_ids=EOS)
    short = int(np.argmin(mask.sum(axis=1)))
    right = np.zeros_like(mask)
    right[short, : mask[short].sum()] = 1
    right[[r for r in range(len(mask)) if r != short]] = 1
    with pytest.raises(ValueError, match=f"prompts must be left-padded.*row {short} ends in padding"):
        sampling.generate(model, params, ids, right, jax.random.key(0), **base)
    empty = mask.copy()
    empty[short] = 0
    with pytest.raises(ValueError, match="has no real token"):
        sampling.generate(model, params, ids, empty, jax.random.key(0), **base)
    far = ids.copy()
    far[0, -1] = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"must be in \[0, {model.config.vocab_size}\).*row 0 holds"):
        sampling.generate(model, params, far, mask, jax.random.key(0), **base)
    far[0, -1] = -3
    with pytest.raises(ValueError, match="row 0 holds -3"):
        sampling.generate(model, params, far, mask, jax.random.key(0), **base)
    # In a pad slot too: its NaN embedding had reached the row's values, sampling pads with NaN log-probs.
    padded = int(np.argmin(mask[:, 0]))
    in_pad = ids.copy()
    in_pad[padded, 0] = model.config.vocab_size
    with pytest.raises(ValueError, match=f"row {padded} holds {model.config.vocab_size} at position 0"):
        sampling.generate(model, params, in_pad, mask, jax.random.key(0), **base)
    # Past int32: JAX's conversion had wrapped 2**32 + 7 to 7 before any check could see it.
    wide = ids.astype(np.int64)
    wide[0, -1] = 2**32 + 7
    with pytest.raises(ValueError, match=f"row 0 holds {2**32 + 7}"):
        sampling.generate(model, params, wide, mask, jax.random.key(0), **base)
    with pytest.raises(ValueError, match=f"row 0 holds {2**32 + 7}"):
        model.apply({"params": params}, wide)
    with pytest.raises(ValueError, match=r"attention mask of the same shape; got \(1, 4\) and \(1, 3\)"):
        model.apply({"params": params}, jnp.ones((1, 4), jnp.int32), attention_mask=jnp.ones((1, 3)))
    # The decoder itself, called eagerly: an id past the vocabulary had given NaN logits and a
    # negative one the table's last row, both without a word; pads count (NaN reaches the values).
    vocab = model.config.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=rf"input token ids must be in \[0, {vocab}\).*row 1 holds {bad} at position 2"):
            model.apply({"params": params}, jnp.zeros((2, 4), jnp.int32).at[1, 2].set(bad),
                        attention_mask=jnp.ones((2, 4)).at[1, 2].set(0))
    with pytest.raises(ValueError, match="input ids must be integer token ids; got dtype float32"):
        model.apply({"params": params}, jnp.ones((1, 4), jnp.float32))
    assert model.apply({"params": params}, [[1, 2, 3]]).logits_BLV.shape == (1, 3, vocab)  # a list is an array


def first_token_distribution(model, params, ids, mask, temperature):
    logits = model.apply({"params": params}, jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits_BLV[0, -1]
    return np.asarray(jax.nn.softmax(logits.astype(jnp.float32) / temperature), np.float64)


def chi_square_p_value(counts, expected_probs):
    """Pearson chi-square test; bins expected below 5 counts are pooled into one."""
    total = counts.sum()
    expected = expected_probs * total
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return scipy_stats.chi2.sf(stat, keep.sum() - 1)


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_token_frequencies_match_the_tempered_softmax(tiny, generator_for, top_p):
    # Significance level 0.001: with a fixed key the test is deterministic; a wrong
    # temperature, filter or logit row shifts the counts far beyond that.
    _, model, params = tiny["qwen2_tied_gqa"]
    gen = generator_for(model)
    ids, mask = left_padded_prompts(9)
    ids, mask = ids[:1], mask[:1]
    temperature, draws = 0.7, 6000
    probs = first_token_distribution(model, params, ids, mask, temperature)
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = order[before < top_p]  # the smallest prefix whose mass reaches top_p
    expected = np.zeros_like(probs)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    r = gen.generate(params, ids, mask, jax.random.key(11), num_samples=draws, max_new_tokens=1,
                     temperature=temperature, top_p=top_p, eos_token_ids=EOS)
    first = np.asarray(r.tokens)[:, 0]
    assert set(first.tolist()) <= set(nucleus.tolist())
    counts = np.bincount(first, minlength=len(probs)).astype(np.float64)
    assert chi_square_p_value(counts, expected) > 1e-3
    # The test has power: the untempered softmax is rejected on the same counts.
    assert chi_square_p_value(counts, first_token_distribution(model, params, ids, mask, 1.0)) < 1e-3


def test_filters_keep_exactly_the_top_k_and_the_nucleus():
    from podsjax.sampler.decoding import filter_logits

    rng = np.random.default_rng(12)
    logits = rng.normal(size=(5, 40)).astype(np.float32) * 2
    kept_k = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), 7, 1.0)))
    assert np.array_equal(kept_k, logits >= np.sort(logits, -1)[:, -7:-6])
    for top_p in (0.3, 0.9, 0.999):
        kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), 0, top_p)))
        for row in range(5):
            probs = np.exp(logits[row] - logits[row].max())
            probs /= probs.sum()
            order = np.argsort(-probs)
            mass_before = np.cumsum(probs[order]) - probs[order]
            assert set(np.flatnonzero(kept[row])) == set(order[mass_before < top_p]), (row, top_p)
    # At the boundary: a nucleus whose top token holds exactly top_p is that token alone, as in transformers.
    boundary = np.asarray(filter_logits(jnp.log(jnp.array([[0.5, 0.25, 0.25]])), 0, 0.5))
    assert np.isfinite(boundary).tolist() == [[True, False, False]]


def test_sampling_at_a_temperature_draws_from_the_tempered_logits():
    from podsjax.sampler import decoding

    rng = np.random.default_rng(13)
    # The sampler draws what jax.random.categorical draws from logits / temperature, for the same key.
    logits = jnp.asarray(rng.normal(size=(64, 300)).astype(np.float32) * 3)
    key = jax.random.key(14)
    cfg = decoding.SamplingConfig(num_samples=1, max_new_tokens=1, temperature=0.7, eos_token_ids=(EOS,))
    tokens, _ = jax.jit(lambda lg, k: decoding.sample_tokens(lg, k, jnp.float32(cfg.temperature), cfg))(logits, key)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(jax.random.categorical(key, logits / 0.7)))



def test_a_tiny_temperature_draws_the_top_token_with_a_finite_log_prob():
    from podsjax.sampler import decoding

    # Large logits over a temperature of 1e-37 had overflowed: the top logit to +inf (a NaN
    # log-prob), or, for negative logits, every logit to -inf and token 0 drawn.
    logits = jnp.asarray([[300.0, 310.0, 200.0], [-300.0, -310.0, -200.0]])
    for top_k, top_p in ((0, 1.0), (2, 0.9)):  # the nucleus of the tempered policy too
        cfg = decoding.SamplingConfig(num_samples=1, max_new_tokens=1, temperature=1e-37, eos_token_ids=(EOS,),
                                      return_logprobs=True, top_k=top_k, top_p=top_p)
        tokens, logprobs = jax.jit(lambda lg, k: decoding.sample_tokens(lg, k, jnp.float32(cfg.temperature), cfg))(
            logits, jax.random.key(0))
        assert np.asarray(tokens).tolist() == [1, 2], (top_k, top_p)
        np.testing.assert_array_equal(np.asarray(logprobs), [0.0, 0.0])
    # A subnormal float32, which XLA flushes to 0 in some ops only, is refused in one line.
    with pytest.raises(ValueError, match="below float32's smallest normal number.*use 0 for greedy"):
        decoding.SamplingConfig(num_samples=1, max_new_tokens=1, temperature=1e-39, eos_token_ids=(EOS,))


def test_tied_top_logits_are_drawn_evenly_at_any_temperature():
    # argmax(x + t * noise) had rounded the noise away beside the logits: at t 1e-8 two
    # tied tokens came out 94:6, and at logits of 1e8 and t 1, 98:2.
    from podsjax.sampler import decoding

    cfg = decoding.SamplingConfig(num_samples=1, max_new_tokens=1, temperature=1.0, eos_token_ids=(EOS,))
    draw = jax.jit(lambda lg, t: decoding.sample_tokens(lg, jax.random.key(3), t, cfg)[0])
    for value, t in ((0.5, 1e-8), (20.0, 1e-6), (1e8, 1.0), (3.0, 0.7)):
        share = float(np.mean(np.asarray(draw(jnp.full((20000, 2), value), jnp.float32(t))) == 0))
        assert abs(share - 0.5) < 0.02, (value, t, share)  # 5.7 standard deviations


@pytest.mark.slow
def test_bf16_generation_runs_and_follows_the_bf16_forward(tiny, generator_for):
    _, model, params = tiny["qwen2_tied_gqa"]
    bf16 = model.clone(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    gen = generator_for(bf16)
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    ids, mask = left_padded_prompts(9)
    out = gen.generate(params16, ids, mask, jax.random.key(0), num_samples=1, max_new_tokens=4, temperature=0.0,
                       eos_token_ids=EOS, return_logprobs=True)
    assert np.isfinite(np.asarray(out.logprobs)).all()
    forward = jax.jit(lambda p: bf16.apply({"params": p}, jnp.asarray(ids),
                                           attention_mask=jnp.asarray(mask)).logits_BLV)
    logits = np.asarray(forward(params16))
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, 0], logits[:, -1].argmax(-1))
