"""The core kernels: down-sampling rules, the GRPO loss, token log-probs. Pure JAX; import nothing else of podsjax."""
