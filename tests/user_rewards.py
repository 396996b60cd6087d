"""A user's own reward module, as ``--reward user_rewards:brevity`` imports it (tests only)."""


def brevity(completions, **_):
    """1 for a completion of at most 40 characters, else 0."""
    return [1.0 if len(c) <= 40 else 0.0 for c in completions]


NOT_A_FUNCTION = 3


def length_mod_3(completions, **_):
    """len(completion) mod 3: rewards that differ within a group even for a random model."""
    return [float(len(c) % 3) for c in completions]
