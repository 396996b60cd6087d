"""compare's command line: its own flags, the shared flags it refuses, and the paper's ablations."""

from __future__ import annotations

import argparse
import os
from typing import Any

from experiments import flags as flags_lib
from experiments.config import METHODS
from experiments.usage import UsageError

# label -> the AlgorithmConfig fields it sets over the shared config; the paper's sweeps
# (n at m=16, m at n=64, the selection rule at the setting's n and m).
ABLATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "n": {f"n={n}": {"algorithm": "pods", "n": n, "m": 16} for n in (16, 32, 64, 128, 256)},
    "m": {f"m={m}": {"algorithm": "pods", "n": 64, "m": m} for m in (2, 4, 8, 16)},
    "rule": {rule: {"algorithm": "pods", "rule": rule}
             for rule in ("max_variance", "max_reward", "random", "percentile")},
    # PODS's in-group selection with and without DAPO's dynamic sampling of groups
    "dynamic_sampling": {"pods": {"algorithm": "pods", "dynamic_sampling": False},
                         "pods+dynamic": {"algorithm": "pods", "dynamic_sampling": True}},
}

# Set per run by compare itself, so refused among the shared flags.
OWN_FLAGS = ("--out", "--seed", "--resume", "--overwrite", "--method", "--warmup-dir")


def parse(argv):
    """compare's own flags, and the rest (the flags every run shares)."""
    parser = flags_lib.UsageParser(prog="python -m experiments.compare", description=__doc__, allow_abbrev=False,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("gsm8k", "math", "chemistry"), default="gsm8k", help="default: gsm8k")
    parser.add_argument("--methods", help="comma-separated methods (grpo, grpo-ga, pods; default: grpo,pods)")
    parser.add_argument("--ablation", choices=sorted(ABLATIONS), help="run a sweep instead of --methods")
    parser.add_argument("--baseline", help="label whose peak sets the target (default: grpo, or the first)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--out", required=True)
    args, passthrough = parser.parse_known_args(argv)
    args.out = os.path.expanduser(args.out)  # a quoted "~/runs" names the home's folder, not a "~" here
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise UsageError(f"--seeds wants comma-separated integers; got {args.seeds!r}") from None
    repeated = sorted({s for s in args.seeds if args.seeds.count(s) > 1})
    if repeated:  # two runs of a seed would share one directory, and count twice in the statistics
        raise UsageError(f"--seeds names seed {repeated[0]} twice; each seed is one run")
    if args.methods is not None and args.ablation:
        raise UsageError("--methods and --ablation exclude each other: an ablation sweeps one method's setting")
    methods = [m.strip() for m in (args.methods if args.methods is not None else "grpo,pods").split(",") if m.strip()]
    if not methods or set(methods) - set(METHODS):
        raise UsageError(f"--methods must name grpo, grpo-ga or pods; got {args.methods!r}")
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:  # its runs would be one run, read twice
        raise UsageError(f"--methods names {twice[0]} twice; each method is one run a seed")
    args.methods = methods
    given = _given_fields(passthrough)
    for flag in OWN_FLAGS:
        if given.get(_OWN_FIELDS.get(flag, flag)):  # --seed=5 and --run.seed 5 too
            if flag == "--warmup-dir":
                raise UsageError("--warmup-dir names one warm-up, but each seed has its own (the tiny preset "
                                 "keeps them in its shared warm-up cache); remove it")
            raise UsageError(f"{given[_OWN_FIELDS.get(flag, flag)]} is set by compare itself; remove it")
    if args.ablation:  # a swept field given too had been overwritten in every run, or made two arms one
        swept = {f"algorithm.{name}" for fields in ABLATIONS[args.ablation].values() for name in fields}
        clash = sorted(swept & set(given))
        if clash:
            raise UsageError(f"--ablation {args.ablation} sets {clash[0]} in each run; remove {given[clash[0]]}")
    return args, passthrough


# compare's own flags as the config fields they set, so that a dotted spelling is refused too
_OWN_FIELDS = {"--seed": "run.seed", "--out": "run.out_dir", "--method": "algorithm.algorithm",
               "--warmup-dir": "tiny.warmup_dir"}


def _given_fields(passthrough: list[str]) -> dict[str, str]:
    """The config fields (and launch flags) the shared flags name -> the flag as given."""
    given = {}
    for token in passthrough:
        name = token.split("=", 1)[0]
        if name.startswith("--"):
            field = _OWN_FIELDS.get(name) or flags_lib.SHORTCUTS.get(name) or (name[2:] if "." in name else name)
            given[field] = name
    return given
