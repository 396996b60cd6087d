"""What a step must move and compute at least, from the shape alone: the floors the timings are held against.

Decode, one step for R rows (memory bound)::

    bytes = weights + KV cache
    weights  = matmul_params * itemsize   (read once per step, whatever R is)
    KV cache = 2 (K and V) * layers * kv_heads * head_dim * itemsize * R * (L + T/2)

L + T/2 is the mean number of filled cache slots over T decode steps after an
L-token prompt: what a cache must hand to attention on average. The floor is
bytes / peak memory bandwidth.

Update, B rows of L prompt + T completion tokens (model FLOPs; what remat
recomputes is not counted, as usual for MFU)::

    forward = 2 * N_body * B(L+T)           body matmuls, every token
            + 2 * D * V * B * T              LM head, completion positions only
            + 2 * layers * H * E * B(L+T)^2  causal attention (QK^T and PV, half the square)
    full    = 3 * forward                    backward = 2x forward (input and weight grads)
    LoRA    = 2 * (body + head) + 3 * attention + 6 * N_lora * B(L+T)
              frozen weights need input grads only (1x forward); attention has no
              weights but 2x its forward in backward; the adapters are trained (3x)
"""

from __future__ import annotations

from benchmarks.qwen_model import Shape

LORA_PROJECTIONS = 7  # q, k, v, o, gate, up, down: what the benchmarks adapt


def layer_params(s: Shape) -> int:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = s.hidden * (q + 2 * kv) + (q + 2 * kv) + q * s.hidden  # q/k/v kernels + biases, o
    return attn + 3 * s.hidden * s.intermediate + 2 * s.hidden  # + gate/up/down, two norms


def body_params(s: Shape) -> int:
    """Params every token multiplies by, besides the LM head."""
    return s.layers * layer_params(s)


def matmul_params(s: Shape) -> int:
    """Weights a decode step reads: the body, the final norm and the LM head (the tied table counts once)."""
    return body_params(s) + s.hidden + s.hidden * s.vocab


def lora_params(s: Shape, rank: int) -> int:
    """A and B of all 7 projections: rank * (fan_in + fan_out) each."""
    q, kv, d, f = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.intermediate
    fans = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d)
    return s.layers * rank * fans


def kv_bytes_per_token(s: Shape, itemsize: int) -> int:
    return 2 * s.layers * s.kv_heads * s.head_dim * itemsize


def decode_step_bytes(s: Shape, itemsize: int, rows: int, prompt_len: int, new_tokens: int, samples: int = 1) -> float:
    """The weights, each of ``rows`` prompts' cache once, and its ``samples`` completions at their mean fill."""
    return matmul_params(s) * itemsize + kv_bytes_per_token(s, itemsize) * rows * (prompt_len + samples * new_tokens / 2)


def update_flops(s: Shape, rows: int, prompt_len: int, completion_len: int, lora_rank: int | None) -> float:
    """Model FLOPs of one update (formula in the module docstring); ``lora_rank=None`` is the full update."""
    length = prompt_len + completion_len
    tokens = rows * length
    matmuls = 2 * body_params(s) * tokens + 2 * s.hidden * s.vocab * rows * completion_len
    attention = 2 * s.layers * s.heads * s.head_dim * rows * length**2
    if lora_rank is None:
        return 3 * (matmuls + attention)
    return 2 * matmuls + 3 * attention + 6 * lora_params(s, lora_rank) * tokens
