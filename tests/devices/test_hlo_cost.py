"""Flops, bytes and kernels counted from optimized HLO text (podsjax.devices.hlo_cost)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from podsjax.devices import hlo_cost

# A scan of 28 layers (XLA:GPU records its trip count) inside a data-dependent loop, as a
# sampler compiles: each layer reads one slice of a stacked weight and writes one token
# into a stacked cache in place.
GPU_STYLE = """HloModule decode, is_scheduled=true

%fused_slice (param_0: bf16[28,64,32], param_1: s32[]) -> bf16[64,32] {
  %param_0 = bf16[28,64,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,64,32]{2,1,0} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,64,32}
  ROOT %bitcast = bf16[64,32]{1,0} bitcast(%ds)
}

%fused_update (param_0.1: bf16[28,8,1024], param_1.1: bf16[1,8,1], param_2: s32[]) -> bf16[28,8,1024] {
  %param_0.1 = bf16[28,8,1024]{2,1,0} parameter(0)
  %param_1.1 = bf16[1,8,1]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero.1 = s32[] constant(0)
  ROOT %dus = bf16[28,8,1024]{2,1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2, %zero.1, %zero.1)
}

%layer_body (p: (s32[], bf16[8,64], bf16[28,64,32], bf16[28,8,1024])) -> (s32[], bf16[8,64], bf16[28,64,32], bf16[28,8,1024]) {
  %p = (s32[], bf16[8,64]{1,0}, bf16[28,64,32]{2,1,0}, bf16[28,8,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,64]{1,0} get-tuple-element(%p), index=1
  %w = bf16[28,64,32]{2,1,0} get-tuple-element(%p), index=2
  %cache = bf16[28,8,1024]{2,1,0} get-tuple-element(%p), index=3
  %slice = bf16[64,32]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %gemm = (bf16[8,32]{1,0}, s8[1024]{0}) custom-call(%x, %slice), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %y = bf16[8,32]{1,0} get-tuple-element(%gemm), index=0
  %token = bf16[1,8,1]{2,1,0} bitcast(%y)
  %new_cache = bf16[28,8,1024]{2,1,0} fusion(%cache, %token, %i), kind=kLoop, calls=%fused_update
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[8,64]{1,0}, bf16[28,64,32]{2,1,0}, bf16[28,8,1024]{2,1,0}) tuple(%next, %x, %w, %new_cache)
}

%layer_cond (q: (s32[], bf16[8,64], bf16[28,64,32], bf16[28,8,1024])) -> pred[] {
  %q = (s32[], bf16[8,64]{1,0}, bf16[28,64,32]{2,1,0}, bf16[28,8,1024]{2,1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(28)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

%step_body (s: (s32[], bf16[8,64], bf16[28,64,32], bf16[28,8,1024])) -> (s32[], bf16[8,64], bf16[28,64,32], bf16[28,8,1024]) {
  %s = (s32[], bf16[8,64]{1,0}, bf16[28,64,32]{2,1,0}, bf16[28,8,1024]{2,1,0}) parameter(0)
  %x.1 = bf16[8,64]{1,0} get-tuple-element(%s), index=1
  %w.1 = bf16[28,64,32]{2,1,0} get-tuple-element(%s), index=2
  %c.1 = bf16[28,8,1024]{2,1,0} get-tuple-element(%s), index=3
  %start = s32[] constant(0)
  %init = (s32[], bf16[8,64]{1,0}, bf16[28,64,32]{2,1,0}, bf16[28,8,1024]{2,1,0}) tuple(%start, %x.1, %w.1, %c.1)
  %layers = (s32[], bf16[8,64]{1,0}, bf16[28,64,32]{2,1,0}, bf16[28,8,1024]{2,1,0}) while(%init), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"28"}}
  ROOT %copy = (s32[], bf16[8,64]{1,0}, bf16[28,64,32]{2,1,0}, bf16[28,8,1024]{2,1,0}) copy(%layers)
}

%step_cond (r: (s32[], bf16[8,64], bf16[28,64,32], bf16[28,8,1024])) -> pred[] {
  %r = (s32[], bf16[8,64]{1,0}, bf16[28,64,32]{2,1,0}, bf16[28,8,1024]{2,1,0}) parameter(0)
  ROOT %done = pred[] custom-call(%r), custom_call_target="data_dependent"
}

ENTRY %main (a: bf16[8,64], b: bf16[28,64,32], c: bf16[28,8,1024]) -> bf16[28,8,1024] {
  %a = bf16[8,64]{1,0} parameter(0)
  %b = bf16[28,64,32]{2,1,0} parameter(1)
  %c = bf16[28,8,1024]{2,1,0} parameter(2)
  %zero.2 = s32[] constant(0)
  %go = (s32[], bf16[8,64]{1,0}, bf16[28,64,32]{2,1,0}, bf16[28,8,1024]{2,1,0}) tuple(%zero.2, %a, %b, %c)
  %steps = (s32[], bf16[8,64]{1,0}, bf16[28,64,32]{2,1,0}, bf16[28,8,1024]{2,1,0}) while(%go), condition=%step_cond, body=%step_body
  ROOT %out = bf16[28,8,1024]{2,1,0} get-tuple-element(%steps), index=3
}
"""

SLICE = 64 * 32 * 2  # one layer's weight slice, bytes
TOKEN = 8 * 2  # one token per row written into the cache


def test_a_layer_scan_costs_its_body_times_its_trip_count():
    (trips, step), = hlo_cost.while_loops(GPU_STYLE)
    assert trips is None  # the sampling loop's length depends on the data
    # Per layer: the slice copy (the slice and its index in, the slice out), the GEMM (x,
    # the slice, its result; no workspace), the in-place cache write (token and index in,
    # the token out), the counter's add and the condition's compare (scalars); then one copy
    # of the whole loop state after the scan and the step condition reading the state.
    state = 4 + 8 * 64 * 2 + 28 * 64 * 32 * 2 + 28 * 8 * 1024 * 2
    gemm = 8 * 64 * 2 + SLICE + 8 * 32 * 2
    per_layer = (2 * SLICE + 4) + gemm + (2 * TOKEN + 4) + (4 + 4 + 4) + (4 + 4 + 1)
    assert step.bytes == 28 * per_layer + 2 * state + (state + 1)
    assert step.flops == 28 * 2 * 8 * 32 * 64
    assert step.kernels == 28 * 5 + 2


def test_a_tpu_style_counter_loop_has_its_trip_count_inferred():
    # The TPU compiler records no trip count: a counter from constant 0 compared with 28.
    text = GPU_STYLE.replace(', backend_config={"known_trip_count":{"n":"28"}}', "")
    (_, step), = hlo_cost.while_loops(text)
    (_, recorded), = hlo_cost.while_loops(GPU_STYLE)
    assert step.bytes == recorded.bytes and step.kernels == recorded.kernels


def test_a_roofline_takes_the_slower_of_bytes_and_flops_per_kernel():
    (_, step), = hlo_cost.while_loops(GPU_STYLE, bandwidth=1e9, peak_flops=1e12)
    assert step.roofline_s == pytest.approx(step.bytes / 1e9 + 0.0, rel=1e-3)  # every kernel is memory-bound here
    (_, compute_bound), = hlo_cost.while_loops(GPU_STYLE, bandwidth=1e18, peak_flops=1.0)
    assert compute_bound.roofline_s == pytest.approx(step.flops)
    # A GEMM as slow in flops as in bytes counts once, not twice (its time is the slower, not the sum).
    gemm = 8 * 64 * 2 + SLICE + 8 * 32 * 2
    (_, balanced), = hlo_cost.while_loops(GPU_STYLE, bandwidth=1e9, peak_flops=2 * 8 * 32 * 64 / (gemm / 1e9))
    assert balanced.roofline_s == pytest.approx(step.bytes / 1e9, rel=1e-3)


def test_type_bytes_reads_arrays_and_tuples_and_skips_library_scratch():
    assert hlo_cost.type_bytes("bf16[2,3]{1,0}") == 12
    assert hlo_cost.type_bytes("(f32[4]{0}, s8[100]{0})") == 116
    assert hlo_cost.type_bytes("(f32[4]{0}, s8[100]{0})", skip_scratch=True) == 16
    assert hlo_cost.type_bytes("bf16[8,128]{1,0:T(8,128)(2,1)}") == 2048  # a TPU tiling is a layout, not bytes


def test_arrays_in_another_memory_space_cost_no_hbm_traffic():
    assert hlo_cost.type_bytes("bf16[8,128]{1,0:T(8,128)(2,1)S(1)}") == 0  # a TPU's VMEM
    assert hlo_cost.type_bytes("(f32[4]{0:S(1)}, f32[4]{0}, u32[]{:S(2)})") == 16
    assert hlo_cost.type_bytes("bf16[8,128]{1,0:T(8,128)(2,1)S(1)}", in_hbm_only=False) == 2048


# A TPU decode layer as its compiler leaves it: the layer's cache slice is sliced out of
# the stacked cache in HBM into VMEM (S(1)); the attention fusion reads it there and writes
# its result there; a weight slice is prefetched with an async slice, a vector copied back.
TPU_VMEM = """HloModule decode, is_scheduled=true

%fused_slice (param_0: bf16[28,64,1024], param_1: s32[]) -> bf16[1,64,1024] {
  %param_0 = bf16[28,64,1024]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s32[]{:T(128)} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  ROOT %ds = bf16[1,64,1024]{2,1,0:T(8,128)(2,1)S(1)} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,64,1024}
}

%fused_attend (param_0.1: bf16[1,64,1024], param_1.1: bf16[64,1024]) -> f32[64,1024] {
  %param_0.1 = bf16[1,64,1024]{2,1,0:T(8,128)(2,1)S(1)} parameter(0)
  %param_1.1 = bf16[64,1024]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  %b = bf16[64,1024]{1,0:T(8,128)(2,1)S(1)} bitcast(%param_0.1)
  %m = bf16[64,1024]{1,0:T(8,128)(2,1)S(1)} multiply(%b, %param_1.1)
  ROOT %c = f32[64,1024]{1,0:T(8,128)S(1)} convert(%m)
}

ENTRY %main (cache: bf16[28,64,1024], q: bf16[64,1024], w: bf16[28,512,128], v: f32[64]) -> (f32[64,1024], bf16[7,512,128], f32[64]) {
  %cache = bf16[28,64,1024]{2,1,0:T(8,128)(2,1)} parameter(0)
  %q = bf16[64,1024]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  %w = bf16[28,512,128]{2,1,0:T(8,128)(2,1)} parameter(2)
  %v = f32[64]{0:T(128)S(1)} parameter(3)
  %i = s32[]{:T(128)} constant(3)
  %layer = bf16[1,64,1024]{2,1,0:T(8,128)(2,1)S(1)} fusion(%cache, %i), kind=kLoop, calls=%fused_slice
  %out = f32[64,1024]{1,0:T(8,128)S(1)} fusion(%layer, %q), kind=kLoop, calls=%fused_attend
  %ss = ((bf16[28,512,128]{2,1,0:T(8,128)(2,1)}), bf16[7,512,128]{2,1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:7], [0:512], [0:128]}
  %sd = bf16[7,512,128]{2,1,0:T(8,128)(2,1)S(1)} slice-done(%ss)
  %cs = (f32[64]{0:T(128)}, f32[64]{0:T(128)S(1)}, u32[]{:S(2)}) copy-start(%v)
  %cd = f32[64]{0:T(128)} copy-done(%cs)
  ROOT %t = (f32[64,1024]{1,0:T(8,128)S(1)}, bf16[7,512,128]{2,1,0:T(8,128)(2,1)S(1)}, f32[64]{0:T(128)}) tuple(%out, %sd, %cd)
}
"""


def test_a_tpu_program_counts_hbm_traffic_only():
    cost = hlo_cost.program_cost(TPU_VMEM)
    layer = 64 * 1024 * 2  # the cache slice read from HBM, written to VMEM
    prefetch = 7 * 512 * 128 * 2  # the weight slice read from HBM, written to VMEM
    evict = 64 * 4  # the vector read from VMEM, written to HBM
    # The attention fusion reads and writes VMEM only: no HBM bytes. (+ 4: the slice's index.)
    assert cost.bytes == layer + prefetch + evict + 4
    assert cost.kernels == 4


# A TPU kernel handed the whole stacked cache [4, 8, 16, 256] that reads one layer of it, with
# the cost it declares (Pallas's cost_estimate), and one that declares nothing.
TPU_KERNEL = """
HloModule kernel

ENTRY %main (cache: bf16[4,8,16,256], q: bf16[8,256]) -> (bf16[8,256], bf16[8,256]) {
  %cache = bf16[4,8,16,256]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %q = bf16[8,256]{1,0:T(8,128)(2,1)} parameter(1)
  %declared = bf16[8,256]{1,0:T(8,128)(2,1)} custom-call(%q, %cache), custom_call_target="tpu_custom_call", backend_config={"flag_configs":[],"custom_call_config":{"body":"AAAA","cost_estimate":{"flops":"4096","transcendentals":"128","bytes_accessed":"73728","remote_bytes_transferred":"0"}}}
  %silent = bf16[8,256]{1,0:T(8,128)(2,1)} custom-call(%q, %cache), custom_call_target="tpu_custom_call", backend_config={"flag_configs":[],"custom_call_config":{"body":"AAAA"}}
  ROOT %t = (bf16[8,256]{1,0:T(8,128)(2,1)}, bf16[8,256]{1,0:T(8,128)(2,1)}) tuple(%declared, %silent)
}
"""


def test_a_tpu_kernel_counts_what_it_declares_and_otherwise_its_operands():
    cost = hlo_cost.program_cost(TPU_KERNEL)
    operands = 8 * 256 * 2 + 4 * 8 * 16 * 256 * 2 + 8 * 256 * 2  # q, the whole cache, the output
    assert cost.bytes == 73728 + operands
    assert cost.flops == 4096
    assert cost.kernels == 2


def test_the_text_reads_as_computations_of_instructions():
    from podsjax.devices import hlo_text

    computations, entry = hlo_text.parse_module(GPU_STYLE)
    assert entry == "main" and set(computations) == {"fused_slice", "fused_update", "layer_body", "layer_cond",
                                                     "step_body", "step_cond", "main"}
    by_name = {i.name: i for i in computations["layer_body"]}
    gemm = by_name["gemm"]  # a tuple result type, a JSON backend config with nested braces
    assert (gemm.type, gemm.opcode, gemm.operands) == ("(bf16[8,32]{1,0}, s8[1024]{0})", "custom-call", ["x", "slice"])
    assert hlo_text.backend_config(gemm.attrs)["gemm_backend_config"]["dot_dimension_numbers"][
        "lhs_contracting_dimensions"] == ["1"]
    assert hlo_text.called_computations(by_name["slice"].attrs, "calls") == ["fused_slice"]
    assert by_name["t"].root and not gemm.root
    layers = next(i for i in computations["step_body"] if i.opcode == "while")
    assert hlo_text.called_computations(layers.attrs, "body") == ["layer_body"]
    assert [hlo_text.constant_value(i) for i in computations["layer_cond"]] == [None, None, 28, None]
    assert hlo_text.arrays("(f32[4]{0:S(1)}, s32[]{:S(2)})") == [("f32", (4,)), ("s32", ())]
    assert hlo_text.arrays("(f32[4]{0:S(1)}, s32[]{:S(2)})", in_hbm_only=True) == []
    assert hlo_cost.parse_module is hlo_text.parse_module and hlo_cost.type_bytes is hlo_text.type_bytes


def test_a_sampling_loop_that_runs_its_steps_in_chunks_costs_one_step():
    w = jnp.ones((256, 256), jnp.float32)

    def step(c):
        i, x = c
        return i + 1, jnp.tanh(x @ w)

    def cond(c):
        return (c[0] < 64) & (c[1][0, 0] < 5.0)  # the length depends on the data

    def plain(x):
        return lax.while_loop(cond, step, (0, x))

    def chunked(x):
        return lax.while_loop(cond, lambda c: lax.fori_loop(0, 4, lambda _, c: step(c), c), (0, x))

    x = jnp.ones((64, 256), jnp.float32)
    one, per_chunk = (hlo_cost.data_loop_step(jax.jit(f).lower(x).compile().as_text()) for f in (plain, chunked))
    assert one.flops == per_chunk.flops == 2 * 64 * 256 * 256
    text = jax.jit(chunked).lower(x).compile().as_text()
    (_, whole_chunk), = hlo_cost.while_loops(text)
    assert whole_chunk.flops == 4 * one.flops
    # Without its sampling loop the program multiplies nothing (the loop counted once in the whole).
    rest, step = hlo_cost.sampling_costs(text)
    assert hlo_cost.program_cost(text).flops == 4 * one.flops and rest.flops == 0 and step == per_chunk
    assert per_chunk.bytes == pytest.approx(one.bytes, rel=0.25)
