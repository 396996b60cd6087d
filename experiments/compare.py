"""Methods side by side over seeds, or one of the paper's ablations, with a plot and a speed-up table.

    python -m experiments.compare --methods grpo,pods --seeds 0,1,2 --time-budget 240 --out runs/compare
    python -m experiments.compare --ablation rule --out runs/rules

Every other flag (--model, --mesh, --max-completion-length, ...) is shared: each method
gets the config its own command line would (``--method M`` plus these flags), each sweep
point changes the algorithm section of PODS's, and each seed sets its seed and directory
on the config. Runs go to <out>/<label>-seed<s>/ and are skipped when already complete,
so an interrupted comparison continues where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Any

from experiments import cli, completed, config_decoding, launch_checks, run_dir
from experiments import flags as flags_lib
from experiments.config import ExperimentConfig, describe_setting
from experiments.compare_args import ABLATIONS, parse
from experiments.usage import UsageError
from experiments import analysis
from podsjax.run.metrics import read_jsonl, to_jsonable

# The per-step figures the second table averages: what the groups held, and where a step's time went.
STEP_FIGURES = {"zero-variance groups drawn": "data/zero_std_groups_drawn",
                "before selection": "reward/zero_std_groups", "after selection": "reward/zero_std_groups_selected"}
PHASES = ("generation", "scoring", "selection", "update")


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A command line, parsed and checked before any run starts.

    Attributes:
        args: compare's own flags (``--methods`` as a list, ``--seeds`` as integers).
        run_args: the launch flags every run shares (``experiments.flags.parse``).
        shared: the config the shared flags give, PODS's (the default method).
        variants: label -> that method's or sweep point's config, before its seed and directory.
        baseline: the label whose peak sets the time-to-accuracy target.
    """

    args: argparse.Namespace
    run_args: argparse.Namespace
    shared: ExperimentConfig
    variants: dict[str, ExperimentConfig]
    baseline: str


# What a comparison writes in --out: its runs (and the tiny preset's warm-ups), the plot, the summary.
_OWN_ENTRY = re.compile(r"[\w.+=-]+-seed\d+|accuracy_vs_time\.png|summary\.json")  # n=16-seed0: an ablation's


def _check_out(out: str) -> None:
    """--out is new, empty, or an earlier comparison's: it never writes beside other files."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} exists and is not a directory")
    others = sorted(n for n in os.listdir(out) if not _OWN_ENTRY.fullmatch(n)) if os.path.isdir(out) else []
    if others:
        raise UsageError(f"--out {out} holds what no comparison wrote ({run_dir.describe(others)}); "
                         "choose a new or empty directory")


def prepare(argv) -> Comparison:
    """Parses and checks the shared flags, and builds every variant's config before any run."""
    args, passthrough = parse(argv)
    _check_out(args.out)
    # PODS's config: --method is compare's to set, so the parser's default method applies.
    run_args, shared = flags_lib.parse(args.task, passthrough)
    launch_checks.check(run_args, shared)
    if shared.run.eval_every_s is None:  # each run would train, and the comparison then find nothing to read
        raise UsageError("compare reads each run's evaluations, and --eval-every null turns them off")
    for seed in args.seeds:  # a seed the run config refuses is one line before any run
        try:
            flags_lib.replace_run(shared, seed=seed)
        except ValueError as exc:
            raise UsageError(f"--seeds: {exc}") from None
    chosen = variants(args, passthrough, shared)
    baseline = args.baseline or ("grpo" if "grpo" in chosen else next(iter(chosen)))
    if baseline not in chosen:
        raise UsageError(f"--baseline {baseline!r} is not among {sorted(chosen)}")
    _check_same_comparison(args.out, list(chosen), list(args.seeds))
    return Comparison(args, run_args, shared, chosen, baseline)


def _check_same_comparison(out: str, labels: list[str], seeds: list[int]) -> None:
    """An earlier comparison's summary.json and plot in ``out`` are replaced only by the same
    comparison's (its methods over its seeds), never by another's."""
    path = os.path.join(out, "summary.json")
    try:
        with open(path, encoding="utf-8") as f:
            earlier = json.load(f)
        had = ([row["label"] for row in earlier["methods"]], list(earlier["seeds"]))
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or not one that compare wrote
        return
    if had != (labels, seeds):
        raise UsageError(f"--out {out} holds the comparison of {', '.join(had[0])} over seeds "
                         f"{', '.join(map(str, had[1]))}; this one ({', '.join(labels)} over seeds "
                         f"{', '.join(map(str, seeds))}) would replace its summary.json and plot: choose another --out")


def variants(args, passthrough: list[str], shared: ExperimentConfig) -> dict[str, ExperimentConfig]:
    """label -> the config of that method, or of that sweep point over the shared config.

    Args:
        args: compare's flags (``parse``): ``--ablation``, else ``--methods``.
        passthrough: the flags every run shares.
        shared: their config, PODS's.
    """
    if args.ablation:
        return {label: with_algorithm(shared, label, fields) for label, fields in ABLATIONS[args.ablation].items()}
    # Each method's config is what its own command line gives (its preset, then the shared flags).
    return {method: flags_lib.parse(args.task, passthrough, method=method)[1] for method in args.methods}


def with_algorithm(config: ExperimentConfig, label: str, fields: dict[str, Any]) -> ExperimentConfig:
    """``config`` with ``fields`` of its algorithm section replaced; a refused value is a one-line error."""
    try:
        return dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm, **fields))
    except ValueError as exc:
        raise UsageError(f"{label}: {exc}") from None


def seed_config(config: ExperimentConfig, seed: int, out: str, root: str) -> ExperimentConfig:
    """One run of a variant: its seed and directory.

    On the tiny preset every method of a seed starts from the same warmed-up policy: the
    shared warm-up cache's (``podsjax.tiny.warmup_cache``), which single runs of that seed
    use too. A comparison begun before that cache existed keeps the warm-ups it made in
    ``<root>/tiny_warmup-seed<s>``.

    Args:
        config: the variant's config.
        seed: the run's seed.
        out: the run's directory.
        root: the comparison's directory.
    """
    config = flags_lib.replace_run(config, seed=seed, out_dir=out)
    earlier = os.path.join(root, f"tiny_warmup-seed{seed}")
    if config.model.path is None and os.path.isdir(earlier):
        config = dataclasses.replace(config, tiny=dataclasses.replace(config.tiny, warmup_dir=earlier))
    return config


def check_resumable(config: ExperimentConfig, out: str) -> None:
    """A stopped run continues with the config it started with: only ``flags.RESUMABLE`` fields may differ."""
    def fields(c):
        return {f"{section}.{key}": value for section, values in config_decoding.as_json(c).items()
                for key, value in values.items()}

    saved, wanted = fields(config_decoding.read_run_config(out)), fields(config)
    for name, value in wanted.items():
        if name not in flags_lib.RESUMABLE and saved.get(name) != value:
            raise UsageError(f"{out} was started with --{name} {saved.get(name)!r}, not {value!r}: rerun with "
                             "the flags it started with, or pass another --out")


def run_one(config: ExperimentConfig, *, dry_run: bool = False, topology: str | None = None) -> list[dict]:
    """Runs ``config`` in its ``run.out_dir`` and returns its evaluations.

    A complete run (with ``final_model/``) is only read, unless ``config`` asks for a longer
    budget than it started with and its last training step came before that budget: then it
    continues, as one with a ``config.json`` but no export does, from its last checkpoint.
    Either way its flags must be the ones it started with, as a resume's must.
    """
    out = config.run.out_dir
    if not dry_run and completed.is_complete(config, out):
        check_resumable(config, out)  # a finished run of other flags is not this comparison's
        return _within_budget(_history(out), config, out)
    resume = not dry_run and launch_checks.has_run(out)  # a dry run's config.json alone starts the run
    launch_checks.check_out(argparse.Namespace(out=out, resume=resume, overwrite=False, dry_run=dry_run))
    if resume:
        check_resumable(config, out)
    from experiments import runner  # imports JAX: only after main has set up the devices

    code = runner.run_experiment(config, out, overwrite=False, resume=resume, dry_run=dry_run, topology=topology,
                                 started_at=time.time())
    if code != 0:
        raise SystemExit(code)
    return [] if dry_run else _history(out)


def _within_budget(history: list[dict], config: ExperimentConfig, out: str) -> list[dict]:
    """A complete run's evaluations up to this comparison's budget (asked again for less, a
    comparison reads the curves it asked for): up to ``--max-steps``, and up to the step whose
    training clock first reached ``--time-budget`` (a run's last evaluation comes after it)."""
    run = config.run
    kept = [e for e in history if run.max_steps is None or e.get("step", 0) <= run.max_steps]
    if run.time_budget_s is not None:
        path = os.path.join(out, "metrics.jsonl")
        rows = read_jsonl(path) if os.path.isfile(path) else []
        reached = [r["step"] for r in rows if r.get("time/elapsed_train_s", -1) >= run.time_budget_s and "step" in r]
        if reached:
            kept = [e for e in kept if e.get("step", 0) <= min(reached)]
    if len(kept) < len(history):
        print(f"note: {out} trained past this comparison's budget; its curve is read up to it "
              f"({len(kept)} of its {len(history)} evaluations)", flush=True)
    return kept


def _history(out: str) -> list[dict]:
    from podsjax.rl import read_history

    return with_trained_tokens(read_history(out), out)


def with_trained_tokens(history: list[dict], run_dir: str) -> list[dict]:
    """Each evaluation with ``analysis.TRAINED_TOKENS``: the tokens trained by its step, summed from
    metrics.jsonl, whose training rows hold each step's own count. Unchanged where the run
    logged no counts (an older run), so its plot leaves the tokens panel empty."""
    path = os.path.join(run_dir, "metrics.jsonl")
    steps = [r for r in read_jsonl(path) if r.get("train/num_tokens") is not None] if os.path.isfile(path) else []
    if not steps:
        return history
    # A training row's step counts the update it logs, so step s's tokens are trained at an evaluation at s.
    return [{**e, analysis.TRAINED_TOKENS: sum(r["train/num_tokens"] for r in steps if r["step"] <= e["step"])}
            if "step" in e else e for e in history]


def main(argv=None) -> int:
    out = None  # the run under way, named by a full-disk error
    try:
        comparison = prepare(argv)
        args, run_args = comparison.args, comparison.run_args
        run_args.distributed = cli.distributed_plan(run_args)
        cli.start(run_args, comparison.shared)  # once for every run
        os.makedirs(args.out, exist_ok=True)
        histories = {}
        for label, config in comparison.variants.items():
            if run_args.setting:
                origins = getattr(run_args, "origins", None)
                print(describe_setting(run_args.setting, config.algorithm.algorithm, config, origins),
                      flush=True)
            histories[label] = []
            for seed in args.seeds:
                run = seed_config(config, seed, os.path.join(args.out, f"{label}-seed{seed}"), args.out)
                out = run.run.out_dir
                print(f"== {label}, seed {seed}: {out}", flush=True)  # each run's console lines follow
                histories[label].append(run_one(run, dry_run=run_args.dry_run, topology=run_args.topology))
        out = None
    except KeyboardInterrupt:
        print("interrupted; run the same command again to continue", file=sys.stderr)
        return 130
    except Exception as exc:
        line = cli.user_error_line(exc, out)
        if line is None:
            raise  # a bug: its traceback says where
        print(f"error: {line}", file=sys.stderr)
        return 2
    if run_args.dry_run:
        print(f"dry runs done; each run's figures are in {args.out}/<label>-seed<s>/dry_run.json")
        return 0
    return report(comparison, histories)


def report(comparison: Comparison, histories: dict[str, list[list[dict]]]) -> int:
    """The plot, the speed-up table and summary.json, from every run's evaluations."""
    args, baseline = comparison.args, comparison.baseline
    empty = [f"{label}-seed{seed}" for label, runs in histories.items() for seed, h in zip(args.seeds, runs) if not h]
    if empty:  # a run stopped before its first evaluation: no curve to compare
        print(f"error: no evaluations in {', '.join(empty)} (under {args.out}); nothing to compare: give each run "
              "time for at least one evaluation (--time-budget, --max-steps, --eval-every)", file=sys.stderr)
        return 2
    groups = {label: [analysis.Curve.from_history(h) for h in runs] for label, runs in histories.items()}
    by_steps = analysis.curves_on(histories, "steps")
    title = f"{args.task}: {args.ablation + ' ablation' if args.ablation else ' vs '.join(groups)}"
    plot_path = os.path.join(args.out, "accuracy_vs_time.png")  # three panels: time, steps, trained tokens
    analysis.plot(groups, plot_path, title, by_steps=by_steps, by_tokens=analysis.curves_on(histories, "tokens"))
    rows = analysis.summarize(groups, baseline)
    print(format_summary(rows, baseline, len(args.seeds)))
    print(format_late_gains(rows))
    step_speedups = speedups_in_steps(by_steps, histories, baseline)
    if step_speedups:
        print(format_step_speedups(step_speedups, baseline))
    figures = {label: step_figures([os.path.join(args.out, f"{label}-seed{seed}") for seed in args.seeds])
               for label in histories}
    print(format_step_figures(figures))
    summary = {"baseline": baseline, "seeds": args.seeds, "plot": plot_path,
               "methods": [r.__dict__ for r in rows], "steps": figures, "step_speedups": step_speedups}
    with open(os.path.join(args.out, "summary.json"), "w") as f:  # strict JSON: never reached, undefined: null
        json.dump(to_jsonable(json.loads(json.dumps(summary, default=str)), "summary"), f, indent=2, allow_nan=False)
    print(f"plot: {plot_path}")
    return 0


def speedups_in_steps(by_steps: dict, histories: dict, baseline: str) -> dict[str, dict[str, Any]]:
    """label -> the per-seed estimator measured in RL steps (generated batches) instead of seconds: each seed's
    steps to 99% of the baseline's peak on it, the speed-ups, and their median. Empty when a
    run's evaluations do not record their step, as the seeds must pair up."""
    if any(len(by_steps[label]) != len(runs) for label, runs in histories.items()):
        return {}
    return {r.label: {"steps_to_target": list(r.seed_times), "speedups": list(r.seed_speedups),
                      "median": r.speedup} for r in analysis.summarize(by_steps, baseline)}


def format_step_speedups(speedups: dict[str, dict[str, Any]], baseline: str) -> str:
    """One line per method: its per-seed speed-ups in steps and their median."""
    lines = [f"speed-up vs {baseline} in RL steps (steps to 99% of its peak on the seed), per seed:"]
    for label, s in speedups.items():
        # "never" where the method never reached the target; a 0.00x where it did, but the
        # baseline's start already had.
        per_seed = ", ".join("never" if math.isinf(steps) else f"{x:.2f}x"
                             for x, steps in zip(s["speedups"], s["steps_to_target"]))
        lines.append(f"  {label}: {per_seed} (median {_times(s['median'])})")
    return "\n".join(lines)


def _times(speedup: float) -> str:
    return "never" if speedup == 0 else f"{speedup:.2f}x"


def step_figures(run_dirs: list[str]) -> dict[str, float]:
    """Means over every training step of the runs (each run's first, compiling step left out):
    the zero-variance fractions of ``STEP_FIGURES`` and each phase's share of a step's time."""
    steps = []
    for directory in run_dirs:
        path = os.path.join(directory, "metrics.jsonl")
        if os.path.isfile(path):
            steps += [r for r in read_jsonl(path) if "train/loss" in r][1:]
    out: dict[str, float] = {"steps": float(len(steps))}
    for label, key in STEP_FIGURES.items():
        values = [r[key] for r in steps if r.get(key) is not None]
        if values:
            out[label] = sum(values) / len(values)
    totals = {phase: sum(r.get(f"time/{phase}", 0.0) for r in steps) for phase in PHASES}
    whole = sum(totals.values())
    for phase in PHASES:
        out[f"{phase} share"] = totals[phase] / whole if whole > 0 else math.nan
    return out


def format_step_figures(figures: dict[str, dict[str, float]]) -> str:
    """The table of ``step_figures`` per method (a dash where a run does not log a figure)."""
    columns = [*STEP_FIGURES, *(f"{phase} share" for phase in PHASES)]
    lines = ["| method | steps | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for label, values in figures.items():
        cells = ["-" if c not in values or math.isnan(values[c]) else f"{values[c]:.1%}" for c in columns]
        lines.append(f"| {label} | {values['steps']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_late_gains(rows) -> str:
    """Whether each method still gained at the end of its runs, the check that a budget was long
    enough: the slope of accuracy over the last third of each run's training clock, in points
    per 100 s, its mean over seeds with a 95% interval, and each seed's."""
    def points(x):
        return f"{x * 1e4:+.1f}"

    lines = ["accuracy over the last third of each run's training clock, points per 100 s:"]
    for r in rows:
        low, high = r.late_slope_ci95
        if any(math.isnan(x) for x in (*r.late_slopes, low, high)):
            lines.append(f"  {r.label}: - (needs 2 seeds, each with 3 evaluations in its last third)")
            continue
        verdict = "still rising" if low > 0 else "falling" if high < 0 else "no trend its interval can tell from 0"
        lines.append(f"  {r.label}: {points(sum(r.late_slopes) / len(r.late_slopes))} (95% CI {points(low)} to "
                     f"{points(high)}; per seed {', '.join(points(x) for x in r.late_slopes)}): {verdict}")
    return "\n".join(lines)


def format_summary(rows, baseline, seeds) -> str:
    """Both speed-up estimators (see experiments.analysis): per seed, and the authors' mean curves."""
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
