"""The fused grouped decode attention (podsjax.models.decode_kernel) against the XLA form.

On a CPU the kernel runs in Pallas's interpreter; on a GPU host also compiled, through Triton.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podsjax.devices import mesh as mesh_lib
from podsjax.models import decode_kernel, decoder, rollout

ON_GPU = jax.default_backend() == "gpu"


def grouped_case(prompts, samples, kv_heads, groups, prompt_len, slots, head_dim, dtype, seed=0):
    """Random queries and a grouped cache with holes in both masks; each row has written
    ``length`` completion slots, the last of them its own token."""
    rng = np.random.default_rng(seed)
    b = prompts * samples
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    prompt_mask = jnp.asarray(rng.random((prompts, prompt_len)) < 0.7).at[:, -1].set(True)
    length = jnp.asarray(rng.integers(1, slots + 1, size=b), jnp.int32)
    allowed = (jnp.arange(slots)[None] < length[:, None]) & jnp.asarray(rng.random((b, slots)) < 0.8)
    allowed = allowed.at[jnp.arange(b), length - 1].set(True)
    return dict(q_B1HE=normal(b, 1, kv_heads * groups, head_dim),
                prompt_k_PKSE=normal(prompts, kv_heads, prompt_len, head_dim),
                prompt_v_PKSE=normal(prompts, kv_heads, prompt_len, head_dim), prompt_mask_PS=prompt_mask,
                k_BKTE=normal(b, kv_heads, slots, head_dim), v_BKET=normal(b, kv_heads, head_dim, slots),
                allowed_B1T=allowed[:, None], length_B=length)


def xla_form(case):
    return rollout.attend_grouped(*[v for k, v in case.items() if k != "length_B"])


def kernel_form(case, interpret=True, token=None):
    """The kernel on ``case``; with ``token`` (:func:`unwritten`) it reads the queries from the token's heads."""
    b, _, h, e = case["q_B1HE"].shape
    k = case["prompt_k_PKSE"].shape[1]
    out = decode_kernel.grouped_decode_attention(
        None if token is not None else case["q_B1HE"].reshape(b, k, h // k, e), case["prompt_k_PKSE"],
        case["prompt_v_PKSE"],
        case["prompt_mask_PS"], case["k_BKTE"], case["v_BKET"], case["allowed_B1T"][:, 0], case["length_B"],
        token, interpret=interpret)
    if token is not None:
        return out[0].reshape(b, 1, h, e), out[1]
    return out.reshape(b, 1, h, e)


def unwritten(case, seed=7):
    """``case`` with new queries and each row's last token as RoPE rotated them, and that step
    as the kernel takes it: ``(that case, it with NaN at the token's slot, (qkv heads
    [B, H + 2K, E], cos, sin [B, E]))``, queries and key before RoPE."""
    rng = np.random.default_rng(seed)
    b, k, _, e = case["k_BKTE"].shape
    h = case["q_B1HE"].shape[2]
    rows, slot, dtype = jnp.arange(b), case["length_B"] - 1, case["k_BKTE"].dtype
    raw_q, raw_k = (jnp.asarray(rng.normal(size=(b, heads, e)), dtype) for heads in (h, k))
    angles = jnp.asarray(rng.uniform(0, 100, size=(b, 1, e // 2)), jnp.float32)
    rope = (jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype))
    key = decoder.apply_rope(raw_k[:, None], rope)[:, 0]
    value = case["v_BKET"][rows, :, :, slot]
    qkv = jnp.concatenate([raw_q, raw_k, value], axis=1)
    case = dict(case, q_B1HE=decoder.apply_rope(raw_q[:, None], rope))
    written = dict(case, k_BKTE=case["k_BKTE"].at[rows, :, slot].set(key))
    stale = dict(case, k_BKTE=case["k_BKTE"].at[rows, :, slot].set(jnp.nan),
                 v_BKET=case["v_BKET"].at[rows, :, :, slot].set(jnp.nan))
    return written, stale, (qkv, *decode_kernel.rope_factors(rope[0][:, 0], rope[1][:, 0]))


# (prompts, samples, kv heads, queries per kv head, prompt slots, completion slots, head_dim):
# lengths that are not a multiple of the kernel's block, more than one block, a group of 1,
# a group whose query matrix (n x G = 70) takes several tiles and a prompt in several chunks.
SHAPES = [(2, 3, 2, 3, 37, 21, 16), (1, 4, 1, 6, 64, 130, 32), (3, 1, 2, 2, 80, 16, 16),
          (1, 10, 1, 7, 300, 40, 16)]


@pytest.fixture(params=[True, False], ids=["one launch", "a launch a pass"])
def launch(request, monkeypatch):
    """The kernel with both passes in one launch, and with a launch each."""
    monkeypatch.setattr(decode_kernel, "ONE_LAUNCH", request.param)
    jax.clear_caches()  # the form is read when the kernel is traced
    yield request.param
    jax.clear_caches()


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_matches_the_xla_grouped_attention_in_fp32(shape, launch):
    case = grouped_case(*shape, jnp.float32)
    np.testing.assert_allclose(kernel_form(case), xla_form(case), atol=2e-6, rtol=2e-6)
    calls = list(_pallas_calls(jax.make_jaxpr(kernel_form)(case).jaxpr))
    assert len(calls) == (1 if launch else 2)
    # Taking each row's token from the qkv projection as it attends: its key rotated as RoPE
    # rotates it, read from the registers (its slot in memory is NaN until the write), and the
    # cache written as the scatter writes it.
    written, stale, token = unwritten(case)
    out, (keys, values) = kernel_form(stale, token=token)
    np.testing.assert_allclose(out, xla_form(written), atol=2e-6, rtol=2e-6)
    np.testing.assert_array_equal(keys, written["k_BKTE"])
    np.testing.assert_array_equal(values, written["v_BKET"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_adds_the_qkv_bias_as_the_projection_would_have(dtype, launch):
    # Qwen's q, k and v have a bias. Handed to the kernel, it is added to each head as it is
    # read (queries of both passes, the token's key and value): the same attention and cache
    # as from heads that had it added before. In bf16 the sum may skip its rounding before
    # RoPE (XLA's excess precision, as in the XLA form's fusions): one bf16 step at most.
    case = grouped_case(1, 4, 2, 3, 40, 24, 16, dtype, seed=3)
    _, stale, (qkv, cos, sin) = unwritten(case)
    bias = jnp.asarray(np.random.default_rng(4).normal(size=qkv.shape[1:]), dtype)
    biased, (keys, values) = kernel_form(stale, token=(qkv, cos, sin, bias.reshape(-1)))
    added, (added_keys, added_values) = kernel_form(stale, token=(qkv + bias, cos, sin))
    tolerance = dict(atol=0, rtol=0) if dtype == jnp.float32 else dict(atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(biased, np.float32), np.asarray(added, np.float32), **tolerance)
    np.testing.assert_allclose(np.asarray(keys, np.float32), np.asarray(added_keys, np.float32), **tolerance)
    np.testing.assert_array_equal(values, added_values)
    unbiased, _ = kernel_form(stale, token=(qkv, cos, sin))
    assert not np.allclose(unbiased, added)


def test_the_kernel_reads_a_bf16_cache_as_the_xla_form_does():
    case = grouped_case(2, 4, 2, 6, 48, 40, 32, jnp.bfloat16, seed=1)
    out, ref = kernel_form(case).astype(jnp.float32), xla_form(case).astype(jnp.float32)
    # Both sum in fp32 and round once to bf16: at most one bf16 step apart.
    np.testing.assert_allclose(out, ref, atol=1e-2, rtol=1e-2)
    assert float(jnp.mean(out == ref)) > 0.9
    # The step's key rotated in the kernel, in fp32 and rounded once, as XLA's RoPE rounds it.
    written, stale, token = unwritten(case)
    out, (keys, values) = kernel_form(stale, token=token)
    np.testing.assert_allclose(out.astype(jnp.float32), xla_form(written).astype(jnp.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(keys.astype(jnp.float32), written["k_BKTE"].astype(jnp.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_array_equal(values, written["v_BKET"])


def test_a_prompt_chunk_that_holds_only_left_padding_adds_nothing():
    # 600 prompt slots are ten prefix chunks of 64; the first 400 slots are padding, so
    # the first six chunks have no real slot and their parts must weigh 0 in the merge.
    case = grouped_case(2, 3, 2, 3, 600, 24, 16, jnp.float32, seed=6)
    case = dict(case, prompt_mask_PS=jnp.broadcast_to(jnp.arange(600) >= 400, (2, 600)))
    assert decode_kernel.plan(6, 2, 2, 3, 600, 24).prefix_splits == 10
    np.testing.assert_allclose(kernel_form(case), xla_form(case), atol=2e-6, rtol=2e-6)


def test_at_setting_as_shape_the_attention_fills_an_h100_with_short_walks():
    # 64 rows of one prompt, 2 kv heads, 6 query heads each, 512 + 512 slots: at least two
    # programs for each of 132 SMs in the one launch, none walking more than 256 slots, and
    # no more parts for the merge than that takes: every program walks its longest, with
    # query tiles as tall as a completion program's rows. Read from the launched grid, not
    # only the plan.
    args = (jax.ShapeDtypeStruct((64, 2, 6, 128), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((1, 2, 512, 128), jnp.bfloat16)] * 2, jax.ShapeDtypeStruct((1, 512), bool),
            jax.ShapeDtypeStruct((64, 2, 512, 128), jnp.bfloat16), jax.ShapeDtypeStruct((64, 2, 128, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 512), bool), jax.ShapeDtypeStruct((64,), jnp.int32))
    jaxpr = jax.make_jaxpr(decode_kernel.grouped_decode_attention)(*args)
    grids = [e.params["grid_mapping"].grid for e in _pallas_calls(jaxpr.jaxpr)]
    assert len(grids) == 1 and decode_kernel.ONE_LAUNCH  # both passes in one launch
    programs = int(np.prod(grids[0]))
    split = decode_kernel.plan(64, 1, 2, 6, 512, 512)
    assert programs == split.programs >= decode_kernel.MIN_PROGRAMS == 264
    assert split.own_chunk == split.prefix_chunk == split.max_slots_per_program == 256 and split.query_tile == 16
    assert split.own_chunk * split.own_splits >= 512 and split.prefix_chunk * split.prefix_splits >= 512
    # the prefix pass reads the group's prompt once: one prompt, per kv head, per query tile and chunk
    assert split.prefix_programs == 2 * split.query_tiles * split.prefix_splits


def test_the_prompt_pass_fills_the_gpu_with_query_tiles_before_it_splits_the_prompt():
    # Four prompts of 64 rows: 16-row query tiles alone give 384 programs, so the prompt stays
    # in chunks of 256 slots, and the merge reads no more fp32 parts than it must.
    split = decode_kernel.plan(256, 4, 2, 6, 512, 512)
    assert split.query_tile == 16 and split.prefix_programs >= decode_kernel.MIN_PROGRAMS
    assert split.prefix_splits == 2


def test_both_passes_read_the_queries_from_the_qkv_heads_as_the_projection_wrote_them(launch):
    # No kernel before the attention rotates the queries or lays them out (a kernel a layer):
    # both passes take the qkv projection's heads through a reshape, which moves nothing.
    args = (jax.ShapeDtypeStruct((12, 16, 32), jnp.bfloat16), *[jax.ShapeDtypeStruct((12, 32), jnp.bfloat16)] * 2,
            *[jax.ShapeDtypeStruct((2, 2, 64, 32), jnp.bfloat16)] * 2, jax.ShapeDtypeStruct((2, 64), bool),
            jax.ShapeDtypeStruct((12, 2, 64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((12, 2, 32, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((12, 64), bool), jax.ShapeDtypeStruct((12,), jnp.int32))

    def decode(qkv, cos, sin, *cache):
        return decode_kernel.grouped_decode_attention(None, *cache, token=(qkv, cos, sin))

    inner = next(e.params["jaxpr"].jaxpr for e in jax.make_jaxpr(decode)(*args).jaxpr.eqns if e.primitive.name == "jit")
    calls = list(_pallas_calls(inner))
    # the prefix pass's queries are its first input (then the RoPE factors and the prompt's
    # three), the completion pass's the first after them
    queries = [calls[0].invars[0], calls[0].invars[6]] if launch else [c.invars[0] for c in calls]
    assert len(calls) == (1 if launch else 2) and queries[0] is queries[1]
    [made] = [e for e in inner.eqns if queries[0] in e.outvars]
    [qkv] = [v for v in inner.invars if v.aval.shape == (12, 16, 32)]
    assert made.primitive.name == "reshape" and made.invars[0] is qkv


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for value in eqn.params.values():
            if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
                yield from _pallas_calls(value.jaxpr)


def test_blocks_past_a_rows_length_are_never_read():
    # 256 completion slots are four of the kernel's blocks; NaN in every block a row has
    # not reached would show in its output if the block were read.
    case = grouped_case(2, 2, 1, 2, 16, 256, 16, jnp.float32, seed=2)
    first_unread = -(-case["length_B"] // 64) * 64
    beyond = jnp.arange(256)[None, None, :, None] >= first_unread[:, None, None, None]
    assert bool(jnp.any(beyond))
    poisoned = dict(case, k_BKTE=jnp.where(beyond, jnp.nan, case["k_BKTE"]),
                    v_BKET=jnp.where(jnp.swapaxes(beyond, -1, -2), jnp.nan, case["v_BKET"]))
    np.testing.assert_allclose(kernel_form(poisoned), xla_form(case), atol=2e-6, rtol=2e-6)


def test_a_wrong_length_changes_the_result():
    # The length bounds what the kernel reads, whatever ``allowed`` says: a row cut to 70
    # slots reads two blocks of 64 and misses the allowed slots 128-199, so the test above
    # could tell a kernel that ignored the length.
    case = grouped_case(1, 2, 1, 2, 16, 256, 16, jnp.float32, seed=3)
    case = dict(case, length_B=jnp.array([200, 200], jnp.int32),
                allowed_B1T=(jnp.arange(256) < 200)[None, None].repeat(2, axis=0))
    full, cut = kernel_form(case), kernel_form(dict(case, length_B=jnp.array([200, 70], jnp.int32)))
    np.testing.assert_allclose(full[0], cut[0], atol=1e-6)
    assert float(jnp.max(jnp.abs(full[1] - cut[1]))) > 1e-3


@pytest.mark.parametrize("implementation, head_dim, dtype, fits", [
    ("cudnn", 128, jnp.bfloat16, True), ("cudnn", 64, jnp.float16, True), ("xla", 128, jnp.bfloat16, False),
    ("cudnn", 96, jnp.bfloat16, False), ("cudnn", 8, jnp.bfloat16, False), ("cudnn", 128, jnp.float32, False)])
def test_the_kernel_runs_where_prefill_runs_cudnn_and_triton_can_tile_the_head(implementation, head_dim, dtype, fits):
    assert rollout.decode_kernel_fits(implementation, head_dim, dtype) is fits


@pytest.mark.cpu_mesh
@pytest.mark.parametrize("spec, prompts, samples", [
    ("fsdp=8", 8, 2),  # the prompts split with their rows
    ("fsdp=8", 2, 8),  # whole on every device; each device's 2 rows sample one prompt
    ("fsdp=8", 3, 8),  # whole on every device; a device's 3 rows straddle two prompts: the XLA form
    ("data=2,fsdp=4", 4, 4),  # the prompts split over data only, the rows over both: gathered, sliced
])
def test_on_a_mesh_each_device_attends_its_own_rows_to_their_prompts(monkeypatch, spec, prompts, samples):
    monkeypatch.setattr(decode_kernel, "grouped_decode_attention",
                        functools.partial(decode_kernel.grouped_decode_attention, interpret=True))
    mesh = mesh_lib.make_mesh(spec)
    case = grouped_case(prompts, samples, 2, 2, 24, 16, 16, jnp.float32, seed=4)
    written, stale, (qkv, cos, sin) = unwritten(case)
    stale = dict(stale, qkv=qkv, cos=cos, sin=sin)
    names = ["qkv", "cos", "sin", "prompt_k_PKSE", "prompt_v_PKSE", "prompt_mask_PS", "k_BKTE", "v_BKET",
             "allowed_B1T", "length_B"]
    placed = {k: jax.device_put(v, mesh_lib.logical_sharding(mesh, ("batch",) + (None,) * (v.ndim - 1), v.shape))
              for k, v in stale.items()}
    out, (keys, values) = jax.jit(lambda *a: rollout.attend_grouped_kernel(*a, mesh))(*[placed[k] for k in names])
    np.testing.assert_allclose(out, xla_form(written), atol=2e-6, rtol=2e-6)
    np.testing.assert_array_equal(keys, written["k_BKTE"])
    np.testing.assert_array_equal(values, written["v_BKET"])
    # With the projection's bias (whole on every device), as on one device.
    bias = jnp.asarray(np.random.default_rng(5).normal(size=qkv.shape[1:]), jnp.float32).reshape(-1)
    out, (keys, _) = jax.jit(lambda *a: rollout.attend_grouped_kernel(*a, mesh, bias))(*[placed[k] for k in names])
    alone, (alone_keys, _) = rollout.attend_grouped_kernel(*[stale[k] for k in names], None, bias)
    np.testing.assert_allclose(out, alone, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(keys, alone_keys, atol=2e-6, rtol=2e-6)
    assert not np.allclose(out, xla_form(written), atol=1e-3)


@pytest.mark.skipif(not ON_GPU, reason="compiles the Triton kernel: needs a GPU")
def test_the_compiled_kernel_matches_the_xla_form_on_a_gpu(launch):
    case = grouped_case(4, 16, 2, 6, 512, 512, 128, jnp.bfloat16, seed=5)
    out, ref = kernel_form(case, interpret=False).astype(jnp.float32), xla_form(case).astype(jnp.float32)
    np.testing.assert_allclose(out, ref, atol=1e-2, rtol=1e-2)
    # As decoding calls it: the step's token from the qkv heads, rotated and written by the kernel.
    written, stale, token = unwritten(case)
    out, (keys, values) = kernel_form(stale, interpret=False, token=token)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(xla_form(written)), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(f32(keys), f32(written["k_BKTE"]), atol=1e-2, rtol=1e-2)  # RoPE: a bf16 step at most
    np.testing.assert_array_equal(f32(values), f32(written["v_BKET"]))
    # With Qwen's qkv bias added in the kernel, as on heads that had it added before.
    qkv, cos, sin = token
    bias = jnp.asarray(np.random.default_rng(6).normal(size=qkv.shape[1:]), qkv.dtype)
    biased, (keys, values) = kernel_form(stale, interpret=False, token=(qkv, cos, sin, bias.reshape(-1)))
    added, (added_keys, added_values) = kernel_form(stale, interpret=False, token=(qkv + bias, cos, sin))
    np.testing.assert_allclose(f32(biased), f32(added), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(f32(keys), f32(added_keys), atol=1e-2, rtol=1e-2)
    np.testing.assert_array_equal(f32(values), f32(added_values))
