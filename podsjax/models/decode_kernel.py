"""Grouped decode attention as two passes of GPU programs (Pallas, lowered through Triton) and a merge.

A decode step's attention reads each row's completion and its group's prompt. One program
per row and kv head walking both (128 programs at setting a's shape) ran at 188 us a layer
on an H200 against 3.6 us of bytes, so the work is split as flash decoding and cascade
(shared-prefix) attention split it:

- **prefix pass**: per prompt and kv head, the group's n rows x G query heads form one
  query matrix against the prompt's keys and values, read once for the whole group, as
  tensor-core matmuls; the prompt's slots are split over programs;
- **completion pass**: per row and kv head, the row's own completion, split over
  programs of at most :data:`MAX_SLOTS_PER_PROGRAM` slots, each stopping at the row's
  write slot (a split past it reads nothing);
- **merge**: every part keeps its running maximum and sum (an online softmax); XLA combines
  the parts by their log-sum-exp.

Both passes run in one launch (:data:`ONE_LAUNCH`, :mod:`~podsjax.models.decode_launch`),
the prefix pass's programs first. Decoding hands the kernel the step's token as the qkv
projection left it: the passes gather their queries from the heads, add the projection's
bias and rotate them (RoPE); the completion pass does so for the key and value too, attends
to them from registers and writes them into the cache. No kernel before it touches them.
:func:`plan` says how a shape splits; tests check it fills an H100 in one wave.

Numerics: scores and sums are fp32. A 16-bit cache's scores are bf16/fp16 products summed
in fp32 (exact products, as the XLA form's upcast ones); the probabilities enter the
values' matmul as two 16-bit parts (high and low), so they keep about 16 bits. An fp32
cache (tests) runs fp32 dots. The kernels agree with the XLA form to fp32 rounding in fp32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from podsjax.models import decode_launch as launch

MIN_PROGRAMS = 264  # two programs for each of an H100's (and H200's) 132 SMs
MAX_SLOTS_PER_PROGRAM = 256  # the longest serial walk a program makes
_MIN_DOT = 16  # Triton's dots take tiles of at least 16 along each dimension
_BLOCK = 64  # cache slots per loop iteration
_QUERY_TILE = 64  # rows of the prefix pass's query matrix per program
_NEG = 0.7 * float(jnp.finfo(jnp.float32).min)  # masked scores: exp underflows to 0, no inf - inf
ONE_LAUNCH = True  # both passes in one kernel launch (False: a launch each, one after the other)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one layer's attention splits into programs.

    Attributes:
        block: cache slots per loop iteration.
        prefix_chunk, prefix_splits: prompt slots per prefix program, and chunks a prompt.
        query_tile, query_tiles: rows of a group's query matrix (n x G) per program, and tiles.
        own_chunk, own_splits: completion slots per completion program, and chunks a row.
        prefix_programs, own_programs: the two grids' sizes.
    """

    block: int
    prefix_chunk: int
    prefix_splits: int
    query_tile: int
    query_tiles: int
    own_chunk: int
    own_splits: int
    prefix_programs: int
    own_programs: int

    @property
    def programs(self) -> int:
        return self.prefix_programs + self.own_programs

    @property
    def max_slots_per_program(self) -> int:
        return max(self.prefix_chunk, self.own_chunk)


def plan(rows: int, prompts: int, kv_heads: int, groups: int, prompt_len: int, slots: int) -> Plan:
    """The split of :func:`grouped_decode_attention` for ``rows`` rows sampling ``prompts`` prompts.

    In one launch (:data:`ONE_LAUNCH`) the passes fill the GPU together, in one wave: each
    starts at its longest walk, with prefix query tiles as tall as a completion program's
    rows (taller ones raise the one kernel's registers), and the chunks halve, the
    completion's first, while the launch has under :data:`MIN_PROGRAMS` programs (setting a:
    96 + 256 programs, 0.89 waves on an H100; docs/accelerators.md). Launched apart, each
    pass fills the GPU alone, the prefix pass halving its query tile (down to 16) before its
    chunk.
    """
    block = min(_BLOCK, max(_MIN_DOT, _next_pow2(max(prompt_len, slots))))
    own_chunk = max(block, min(MAX_SLOTS_PER_PROGRAM, _next_pow2(slots)))
    prefix_chunk = max(block, min(MAX_SLOTS_PER_PROGRAM, _next_pow2(prompt_len)))
    queries = rows // prompts * groups
    query_tile = min(_QUERY_TILE, max(_MIN_DOT, _next_pow2(queries)))

    def prefix_programs(tile: int, chunk: int) -> int:
        return prompts * kv_heads * pl.cdiv(queries, tile) * pl.cdiv(prompt_len, chunk)

    def own_programs(chunk: int) -> int:
        return rows * kv_heads * pl.cdiv(slots, chunk)

    if ONE_LAUNCH:
        query_tile = min(query_tile, _own_rows(groups))
        while prefix_programs(query_tile, prefix_chunk) + own_programs(own_chunk) < MIN_PROGRAMS:
            if own_chunk > block:
                own_chunk //= 2
            elif prefix_chunk > block:
                prefix_chunk //= 2
            else:
                break
    else:
        while own_chunk > block and own_programs(own_chunk) < MIN_PROGRAMS:
            own_chunk //= 2
        while query_tile > _MIN_DOT and prefix_programs(query_tile, prefix_chunk) < MIN_PROGRAMS:
            query_tile //= 2
        while prefix_chunk > block and prefix_programs(query_tile, prefix_chunk) < MIN_PROGRAMS:
            prefix_chunk //= 2
    return Plan(block=block, prefix_chunk=prefix_chunk, prefix_splits=pl.cdiv(prompt_len, prefix_chunk),
                query_tile=query_tile, query_tiles=pl.cdiv(queries, query_tile), own_chunk=own_chunk,
                own_splits=pl.cdiv(slots, own_chunk), prefix_programs=prefix_programs(query_tile, prefix_chunk),
                own_programs=own_programs(own_chunk))


def _scores(q, keys):
    """``q [Q, E] @ keys [S, E]^T`` summed in fp32: 16-bit operands on tensor cores, fp32 ones exact."""
    return plgpu.dot(q, keys, trans_b=True, allow_tf32=False)


def _weighted(p, values, slots_last: bool):
    """``p [Q, S] @ values`` in fp32; a 16-bit ``values`` takes ``p`` as a high and a low 16-bit part."""
    if values.dtype == jnp.float32:
        return plgpu.dot(p, values, trans_b=slots_last, allow_tf32=False)
    high = p.astype(values.dtype)
    low = (p - high.astype(jnp.float32)).astype(values.dtype)
    return (plgpu.dot(high, values, trans_b=slots_last, allow_tf32=False)
            + plgpu.dot(low, values, trans_b=slots_last, allow_tf32=False))


def _attend_blocks(q, keys_ref, values_ref, real_ref, start, stop, count, *, block: int, scale: float,
                   slots_last: bool, written=None):
    """Online softmax of ``q`` (unscaled) over slots ``[start, stop)`` of one cache part, ``count`` blocks.

    ``written``: ``(slot, key [E], value [E])``, read at ``slot`` instead of the cache (not yet written).
    Returns the unnormalised output ``[Q, E]``, the running maximum and sum ``[Q]`` (fp32)."""
    offsets = jnp.arange(block)

    def step(i, carry):
        o, top, total = carry
        first = start + i * block
        inside = first + offsets < stop
        window = pl.ds(first, block)
        keys = plgpu.load(keys_ref.at[window, :], mask=inside[:, None], other=0)
        if written is not None:
            at_slot = first + offsets == written[0]
            keys = jnp.where(at_slot[:, None], written[1][None, :], keys)
        real = plgpu.load(real_ref.at[window], mask=inside, other=0) != 0
        scores = jnp.where(real[None, :], _scores(q, keys) * scale, _NEG)
        if slots_last:
            values = plgpu.load(values_ref.at[:, window], mask=inside[None, :], other=0)
        else:
            values = plgpu.load(values_ref.at[window, :], mask=inside[:, None], other=0)
        if written is not None:  # the values are slots last
            values = jnp.where(at_slot[None, :], written[2][:, None], values)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        correction = jnp.exp(top - new_top)
        p = jnp.exp(scores - new_top[:, None])
        return o * correction[:, None] + _weighted(p, values, slots_last), new_top, total * correction + p.sum(-1)

    rows, e = q.shape
    carry = (jnp.zeros((rows, e), jnp.float32), jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    return jax.lax.fori_loop(0, count, step, carry)


def _gathered(ref, rows, cols):
    """``ref[rows[i], cols[j]]`` as ``[len(rows), len(cols)]``, from a 2-D ref: one load of
    rows that a BlockSpec cannot pick (Triton computes each element's pointer)."""
    shape = (rows.shape[0], cols.shape[0])
    return ref[jnp.broadcast_to(rows[:, None], shape), jnp.broadcast_to(cols[None, :], shape)]


def _queries(heads_ref, index, valid, rope=None, bias_ref=None):
    """Queries ``[Q, E]``: rows ``index`` of ``heads_ref [B * heads a row, E]`` (rows not
    ``valid`` come out 0), plus rows ``index % heads a row`` of ``bias_ref [heads a row, E]``;
    ``rope``: RoPE factors ``[Q or 1, E]`` to rotate them by (:func:`rotate_half`)."""
    e = heads_ref.shape[1]
    index, cols = jnp.where(valid, index, 0), jnp.arange(e)

    def load(cols):
        q = _gathered(heads_ref, index, cols)
        return q if bias_ref is None else q + _gathered(bias_ref, index % bias_ref.shape[0], cols)

    q = load(cols)
    if rope is not None:  # the halves swapped are a second load
        q = rotate_half(q, load((cols + e // 2) % e), *rope)
    return jnp.where(valid[:, None], q, 0).astype(q.dtype)


def _prefix_part(*refs, samples: int, groups: int, per_row: int, rotate: bool, biased: bool, prompt_len: int,
                 chunk: int, block: int, scale: float):
    """One prompt, kv head, query tile and prompt chunk (refs, then those four). Refs: the
    query heads ``[B * per_row, E]`` (row b's query head j at ``b * per_row + j``), [``rotate``:
    RoPE factors ``[B, E]`` each], [``biased``: the heads' bias ``[per_row, E]``], k/v ``[S, E]``,
    mask ``[S]``; out o ``[Tq, E]``, top/total ``[Tq]``, for a tile of the group's n rows x G
    queries (row-major)."""
    *refs, prompt, head, tile_index, chunk_index = refs
    heads_ref, *refs = refs
    cos_ref, sin_ref, *refs = refs if rotate else (None, None, *refs)
    bias_ref, *refs = refs if biased else (None, *refs)
    k_ref, v_ref, mask_ref, o_ref, top_ref, total_ref = refs
    tile = o_ref.shape[0]
    query = tile_index * tile + jnp.arange(tile)
    valid = query < samples * groups
    rows = jnp.where(valid, prompt * samples + query // groups, 0)
    rope = None
    if rotate:
        cols = jnp.arange(cos_ref.shape[1])
        rope = (_gathered(cos_ref, rows, cols), _gathered(sin_ref, rows, cols))
    q = _queries(heads_ref, rows * per_row + head * groups + query % groups, valid, rope, bias_ref)
    start = chunk_index * chunk
    o, top, total = _attend_blocks(q, k_ref, v_ref, mask_ref, start, jnp.minimum(start + chunk, prompt_len),
                                   pl.cdiv(chunk, block), block=block, scale=scale, slots_last=False)
    o_ref[...] = o
    top_ref[...] = top
    total_ref[...] = total


def _own_part(*refs, groups: int, per_row: int, slots: int, chunk: int, block: int, scale: float, write: bool,
              biased: bool):
    """One row, kv head and completion chunk (refs, then those three). Refs: the query heads
    ``[B * per_row, E]`` (before RoPE with ``write``), k ``[T, E]``, v ``[E, T]``, allowed ``[T]``,
    length ``[1]``, [``write``: new key (before RoPE), value, RoPE factors, ``[E]`` each],
    [``biased``: the heads' bias ``[per_row, E]``, the new key's and value's ``[E]``]; out o
    ``[GP, E]``, top/total ``[GP]``, [k, v with the new ones at slot ``length - 1``]."""
    *refs, row, head, chunk_index = refs
    heads_ref, k_ref, v_ref, allowed_ref, length_ref, *refs = refs
    new_k_ref, new_v_ref, cos_ref, sin_ref, *refs = refs if write else (None,) * 4 + tuple(refs)
    bias_ref, k_bias_ref, v_bias_ref, *refs = refs if biased else (None,) * 3 + tuple(refs)
    o_ref, top_ref, total_ref, *cache_out = refs
    gp = o_ref.shape[0]
    real_rows = jnp.arange(gp) < groups
    rope = (cos_ref[...][None, :], sin_ref[...][None, :]) if write else None
    q = _queries(heads_ref, row * per_row + head * groups + jnp.arange(gp), real_rows, rope, bias_ref)
    start = chunk_index * chunk
    stop = jnp.minimum(jnp.minimum(start + chunk, slots), length_ref[0])
    slot = length_ref[0] - 1
    written, e = None, heads_ref.shape[1]
    if write:  # the key with its halves swapped is a second load of it
        swapped = (jnp.arange(e) + e // 2) % e
        raw_key, raw_swapped, value = new_k_ref[...], new_k_ref[swapped], new_v_ref[...]
        if biased:
            raw_key, raw_swapped = raw_key + k_bias_ref[...], raw_swapped + k_bias_ref[swapped]
            value = value + v_bias_ref[...]
        written = (slot, rotate_half(raw_key, raw_swapped, cos_ref[...], sin_ref[...]), value)
    o, top, total = _attend_blocks(q, k_ref, v_ref, allowed_ref, start, stop,
                                   pl.cdiv(jnp.maximum(stop - start, 0), block), block=block, scale=scale,
                                   slots_last=True, written=written)
    if write:
        @pl.when((start <= slot) & (slot < stop))
        def _():
            plgpu.store(cache_out[0].at[pl.ds(slot, 1), :], written[1][None, :])
            plgpu.store(cache_out[1].at[:, pl.ds(slot, 1)], written[2][:, None])

    plgpu.store(o_ref, o, mask=real_rows[:, None])
    plgpu.store(top_ref, top, mask=real_rows)
    plgpu.store(total_ref, total, mask=real_rows)


def rotate_half(x, swapped, cos, sin):
    """RoPE of ``x [.., E]``: ``x * cos + swapped * sin`` (:func:`rope_factors`) in fp32, rounded once."""
    x32, swapped32, cos32, sin32 = (v.astype(jnp.float32) for v in (x, swapped, cos, sin))
    return (x32 * cos32 + swapped32 * sin32).astype(x.dtype)


def rope_factors(cos_BF: jax.Array, sin_BF: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE's tables ``[B, E/2]`` as the factors ``[B, E]`` that :func:`rotate_half` takes."""
    return jnp.concatenate([cos_BF, cos_BF], -1), jnp.concatenate([-sin_BF, sin_BF], -1)  # once a step


def _part_shapes(rows: tuple[int, ...], e: int) -> list[jax.ShapeDtypeStruct]:
    """What a pass writes for each of its ``rows``: the unnormalised output ``[.., E]``, the
    running maximum and the running sum, in fp32."""
    return [jax.ShapeDtypeStruct((*rows, e), jnp.float32), jax.ShapeDtypeStruct(rows, jnp.float32),
            jax.ShapeDtypeStruct(rows, jnp.float32)]


def _own_rows(groups: int) -> int:
    return max(_MIN_DOT, _next_pow2(groups))


def _whole(x) -> pl.BlockSpec:
    """All of ``x`` for every program (its rows read by computed index)."""
    return pl.BlockSpec(x.shape, lambda *ids: (0,) * x.ndim)


@dataclasses.dataclass(frozen=True)
class _Queries:
    """Where the passes read their queries: ``heads [B * per_row, E]``, row b's query head j
    at ``b * per_row + j``; ``factors``: RoPE factors ``[B, E]`` to rotate them by, or None;
    ``bias``: the heads' bias ``[per_row, E]``, added first, or None."""

    heads: jax.Array
    per_row: int
    groups: int
    factors: tuple | None
    bias: jax.Array | None = None


def _prefix_pass(queries: _Queries, prompts: int, k: int, prompt_len: int, split: Plan, scale: float) -> launch.Pass:
    """The prefix pass, writing ``(o [P, K, splits, Tq * tiles, E], top, total [P, K, splits, Tq * tiles])``."""
    rows_per_prompt = queries.heads.shape[0] // queries.per_row // prompts
    e, tile = queries.heads.shape[1], split.query_tile
    rotate, biased = queries.factors is not None, queries.bias is not None
    return launch.Pass(
        kernel=functools.partial(_prefix_part, samples=rows_per_prompt, groups=queries.groups,
                                 per_row=queries.per_row, rotate=rotate, biased=biased, prompt_len=prompt_len,
                                 chunk=split.prefix_chunk, block=split.block, scale=scale),
        part_ids=lambda ids: ids,  # the prompt, kv head, query tile and prompt chunk
        grid=(prompts, k, split.query_tiles, split.prefix_splits),
        in_specs=[
            _whole(queries.heads), *([_whole(x) for x in queries.factors] if rotate else []),
            *([_whole(queries.bias)] if biased else []),
            pl.BlockSpec((None, None, prompt_len, e), lambda i, h, t, s: (i, h, 0, 0)),
            pl.BlockSpec((None, None, prompt_len, e), lambda i, h, t, s: (i, h, 0, 0)),
            pl.BlockSpec((None, prompt_len), lambda i, h, t, s: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, tile, e), lambda i, h, t, s: (i, h, s, t, 0)),
            pl.BlockSpec((None, None, None, tile), lambda i, h, t, s: (i, h, s, t)),
            pl.BlockSpec((None, None, None, tile), lambda i, h, t, s: (i, h, s, t)),
        ],
        out_shape=_part_shapes((prompts, k, split.prefix_splits, tile * split.query_tiles), e),
        name="grouped_decode_prefix")


def _own_pass(queries: _Queries, cache: tuple, split: Plan, scale: float, qkv_BNE) -> launch.Pass:
    """The completion pass, writing ``(o [B, K, splits, G, E], top, total [B, K, splits, G])``,
    and with the token's ``qkv_BNE`` the completions' ``cache`` (k, v), each row's token put in
    from its heads ``[B, H + 2K, E]``."""
    rows, k, slots, e = cache[0].shape
    groups, write, biased = queries.groups, qkv_BNE is not None, queries.bias is not None
    gp, heads = _own_rows(groups), k * groups
    keys = pl.BlockSpec((None, None, slots, e), lambda r, h, s: (r, h, 0, 0))
    values = pl.BlockSpec((None, None, e, slots), lambda r, h, s: (r, h, 0, 0))
    new = [pl.BlockSpec((None, None, e), lambda r, h, s: (r, heads + h, 0)),
           pl.BlockSpec((None, None, e), lambda r, h, s: (r, heads + k + h, 0)),
           *[pl.BlockSpec((None, e), lambda r, h, s: (r, 0))] * 2] if write else []
    bias = [_whole(queries.bias), pl.BlockSpec((None, e), lambda r, h, s: (heads + h, 0)),
            pl.BlockSpec((None, e), lambda r, h, s: (heads + k + h, 0))] if biased else []
    return launch.Pass(
        kernel=functools.partial(_own_part, groups=groups, per_row=queries.per_row, slots=slots,
                                 chunk=split.own_chunk, block=split.block, scale=scale, write=write, biased=biased),
        part_ids=lambda ids: ids,  # the row, kv head and completion chunk
        grid=(rows, k, split.own_splits),
        in_specs=[_whole(queries.heads), keys, values, pl.BlockSpec((None, slots), lambda r, h, s: (r, 0)),
                  pl.BlockSpec((None, 1), lambda r, h, s: (r, 0)), *new, *bias],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, e), lambda r, h, s: (r, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda r, h, s: (r, h, s, 0)),
            pl.BlockSpec((None, None, None, gp), lambda r, h, s: (r, h, s, 0)),
            *([keys, values] if write else []),
        ],
        out_shape=_part_shapes((rows, k, split.own_splits, groups), e)
        + ([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in cache] if write else []),
        name="grouped_decode_completion",
        aliases={1: 3, 2: 4} if write else {})


@functools.partial(jax.jit, static_argnames=("interpret",))
def grouped_decode_attention(q_BKGE: jax.Array | None, prompt_k_PKSE: jax.Array, prompt_v_PKSE: jax.Array,
                             prompt_mask_PS: jax.Array, k_BKTE: jax.Array, v_BKET: jax.Array,
                             allowed_BT: jax.Array, length_B: jax.Array, token: tuple | None = None, *,
                             interpret: bool = False):
    """Softmax attention of one query per head and row over its prompt's KV and its own.

    Args:
        q_BKGE: the queries, G per kv head, in the cache's dtype; None with ``token``, whose
            qkv heads hold them before RoPE.
        prompt_k_PKSE, prompt_v_PKSE, prompt_mask_PS: the prompts' cache (row b reads prompt
            ``b // (B // P)``) and which of its slots hold tokens.
        k_BKTE, v_BKET: the rows' completions (values slots last), ``allowed_BT`` the slots
            each row attends to.
        length_B: completion slots to read per row; slots from it on must not be allowed.
        token: ``(qkv_BNE, cos_BE, sin_BE)``: each row's heads from the qkv projection (H
            queries and K keys before RoPE, then K values) and its RoPE factors
            (:func:`rope_factors`), and optionally the projection's bias last (``[N * E]``
            or ``[N, E]``), not yet added. The kernel adds the bias, rotates queries and keys, writes keys
            and values into the completions' cache at slot ``length - 1`` and attends to them
            there: no kernels before it add, slice, rotate, lay out or scatter them. None:
            the cache holds them.
        interpret: run Pallas's interpreter (any backend), for tests.

    Returns:
        ``[B, K, G, E]`` in the queries' dtype; with ``token``, ``(that, (k_BKTE, v_BKET))``,
        the cache written in place (donate it).
    """
    p, k, prompt_len, e = prompt_k_PKSE.shape
    b, write = k_BKTE.shape[0], token is not None
    if (q_BKGE is None) != write:
        raise ValueError("grouped_decode_attention takes the queries or the token (whose qkv heads hold them), "
                         f"one of the two; got {'both' if write else 'neither'}")
    qkv_BNE = token[0].astype(k_BKTE.dtype) if write else None
    if write:
        per_row = qkv_BNE.shape[1]
        bias = token[3] if len(token) > 3 else None
        queries = _Queries(qkv_BNE.reshape(b * per_row, e), per_row, (per_row - 2 * k) // k,
                           tuple(x.astype(k_BKTE.dtype) for x in token[1:3]),
                           None if bias is None else bias.reshape(per_row, e).astype(k_BKTE.dtype))
        out_dtype = token[0].dtype
    else:
        per_row = q_BKGE.shape[1] * q_BKGE.shape[2]
        queries = _Queries(q_BKGE.reshape(b * per_row, e), per_row, q_BKGE.shape[2], None)
        out_dtype = q_BKGE.dtype
    g = queries.groups
    split = plan(b, p, k, g, prompt_len, k_BKTE.shape[2])
    scale = e ** -0.5
    passes = (_prefix_pass(queries, p, k, prompt_len, split, scale),
              _own_pass(queries, (k_BKTE, v_BKET), split, scale, qkv_BNE))
    factors = list(queries.factors or ())  # the token's, with write
    bias = [] if queries.bias is None else [queries.bias]
    inputs = ([queries.heads, *factors, *bias, prompt_k_PKSE, prompt_v_PKSE, prompt_mask_PS.astype(jnp.int32)],
              [queries.heads, k_BKTE, v_BKET, allowed_BT.astype(jnp.int32), length_B.astype(jnp.int32)[:, None],
               *([qkv_BNE] * 2 + factors if write else []), *bias * 3])
    if ONE_LAUNCH:
        parts = launch.launch_together(passes, inputs, interpret, "grouped_decode_attention")
    else:
        parts = launch.launch_apart(passes, inputs, interpret)
    o_pre, top_pre, total_pre, o_own, top_own, total_own, *cache = parts
    queries_per_prompt = b // p * g  # the prefix pass's real rows of its tiles
    o_pre, top_pre, total_pre = (x[:, :, :, :queries_per_prompt] for x in (o_pre, top_pre, total_pre))

    def per_row_of(x):  # [P, K, splits, n * G, ...] -> [B, K, splits, G, ...]
        x = x.reshape(p, k, x.shape[2], b // p, g, *x.shape[4:])
        return jnp.moveaxis(x, 3, 1).reshape(b, k, x.shape[2], g, *x.shape[5:])

    # The merge: each part weighs exp(its maximum - the row's); one reduction, no concatenation.
    top_pre, total_pre, o_pre = per_row_of(top_pre), per_row_of(total_pre), per_row_of(o_pre)
    top = jnp.maximum(top_pre.max(axis=2), top_own.max(axis=2))[:, :, None]
    w_pre, w_own = jnp.exp(top_pre - top), jnp.exp(top_own - top)
    total = jnp.sum(total_pre * w_pre, axis=2) + jnp.sum(total_own * w_own, axis=2)
    out = jnp.sum(o_pre * w_pre[..., None], axis=2) + jnp.sum(o_own * w_own[..., None], axis=2)
    out = (out / total[..., None]).astype(out_dtype)
    return (out, tuple(cache)) if write else out
