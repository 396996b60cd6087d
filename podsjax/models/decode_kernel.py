"""Grouped decode attention as two passes of GPU programs (Pallas, lowered through Triton) and a merge.

A decode step's attention reads each row's completion and its group's prompt. One
program per row and kv head that walks both serially left an H200 mostly idle: at setting
a's shape (64 rows, 2 kv heads, 512 + 512 slots) 128 programs for 132 SMs, each reading
1024 slots one block after another, ran at 188 us a layer against 3.6 us of bytes. So the
work is split the way flash decoding and cascade (shared-prefix) attention split it:

- **prefix pass**: per prompt and kv head, the group's n rows x G query heads form one
  query matrix against the prompt's keys and values, read once for the whole group, as
  tensor-core matmuls; the prompt's slots are split over programs;
- **completion pass**: per row and kv head, the row's own completion, split over
  programs of at most :data:`MAX_SLOTS_PER_PROGRAM` slots, each stopping at the row's
  write slot (a split past it reads nothing);
- **merge**: every part keeps its running maximum and sum (an online softmax); XLA combines
  the parts by their log-sum-exp.

Both passes run in one launch (:data:`ONE_LAUNCH`), the prefix pass's programs first: each
program is a few microseconds of latency-bound work, and a launch each paid two starts and
two tails a layer. Decoding hands the kernel the step's token as the qkv projection left it:
the completion pass rotates the key (RoPE), attends to it and the value from registers and
writes both into the cache, so no kernel before it slices, rotates or scatters them.
:func:`plan` says how a shape splits; tests check that setting a's shape fills an H100
(at least :data:`MIN_PROGRAMS` programs) without running on one.

Numerics: scores and sums are fp32. A 16-bit cache's scores are bf16/fp16 products summed
in fp32 (exact products, as the XLA form's upcast ones); the probabilities enter the
values' matmul as two 16-bit parts (high and low), so they keep about 16 bits. An fp32
cache (tests) runs fp32 dots. The kernels agree with the XLA form to fp32 rounding in fp32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_PROGRAMS = 264  # two programs for each of an H100's (and H200's) 132 SMs
MAX_SLOTS_PER_PROGRAM = 256  # the longest serial walk a program makes
_MIN_DOT = 16  # Triton's dots take tiles of at least 16 along each dimension
_BLOCK = 64  # cache slots per loop iteration
_QUERY_TILE = 64  # rows of the prefix pass's query matrix per program
_NEG = 0.7 * float(jnp.finfo(jnp.float32).min)  # masked scores: exp underflows to 0, no inf - inf
ONE_LAUNCH = True  # both passes in one kernel launch (False: a launch each, one after the other)
_COMPILER_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=2)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one layer's attention splits into programs.

    Attributes:
        block: cache slots per loop iteration.
        prefix_chunk, prefix_splits: prompt slots per prefix program, and programs per prompt
            and kv head along the prompt.
        query_tile, query_tiles: rows of the group's query matrix (n x G) per prefix program,
            and how many such tiles.
        own_chunk, own_splits: completion slots per completion program, and programs per row
            and kv head along the completion.
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

    The passes run one after the other, so each must fill the GPU by itself: until it has
    :data:`MIN_PROGRAMS` programs, the completion pass halves its chunk (from
    :data:`MAX_SLOTS_PER_PROGRAM`) down to one block, and the prefix pass first halves its
    query tile down to 16 rows (free: the tiles re-read the prompt from L2) and then its
    chunk, which costs bytes (every chunk writes an fp32 part as large as its query
    matrix). On an H200 a prefix pass of 24 programs walking 4 blocks each took 14.6 us for
    a 0.5 MB prompt.
    """
    block = min(_BLOCK, max(_MIN_DOT, _next_pow2(max(prompt_len, slots))))
    own_chunk = max(block, min(MAX_SLOTS_PER_PROGRAM, _next_pow2(slots)))
    while own_chunk > block and rows * kv_heads * pl.cdiv(slots, own_chunk) < MIN_PROGRAMS:
        own_chunk //= 2
    own_splits = pl.cdiv(slots, own_chunk)
    queries = rows // prompts * groups
    query_tile = min(_QUERY_TILE, max(_MIN_DOT, _next_pow2(queries)))
    prefix_chunk = max(block, min(MAX_SLOTS_PER_PROGRAM, _next_pow2(prompt_len)))

    def prefix_programs(tile: int, chunk: int) -> int:
        return prompts * kv_heads * pl.cdiv(queries, tile) * pl.cdiv(prompt_len, chunk)

    while query_tile > _MIN_DOT and prefix_programs(query_tile, prefix_chunk) < MIN_PROGRAMS:
        query_tile //= 2
    while prefix_chunk > block and prefix_programs(query_tile, prefix_chunk) < MIN_PROGRAMS:
        prefix_chunk //= 2
    query_tiles = pl.cdiv(queries, query_tile)
    prefix_splits = pl.cdiv(prompt_len, prefix_chunk)
    return Plan(block=block, prefix_chunk=prefix_chunk, prefix_splits=prefix_splits, query_tile=query_tile,
                query_tiles=query_tiles, own_chunk=own_chunk, own_splits=own_splits,
                prefix_programs=prompts * kv_heads * query_tiles * prefix_splits,
                own_programs=rows * kv_heads * own_splits)


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


def _prefix_part(q_ref, k_ref, v_ref, mask_ref, o_ref, top_ref, total_ref, chunk_index, *, prompt_len: int,
                 chunk: int, block: int, scale: float):
    """One prompt, kv head, query tile and prompt chunk (``chunk_index``). Refs: q ``[Tq, E]``
    (a tile of the group's rows x query heads), k/v ``[S, E]``, mask ``[S]``; out o ``[Tq, E]``,
    top/total ``[Tq]``."""
    start = chunk_index * chunk
    o, top, total = _attend_blocks(q_ref[...], k_ref, v_ref, mask_ref, start, jnp.minimum(start + chunk, prompt_len),
                                   pl.cdiv(chunk, block), block=block, scale=scale, slots_last=False)
    o_ref[...] = o
    top_ref[...] = top
    total_ref[...] = total


def _own_part(*refs, samples: int, groups: int, slots: int, chunk: int, block: int, scale: float, write: bool):
    """One row, kv head and completion chunk (refs, then the row and chunk). Refs: q ``[Qp, E]`` (the
    group's query matrix, the row's G queries from row ``sample * G``), k ``[T, E]``, v ``[E, T]``, allowed
    ``[T]``, length ``[1]``, [``write``: new key (before RoPE), value, RoPE factors, ``[E]`` each]; out o
    ``[GP, E]``, top/total ``[GP]``, [k, v with the new ones at slot ``length - 1``]."""
    *refs, row, chunk_index = refs
    q_ref, k_ref, v_ref, allowed_ref, length_ref, *refs = refs
    new_k_ref, new_v_ref, cos_ref, sin_ref, *refs = refs if write else (None,) * 4 + tuple(refs)
    o_ref, top_ref, total_ref, *cache_out = refs
    gp = o_ref.shape[0]
    real_rows = jnp.arange(gp) < groups
    first = (row % samples) * groups
    q = plgpu.load(q_ref.at[pl.ds(first, gp), :], mask=real_rows[:, None], other=0)
    start = chunk_index * chunk
    stop = jnp.minimum(jnp.minimum(start + chunk, slots), length_ref[0])
    slot = length_ref[0] - 1
    written, e = None, q_ref.shape[1]
    if write:  # the key with its halves swapped is a second load of it
        key = rotate_half(new_k_ref[...], new_k_ref[(jnp.arange(e) + e // 2) % e], cos_ref[...], sin_ref[...])
        written = (slot, key, new_v_ref[...])
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


def _query_matrix(q_BKGE, prompts: int, split: Plan):
    """``[P, K, Qp, E]``: per prompt and kv head, its n rows x G queries (row-major), padded to a
    power of two (Triton's blocks) that holds the prefix pass's tiles and every row's window
    of ``max(16, next pow2 of G)`` rows."""
    b, k, g, e = q_BKGE.shape
    n = b // prompts
    padded = _next_pow2(max(split.query_tile * split.query_tiles, (n - 1) * g + _own_rows(g)))
    q_PKQE = q_BKGE.reshape(prompts, n, k, g, e).transpose(0, 2, 1, 3, 4).reshape(prompts, k, n * g, e)
    return jnp.pad(q_PKQE, ((0, 0), (0, 0), (0, padded - n * g), (0, 0)))


def _own_rows(groups: int) -> int:
    return max(_MIN_DOT, _next_pow2(groups))


@dataclasses.dataclass(frozen=True)
class _Pass:
    """One pass as Pallas launches it: its kernel, grid, specs and outputs. The kernel takes
    its refs and then ``part_ids(its program's grid ids)``."""

    kernel: Callable
    part_ids: Callable[[tuple], tuple]
    grid: tuple[int, ...]
    in_specs: list
    out_specs: list
    out_shape: list
    name: str
    aliases: dict = dataclasses.field(default_factory=dict)  # input -> output, the pass's own indices


def _prefix_pass(q_PKQE, prompt_len: int, split: Plan, scale: float) -> _Pass:
    """The prefix pass, writing ``(o [P, K, splits, Qp, E], top, total [P, K, splits, Qp])``."""
    p, k, _, e = q_PKQE.shape
    tile = split.query_tile
    return _Pass(
        kernel=functools.partial(_prefix_part, prompt_len=prompt_len, chunk=split.prefix_chunk, block=split.block,
                                 scale=scale),
        part_ids=lambda ids: (ids[3],),  # the prompt chunk
        grid=(p, k, split.query_tiles, split.prefix_splits),
        in_specs=[
            pl.BlockSpec((None, None, tile, e), lambda i, h, t, s: (i, h, t, 0)),
            pl.BlockSpec((None, None, prompt_len, e), lambda i, h, t, s: (i, h, 0, 0)),
            pl.BlockSpec((None, None, prompt_len, e), lambda i, h, t, s: (i, h, 0, 0)),
            pl.BlockSpec((None, prompt_len), lambda i, h, t, s: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, tile, e), lambda i, h, t, s: (i, h, s, t, 0)),
            pl.BlockSpec((None, None, None, tile), lambda i, h, t, s: (i, h, s, t)),
            pl.BlockSpec((None, None, None, tile), lambda i, h, t, s: (i, h, s, t)),
        ],
        out_shape=_part_shapes((p, k, split.prefix_splits, tile * split.query_tiles), e),
        name="grouped_decode_prefix")


def _own_pass(q_PKQE, groups: int, cache: tuple, split: Plan, scale: float, write: bool) -> _Pass:
    """The completion pass, writing ``(o [B, K, splits, G, E], top, total [B, K, splits, G])``, and
    with ``write`` the completions' ``cache`` (k, v), each row's token put in from the qkv heads
    ``[B, H + 2K, E]``. Each row's queries come from the prefix pass's query matrix."""
    p, k, padded, e = q_PKQE.shape
    rows, _, slots, _ = cache[0].shape
    n, gp, heads = rows // p, _own_rows(groups), k * groups
    keys = pl.BlockSpec((None, None, slots, e), lambda r, h, s: (r, h, 0, 0))
    values = pl.BlockSpec((None, None, e, slots), lambda r, h, s: (r, h, 0, 0))
    new = [pl.BlockSpec((None, None, e), lambda r, h, s: (r, heads + h, 0)),
           pl.BlockSpec((None, None, e), lambda r, h, s: (r, heads + k + h, 0)),
           *[pl.BlockSpec((None, e), lambda r, h, s: (r, 0))] * 2] if write else []
    return _Pass(
        kernel=functools.partial(_own_part, samples=n, groups=groups, slots=slots, chunk=split.own_chunk,
                                 block=split.block, scale=scale, write=write),
        part_ids=lambda ids: (ids[0], ids[2]),  # the row and its completion chunk
        grid=(rows, k, split.own_splits),
        in_specs=[
            pl.BlockSpec((None, None, padded, e), lambda r, h, s: (r // n, h, 0, 0)), keys, values,
            pl.BlockSpec((None, slots), lambda r, h, s: (r, 0)),
            pl.BlockSpec((None, 1), lambda r, h, s: (r, 0)),
            *new,
        ],
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


def _grid_ids(flat, grid: tuple[int, ...]) -> tuple:
    """A flat program id's position in ``grid`` (row-major)."""
    ids = []
    for size in reversed(grid):
        ids.append(flat % size)
        flat = flat // size
    return tuple(reversed(ids))


def _on_flat_grid(spec, grid: tuple[int, ...], first: int):
    """``spec`` for programs ``first .. first + prod(grid) - 1`` of a flat grid; the other
    programs get a block in range (clamped), which they do not touch."""
    count = math.prod(grid)
    return pl.BlockSpec(spec.block_shape,
                        lambda pid: spec.index_map(*_grid_ids(jnp.clip(pid - first, 0, count - 1), grid)))


def _launch_apart(passes: tuple[_Pass, _Pass], inputs: tuple[list, list], interpret: bool) -> list:
    """Each pass its own launch, the prefix pass's programs before the completion pass's."""
    outs = []
    for one, args in zip(passes, inputs):
        def kernel(*refs, one=one):
            one.kernel(*refs, *one.part_ids(tuple(pl.program_id(axis) for axis in range(len(one.grid)))))

        outs += pl.pallas_call(kernel, grid=one.grid, in_specs=one.in_specs, out_specs=one.out_specs,
                               out_shape=one.out_shape, input_output_aliases=one.aliases,
                               compiler_params=_COMPILER_PARAMS, interpret=interpret, name=one.name)(*args)
    return outs


def _launch_together(passes: tuple[_Pass, _Pass], inputs: tuple[list, list], interpret: bool) -> list:
    """Both passes in one launch on a flat grid: the prefix pass's programs first, then the
    completion pass's. Each pass's programs are a few us of latency-bound work; apart, each
    launch paid its own start and tail (on an H200, 14.6 and 12.5 us a layer)."""
    prefix, own = passes
    first_own = math.prod(prefix.grid)

    def kernel(*refs):
        pid = pl.program_id(0)
        n_in, m_in, n_out = len(prefix.in_specs), len(own.in_specs), len(prefix.out_specs)
        prefix_refs = refs[:n_in] + refs[n_in + m_in:n_in + m_in + n_out]
        own_refs = refs[n_in:n_in + m_in] + refs[n_in + m_in + n_out:]

        @pl.when(pid < first_own)
        def _():
            prefix.kernel(*prefix_refs, *prefix.part_ids(_grid_ids(pid, prefix.grid)))

        @pl.when(pid >= first_own)
        def _():
            own.kernel(*own_refs, *own.part_ids(_grid_ids(pid - first_own, own.grid)))

    def flat(one: _Pass, first: int, specs: list) -> list:
        return [_on_flat_grid(spec, one.grid, first) for spec in specs]

    return pl.pallas_call(
        kernel,
        grid=(first_own + math.prod(own.grid),),
        in_specs=flat(prefix, 0, prefix.in_specs) + flat(own, first_own, own.in_specs),
        out_specs=flat(prefix, 0, prefix.out_specs) + flat(own, first_own, own.out_specs),
        out_shape=prefix.out_shape + own.out_shape,
        input_output_aliases={len(prefix.in_specs) + i: len(prefix.out_specs) + o for i, o in own.aliases.items()},
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
        name="grouped_decode_attention",
    )(*inputs[0], *inputs[1])


@functools.partial(jax.jit, static_argnames=("interpret",))
def grouped_decode_attention(q_BKGE: jax.Array, prompt_k_PKSE: jax.Array, prompt_v_PKSE: jax.Array,
                             prompt_mask_PS: jax.Array, k_BKTE: jax.Array, v_BKET: jax.Array,
                             allowed_BT: jax.Array, length_B: jax.Array, token: tuple | None = None, *,
                             interpret: bool = False):
    """Softmax attention of one query per head and row over its prompt's KV and its own.

    Args:
        q_BKGE: the queries, G per kv head, in the cache's dtype.
        prompt_k_PKSE, prompt_v_PKSE, prompt_mask_PS: the prompts' cache (row b reads prompt
            ``b // (B // P)``) and which of its slots hold tokens.
        k_BKTE, v_BKET: the rows' completions (values slots last), ``allowed_BT`` the slots
            each row attends to.
        length_B: completion slots to read per row; slots from it on must not be allowed.
        token: ``(qkv_BNE, cos_BE, sin_BE)``: each row's heads from the qkv projection (q's
            H, then K keys before RoPE, then K values) and its RoPE factors
            (:func:`rope_factors`). The kernel rotates the keys, writes keys and values into
            the completions' cache at slot ``length - 1`` and attends to them there: no
            kernels before it slice, rotate or scatter them. None: the cache holds them.
        interpret: run Pallas's interpreter (any backend), for tests.

    Returns:
        ``[B, K, G, E]`` in ``q_BKGE``'s dtype; with ``token``, ``(that, (k_BKTE, v_BKET))``,
        the cache written in place (donate it).
    """
    b, k, g, e = q_BKGE.shape
    p, _, prompt_len, _ = prompt_k_PKSE.shape
    split = plan(b, p, k, g, prompt_len, k_BKTE.shape[2])
    scale = e ** -0.5
    q_PKQE = _query_matrix(q_BKGE, p, split)
    write = token is not None
    passes = (_prefix_pass(q_PKQE, prompt_len, split, scale),
              _own_pass(q_PKQE, g, (k_BKTE, v_BKET), split, scale, write))
    inputs = ([q_PKQE, prompt_k_PKSE, prompt_v_PKSE, prompt_mask_PS.astype(jnp.int32)],
              [q_PKQE, k_BKTE, v_BKET, allowed_BT.astype(jnp.int32), length_B.astype(jnp.int32)[:, None],
               *([token[0].astype(k_BKTE.dtype)] * 2 + [x.astype(k_BKTE.dtype) for x in token[1:]] if write else [])])
    launch = _launch_together if ONE_LAUNCH else _launch_apart
    o_pre, top_pre, total_pre, o_own, top_own, total_own, *cache = launch(passes, inputs, interpret)
    queries = b // p * g  # the prefix pass's real rows of its padded query matrix
    o_pre, top_pre, total_pre = o_pre[..., :queries, :], top_pre[..., :queries], total_pre[..., :queries]

    def per_row(x):  # [P, K, splits, n * G, ...] -> [B, K, splits, G, ...]
        x = x.reshape(p, k, x.shape[2], b // p, g, *x.shape[4:])
        return jnp.moveaxis(x, 3, 1).reshape(b, k, x.shape[2], g, *x.shape[5:])

    # The merge: each part weighs exp(its maximum - the row's); one reduction, no concatenation.
    top_pre, total_pre, o_pre = per_row(top_pre), per_row(total_pre), per_row(o_pre)
    top = jnp.maximum(top_pre.max(axis=2), top_own.max(axis=2))[:, :, None]
    w_pre, w_own = jnp.exp(top_pre - top), jnp.exp(top_own - top)
    total = jnp.sum(total_pre * w_pre, axis=2) + jnp.sum(total_own * w_own, axis=2)
    out = jnp.sum(o_pre * w_pre[..., None], axis=2) + jnp.sum(o_own * w_own[..., None], axis=2)
    out = (out / total[..., None]).astype(q_BKGE.dtype)
    return (out, tuple(cache)) if write else out
