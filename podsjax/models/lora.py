"""Functional LoRA: a separate params tree that the decoder adds on the fly.

The LoRA tree mirrors the paths of the base params (``layers/attn/q``) and holds
``{"a": A, "b": B}`` per targeted projection, stacked over the layers like the kernels
they adapt (leading axis Y). For a projection ``y = x @ W`` (``W`` of
shape ``in_shape + out_shape``) the decoder computes ``x @ W + ((x @ A) @ B) * alpha / r``
with ``A: in_shape + (r,)`` and ``B: (r,) + out_shape``; the merged ``W + A @ B * scale`` is
never materialised. Calling the model without ``lora=`` is the base model, so the
reference policy of GRPO's KL term costs no second copy of the weights.

Example:
    >>> lora = init_lora(jax.random.key(0), model, LoraConfig(rank=64, alpha=64.0))
    >>> logits_BLV = model.apply({"params": params}, ids_BL, attention_mask=mask_BL, lora=lora).logits_BLV
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from podsjax.devices import mesh as mesh_lib
from podsjax.models.params import check_key

_PARENT = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp", "down": "mlp"}
DEFAULT_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
# Logical names of each projection's (input dims, output dims): the one table the decoder,
# LoRA and the checkpoint converter share.
PROJECTION_LOGICAL_AXES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "q": (("embed",), ("q_heads", "head_dim")),
    "k": (("embed",), ("kv_heads", "head_dim")),
    "v": (("embed",), ("kv_heads", "head_dim")),
    "o": (("q_heads", "head_dim"), ("embed",)),
    "gate": (("embed",), ("mlp",)),
    "up": (("embed",), ("mlp",)),
    "down": (("mlp",), ("embed",)),
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank, alpha and targeted projections (names from :data:`DEFAULT_TARGETS`)."""

    rank: int = 64
    alpha: float = 64.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < float("inf"):
            raise ValueError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.targets, str) or not isinstance(self.targets, (tuple, list)):  # "qkv": q, k and v
            raise ValueError(f"LoRA targets must be a list of projection names {DEFAULT_TARGETS}, got {self.targets!r}")
        unknown = set(self.targets) - set(PROJECTION_LOGICAL_AXES)
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets must be a non-empty subset of {DEFAULT_TARGETS}, got {self.targets}")
        object.__setattr__(self, "targets", tuple(self.targets))


@flax.struct.dataclass
class LoraParams:
    """LoRA weights plus their (static) scale; a pytree optax and jit accept as is.

    Attributes:
        weights: ``{"layers": {"attn"|"mlp": {proj: {"a": A [Y, in..., r], "b": B [Y, r, out...]}}}}``.
        scale: ``alpha / rank``; static, so it is never trained.
    """

    weights: dict[str, Any]
    scale: float = flax.struct.field(pytree_node=False, default=1.0)


def lora_shapes(config, lora_config: LoraConfig) -> dict[str, Any]:
    """Shapes and logical names of every (layer-stacked) A/B of ``lora_config`` for a ``ModelConfig``.

    Returns:
        ``{path: (a_shape, a_names, b_shape, b_names)}`` with ``path`` like
        ``("layers", "attn", "q")`` and shapes led by the layer axis.
    """
    d, e, f = config.hidden_size, config.head_dim, config.intermediate_size
    h, k = config.num_heads, config.num_kv_heads
    dims = {"embed": d, "q_heads": h, "kv_heads": k, "head_dim": e, "mlp": f}
    r, y = lora_config.rank, config.num_layers
    out = {}
    for proj in lora_config.targets:
        in_names, out_names = PROJECTION_LOGICAL_AXES[proj]
        in_shape = tuple(dims[n] for n in in_names)
        out_shape = tuple(dims[n] for n in out_names)
        out[("layers", _PARENT[proj], proj)] = (
            (y,) + in_shape + (r,), ("layers",) + in_names + ("lora_rank",),
            (y, r) + out_shape, ("layers", "lora_rank") + out_names,
        )
    return out


def check_lora_fits(model, lora: Any) -> None:
    """``lora`` adapts ``model``: a :class:`LoraParams` whose every A and B has the shape that
    ``model``'s config gives it (at its rank, on its projections).

    Raises:
        ValueError: ``lora`` is no LoraParams, or one made for another model config.
    """
    if not isinstance(lora, LoraParams):
        raise ValueError(f"lora must be the LoraParams that init_lora makes (weights and scale); "
                         f"got {type(lora).__name__}")
    found = {tuple(str(getattr(k, "key", k)) for k in path): tuple(getattr(leaf, "shape", ()))
             for path, leaf in jax.tree_util.tree_flatten_with_path(lora.weights)[0]}
    rank = next((shape[-1] for path, shape in found.items() if path[-1] == "a" and shape), None)
    targets = tuple(dict.fromkeys(path[2] for path in found if len(path) == 4 and path[0] == "layers"))
    try:
        expected = lora_shapes(model.config, LoraConfig(rank=rank, targets=targets))
    except ValueError:
        raise ValueError(f"lora holds no adapters of this model's projections {DEFAULT_TARGETS} "
                         f"(its leaves: {', '.join('/'.join(p) for p in list(found)[:4]) or 'none'})") from None
    want = {path + (name,): shape for path, (a, _, b, _) in expected.items() for name, shape in (("a", a), ("b", b))}
    for path in sorted(set(want) | set(found)):
        if want.get(path) != found.get(path):
            raise ValueError(f"lora does not fit this model: {'/'.join(path)} is {found.get(path, 'missing')}, the "
                             f"model's config gives {want.get(path, 'no such adapter')}; was it made for another "
                             "model config?")


def init_lora(rng: jax.Array, model, lora_config: LoraConfig, dtype=jnp.float32, mesh=None) -> LoraParams:
    """Initialises LoRA weights: A uniform in +-1/sqrt(fan_in) (as PEFT), B zero.

    With B = 0 the adapted model equals the base model exactly at step 0.

    Args:
        rng: PRNG key.
        model: a :class:`~podsjax.models.Decoder` (only its config is read).
        lora_config: rank, alpha, targets.
        dtype: dtype of A and B (keep fp32 for training).
        mesh: when given, A/B are created sharded like the kernels they adapt.

    Returns:
        :class:`LoraParams`.
    """
    if not isinstance(lora_config, LoraConfig):
        raise TypeError(f"lora_config must be a LoraConfig (podsjax.models.LoraConfig(rank=...)); got "
                        f"{type(lora_config).__name__}")
    check_key(rng)
    shapes = lora_shapes(model.config, lora_config)

    def make(rng):
        weights: dict[str, Any] = {}
        keys = jax.random.split(rng, len(shapes))
        for key, (path, (a_shape, _, b_shape, _)) in zip(keys, shapes.items(), strict=True):
            bound = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))  # fan-in of one layer
            node = weights
            for part in path:
                node = node.setdefault(part, {})
            node["a"] = jax.random.uniform(key, a_shape, dtype, -bound, bound)
            node["b"] = jnp.zeros(b_shape, dtype)
        return weights

    out_shardings = None
    if mesh is not None:  # born sharded like the kernels they adapt
        mesh_lib.check_mesh(mesh)
        out_shardings = {}
        for path, (a_shape, a_names, b_shape, b_names) in shapes.items():
            node = out_shardings
            for part in path:
                node = node.setdefault(part, {})
            node["a"] = mesh_lib.logical_sharding(mesh, a_names, a_shape)
            node["b"] = mesh_lib.logical_sharding(mesh, b_names, b_shape)
    weights = jax.jit(make, out_shardings=out_shardings)(rng)
    return LoraParams(weights=weights, scale=lora_config.alpha / lora_config.rank)


def lora_logical_axes(lora: LoraParams) -> Any:
    """Tree of logical-name tuples with the structure of ``lora.weights`` (for shardings)."""
    def names(path, leaf):
        proj, which = path[-2].key, path[-1].key
        in_names, out_names = PROJECTION_LOGICAL_AXES[proj]
        return ("layers",) + (in_names + ("lora_rank",) if which == "a" else ("lora_rank",) + out_names)

    return jax.tree_util.tree_map_with_path(names, lora.weights)


@functools.partial(jax.jit, static_argnums=2)
def merged_kernel(kernel: jax.Array, ab: dict[str, jax.Array], scale: float) -> jax.Array:
    """``kernel + scale * A @ B`` in fp32, cast back to the kernel dtype.

    ``kernel`` is one layer's ``in_shape + out_shape`` with ``A: in_shape + (r,)`` and
    ``B: (r,) + out_shape``, or all of them with a shared leading layer axis.
    """
    a, b = ab["a"].astype(jnp.float32), ab["b"].astype(jnp.float32)
    stacked = a.ndim + b.ndim - 2 > kernel.ndim  # the layer axis appears on A, B and the kernel
    if stacked:
        delta = jnp.einsum("yir,yro->yio", a.reshape(a.shape[0], -1, a.shape[-1]),
                           b.reshape(b.shape[0], b.shape[1], -1)).reshape(kernel.shape)
    else:
        delta = jnp.tensordot(a, b, axes=1)
    return (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)


def merge_lora(params: dict[str, Any], lora: LoraParams) -> dict[str, Any]:
    """Returns base params with every LoRA delta folded into its kernel (for export).

    This materialises a full copy of the params; training and sampling never need it.
    """
    if not isinstance(lora, LoraParams):  # a bare weights dict had failed on .weights
        raise ValueError(f"lora must be the LoraParams that init_lora makes; got {type(lora).__name__}")

    def merge(path, leaf):
        keys = tuple(getattr(p, "key", p) for p in path)
        if keys[-1] != "kernel":
            return leaf
        node: Any = lora.weights
        for part in keys[:-1]:
            if not isinstance(node, dict) or part not in node:
                return leaf
            node = node[part]
        a, b = jnp.shape(node["a"]), jnp.shape(node["b"])
        stacked = len(a) + len(b) - 2 > jnp.ndim(leaf)
        if a[:-1] + b[1 + stacked:] != jnp.shape(leaf) or a[-1:] != b[stacked:stacked + 1]:  # else a deep reshape
            raise ValueError(f"lora does not fit the kernel {'/'.join(map(str, keys))}: A {a} and B {b} do not make "
                             f"its {jnp.shape(leaf)}; was it made for another model config?")
        return merged_kernel(leaf, node, lora.scale)

    return jax.tree_util.tree_map_with_path(merge, params)
