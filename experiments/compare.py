"""Methods side by side over seeds, or one of the paper's ablations, with a plot and a speed-up table.

    python -m experiments.compare --methods grpo,pods --seeds 0,1,2 --time-budget 240 --out runs/compare
    python -m experiments.compare --ablation rule --out runs/rules

Every other flag (--model, --mesh, --max-completion-length, ...) goes to each run
unchanged. Runs go to <out>/<label>-seed<s>/ and are skipped when already complete,
so an interrupted comparison continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from experiments import cli
from experiments import flags as flags_lib

ABLATIONS = {
    # label -> extra flags; the paper's sweeps (n-sweep at m=16, m-sweep at n=64, rule ablation)
    "n": {f"n={n}": ["--method", "pods", "--n", str(n), "--m", "16"] for n in (16, 32, 64, 128, 256)},
    "m": {f"m={m}": ["--method", "pods", "--n", "64", "--m", str(m)] for m in (2, 4, 8, 16)},
    "rule": {rule: ["--method", "pods", "--rule", rule]
             for rule in ("max_variance", "max_reward", "random", "percentile")},
}


def parse(argv):
    parser = flags_lib._Parser(prog="python -m experiments.compare", description=__doc__, allow_abbrev=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("gsm8k", "math", "chemistry"), default="gsm8k")
    parser.add_argument("--methods", default="grpo,pods", help="comma-separated methods (grpo, grpo-ga, pods)")
    parser.add_argument("--ablation", choices=sorted(ABLATIONS), help="run a sweep instead of --methods")
    parser.add_argument("--baseline", help="label whose peak sets the target (default: grpo, or the first)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", required=True)
    args, passthrough = parser.parse_known_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise cli.UsageError(f"--seeds wants comma-separated integers; got {args.seeds!r}") from None
    for flag in ("--out", "--seed", "--resume", "--overwrite", "--method", "--warmup-dir"):
        if flag in passthrough:
            raise cli.UsageError(f"{flag} is set by compare itself; remove it")
    return args, passthrough


def variants(args) -> dict[str, list[str]]:
    if args.ablation:
        return ABLATIONS[args.ablation]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - {"grpo", "grpo-ga", "pods"}
    if unknown or not methods:
        raise cli.UsageError(f"--methods must name grpo, grpo-ga or pods; got {args.methods!r}")
    return {m: ["--method", m] for m in methods}


def run_one(task, flags, out) -> list[dict]:
    done = os.path.isfile(os.path.join(out, "final_model", "config.json"))
    if not done:
        resume = ["--resume"] if os.path.isfile(os.path.join(out, "config.json")) else []
        code = cli.main(task, [*flags, "--out", out, *resume])
        if code != 0:
            raise SystemExit(code)
    from podsjax.loop import read_history  # JAX starts only after cli.main has set up the devices

    return read_history(out)


def main(argv=None) -> int:
    try:
        args, passthrough = parse(argv)
        chosen = variants(args)
        baseline = args.baseline or ("grpo" if "grpo" in chosen else next(iter(chosen)))
        if baseline not in chosen:
            raise cli.UsageError(f"--baseline {baseline!r} is not among {sorted(chosen)}")
        # The shared flags checked once, before any run (each run checks its own again).
        run_args, config = flags_lib.parse(args.task, [*passthrough, "--out", os.path.join(args.out, "x")])
        flags_lib.check(run_args, config)
        cli.prepare_devices(config.model.mesh)
    except cli.UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from podsjax import analysis

    os.makedirs(args.out, exist_ok=True)
    groups = {}
    for label, flags in chosen.items():
        curves = []
        for seed in args.seeds:
            # Tiny preset: every method of a seed starts from the same warmed-up policy.
            shared = [] if "--model" in passthrough else [
                "--warmup-dir", os.path.join(args.out, f"tiny_warmup-seed{seed}")]
            history = run_one(args.task, [*passthrough, *flags, *shared, "--seed", str(seed)],
                              os.path.join(args.out, f"{label}-seed{seed}"))
            curves.append(analysis.Curve.from_history(history))
        groups[label] = curves
    title = f"{args.task}: {args.ablation + ' ablation' if args.ablation else ' vs '.join(chosen)}"
    plot_path = os.path.join(args.out, "accuracy_vs_time.png")
    analysis.plot(groups, plot_path, title)
    rows = analysis.summarize(groups, baseline)
    print(format_summary(rows, baseline, len(args.seeds)))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"baseline": baseline, "seeds": args.seeds, "plot": plot_path,
                   "methods": [r.__dict__ for r in rows]}, f, indent=2, default=str)
    print(f"plot: {plot_path}")
    return 0


def format_summary(rows, baseline, seeds) -> str:
    """Both speed-up estimators (see podsjax.analysis): per seed, and the authors' mean curves."""
    def seconds(t):
        return "never" if not math.isfinite(t) else f"{t:.0f} s"

    def times(x):
        return "never" if x == 0 else f"{x:.2f}x"

    def interval(pair, fmt):
        return "-" if any(math.isnan(x) for x in pair) else f"{fmt(pair[0])} to {fmt(pair[1])}"

    lines = [f"| method | peak accuracy (mean of {seeds} seeds) | time to 99% of {baseline}'s peak on the seed "
             f"(median) | speed-up vs {baseline} (median of per-seed ratios) | peak of the mean curve "
             f"| time to 99% of {baseline}'s mean-curve peak | speed-up vs {baseline} (authors': mean curves) "
             f"| peak, 95% CI over seeds | per-seed speed-up, 95% CI (geometric) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.label} | {r.peak:.1%} | {seconds(r.time_to_target)} | {times(r.speedup)} "
                     f"| {r.mean_curve_peak:.1%} | {seconds(r.mean_curve_time)} | {times(r.mean_curve_speedup)} "
                     f"| {interval(r.peak_ci95, lambda x: f'{x:.1%}')} "
                     f"| {interval(r.speedup_ci95, lambda x: f'{x:.2f}x')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
