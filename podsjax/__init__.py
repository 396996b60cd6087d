"""podsjax: PODS (Policy Optimization with Down-Sampling) for RLVR in JAX/Flax.

Axis glossary used in names throughout the package (``rewards_PN``, ``logits_BLV``):

    B  batch (sequences)          P  prompts (groups)
    N  rollouts per prompt        M  selected rollouts per prompt
    L  sequence length            V  vocabulary
    D  model width                H  attention heads
    K  key/value heads

A trailing ``...`` in a docstring shape means any number of leading batch axes.
"""

from podsjax import grpo, selection
from podsjax.selection import indices_to_mask, register_rule, select

__all__ = ["grpo", "selection", "select", "register_rule", "indices_to_mask"]
__version__ = "0.1.0"
