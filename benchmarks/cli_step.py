"""The end-to-end CLI on a random checkpoint: time to the first finished PODS step, steady step time, phases.

A random-weight checkpoint of --shape (small ~98M by default, or qwen2.5-0.5b /
1.5b / 3b; podsjax ``init_params`` + ``save_pretrained``, written on the host CPU so
the accelerator stays free for the runs) is saved with a byte-level BPE tokenizer
trained here on GSM8K text under Qwen2's pre-tokenizer (ChatML template, so the
prompts have realistic lengths), next to a small local GSM8K split taken from
--data. Then the real CLI runs as a subprocess, --runs times (default 2: cold, then
warm compile cache; both use one fresh cache directory), and with --variant-xla-flags once
more, cold, with those XLA flags added (to compare, e.g., GEMMs without Triton)::

    python -m experiments.gsm8k --model <ckpt> --data <dir> --eval-data <dir> --setting a --method pods \
        --max-steps K --eval-limit E --dtype <dtype> --out <run> [--compile-cache-dir <cache>] [CLI flags...]

The table gives, per run: the wall time from launch to the first finished step
(seen when its line lands in ``<run>/metrics.jsonl``; the CLI evaluates at step 0
first, as a user's run does), that step's phases (compiles included), and the
median steady step (steps 2..K) with its phases from ``time/generation``,
``time/scoring``, ``time/selection`` and ``time/update``. A run is ended once its step K
lands (its final evaluation and export are not timed), so "wall" is launch to step K.
The CLI runs with JAX's default preallocation of GPU memory, as a user's run does. The CLI's console lines are
echoed as they land, each with its time since the launch, and when the params were loaded, the fit check
started and ended (on a GPU or TPU: where the start lowers its programs and compiles or
loads them), the step-0 evaluation printed and the first step finished, counted from
the launch; its whole output is in ``<run>.log``.

A random model almost never samples EOS, so every completion runs to the full
length: the slowest case of each setting.

Run (CPU, a tiny shape; setting a's 64 rollouts x 512 + 512 tokens cut down):
    python -m benchmarks.cli_step --layers 1 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 1024 \
        --max-steps 3 --eval-limit 2 --cli-flags --n 8 --m 4 --max-completion-length 32
Run (GPU, the targets' setting: setting a, n 64, m 16, 512 + 512 tokens):
    python -m benchmarks.cli_step --shape qwen2.5-1.5b --dtype bfloat16 --max-steps 5 --eval-limit 16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.qwen_model import add_shape_args, podsjax_config, resolve

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(REPO_ROOT, "tests", "data")  # real GSM8K / MATH-500 rows
PHASES = ("generation", "scoring", "selection", "update")
POLL_S = 0.05


def accelerator_backend() -> tuple[str, str]:
    """The backend the CLI will get, asked in a child so this process never claims the accelerator."""
    probe = "import jax; print(jax.default_backend(), '|', jax.devices()[0].device_kind)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    backend, kind = out.stdout.strip().splitlines()[-1].split(" | ", 1)
    return backend, kind


def read_jsonl(path: str, limit: int) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line for _, line in zip(range(limit), f)]


def write_data(data_dir: str, out_dir: str, train_examples: int, test_examples: int) -> str:
    """A small local GSM8K: the first N lines of each split."""
    os.makedirs(out_dir, exist_ok=True)
    for split, n in (("train", train_examples), ("test", test_examples)):
        lines = read_jsonl(os.path.join(data_dir, "gsm8k", f"{split}.jsonl"), n)
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(lines)
    return out_dir


def build_tokenizer(train_jsonl: str, vocab_size: int):
    """The tiny preset's byte-level BPE tokenizer (specials, template), with merges learned on GSM8K."""
    from podsjax.data.prompts import DEFAULT_SYSTEM_PROMPT
    from podsjax.tiny.build import build_tokenizer as build_bpe

    with open(train_jsonl, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    corpus = [text for row in rows for text in (row["question"], row["answer"])] + [DEFAULT_SYSTEM_PROMPT] * 100
    return build_bpe(vocab_size, corpus=corpus)


def write_checkpoint(args, path: str, tokenizer_corpus: str) -> int:
    """Random params of the shape, saved as a HF checkpoint with the tokenizer; returns the param count."""
    import jax

    from benchmarks.qwen_model import jax_dtype
    from podsjax.models import Decoder, init_params, save_pretrained

    tokenizer = build_tokenizer(tokenizer_corpus, min(args.tokenizer_vocab, args.spec.vocab))
    config = podsjax_config(args.spec, 2048, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    dtype = jax_dtype(args.dtype)
    model = Decoder(config, dtype=dtype, param_dtype=dtype)
    params = init_params(model, jax.random.key(args.seed))
    save_pretrained(model, params, path, overwrite=True)
    tokenizer.save_pretrained(path)
    return config.num_params


def cli_supports(flag: str) -> bool:
    from experiments.flags import build_parser

    return flag in build_parser("gsm8k")._option_string_actions


def run_cli(command: list[str], out: str, env: dict, tag: str, steps: int) -> dict:
    """Runs the CLI, timestamping each metrics.jsonl step line and each console line as it
    lands, and echoing the console lines as they land (so a run stopped by a time limit
    still shows where its time went); once ``steps`` step lines have landed it ends the CLI
    (what a run does after its last step, the final evaluation and export, is timed by
    nothing here and would hold the device). Returns the timings."""
    shutil.rmtree(out, ignore_errors=True)  # the CLI wants a fresh --out
    metrics, log_path = os.path.join(out, "metrics.jsonl"), out + ".log"
    seen: dict[int, float] = {}  # step -> seconds since launch when its line appeared
    lines: list[tuple[float, str]] = []  # (seconds since launch, console line)
    pending = ""
    start = time.perf_counter()

    def echo(text: str) -> str:  # prints the whole lines of ``text``; returns the unfinished rest
        now = time.perf_counter() - start
        *complete, rest = text.split("\n")
        lines.extend((now, line) for line in complete)
        for line in complete:
            print(f"  {tag} [{now:.1f} s] {line.rstrip()}", flush=True)
        return rest

    ended_here = False
    with open(log_path, "w", encoding="utf-8") as log, open(log_path, encoding="utf-8") as reader:
        child = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                done = child.poll() is not None
                for record in steps_in(metrics):
                    seen.setdefault(record["step"], time.perf_counter() - start)
                pending = echo(pending + reader.read())
                if done:
                    break
                if len(seen) >= steps:  # its reward workers exit when it does
                    child.kill()
                    child.wait()
                    ended_here = True
                    print(f"  {tag} [{time.perf_counter() - start:.1f} s] step {steps} landed: the CLI is ended here",
                          flush=True)
                    break
                time.sleep(POLL_S)
        finally:  # stopped (a time limit's SIGTERM): the CLI goes too, and leaves the device to what runs next
            if child.poll() is None:
                print(f"  {tag} [{time.perf_counter() - start:.1f} s] stopped before the CLI ended", flush=True)
                child.terminate()
                try:
                    child.wait(timeout=2)  # within the time limit's 5 s of grace, with the echo below
                except subprocess.TimeoutExpired:
                    child.kill()
                echo(pending + reader.read() + "\n")  # what it printed since the last poll, and on its way out
    wall_s = time.perf_counter() - start
    with open(log_path, encoding="utf-8") as f:
        console = f.read()
    if child.returncode != 0 and not ended_here:
        raise SystemExit(f"error: the CLI exited with {child.returncode}:\n{' '.join(command)}\n{console[-4000:]}")
    steps = steps_in(metrics)
    if not steps:
        raise SystemExit(f"error: the CLI finished no step:\n{console[-4000:]}")
    return dict(steps=steps, first_step_s=seen[steps[0]["step"]], wall_s=wall_s, console=console, lines=lines)


# The console lines that mark a start's milestones, as the CLI prints them.
# (name, the console line that marks it, whether every run prints it): the fit check runs
# only on a device that reports its memory (a GPU or TPU, not a CPU); between its two lines
# the start lowers its programs and compiles them or loads them from the compile cache.
MILESTONES = (("params loaded", re.compile(r"^loaded \S+ params in "), True),
              ("fit check from", re.compile(r"^checking that the run fits"), False),
              ("to", re.compile(r"^memory per device"), False),
              ("step-0 evaluation", re.compile(r"^eval at step 0\b"), True),
              ("first step", re.compile(r"^first step done "), True))


def timeline(lines: list[tuple[float, str]]) -> str:
    """Where a start's seconds went: when each milestone's console line appeared (within the
    poll interval), e.g. ``params loaded 9.1 s, fit check from 11.0 s, to 19.5 s, step-0
    evaluation 21.0 s, first step 38.8 s``; the fit check's are left out where it did not run."""
    marks = []
    for name, pattern, always in MILESTONES:
        at = next((t for t, line in lines if pattern.search(line)), None)
        if at is not None:
            marks.append(f"{name} {at:.1f} s")
        elif always:
            marks.append(f"{name} not seen")
    return ", ".join(marks)


def steps_in(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        records = []
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line still being written
                break
    return [r for r in records if "time/update" in r]


def phases_of(step: dict) -> dict[str, float]:
    return {p: float(step[f"time/{p}"]) for p in PHASES}


ROOFLINE = re.compile(r"roofline: ([0-9.]+) (m?s)\b")  # the fit check's "one PODS step at the <GPU>'s roofline: X s"


def summarize(run: dict) -> dict:
    first = phases_of(run["steps"][0])
    steady = [phases_of(s) for s in run["steps"][1:]]
    roofline = ROOFLINE.search(run["console"])
    out = dict(first_step_s=run["first_step_s"], wall_s=run["wall_s"], first=first, steps=len(run["steps"]),
               roofline_s=float(roofline.group(1)) * (1e-3 if roofline.group(2) == "ms" else 1) if roofline else None,
               compiles=sum(1 for line in run["console"].split("first step done")[0].splitlines()
                            if line.startswith("compiled ")))
    if steady:
        out["steady"] = {p: statistics.median(s[p] for s in steady) for p in PHASES}
        out["steady_total"] = statistics.median(sum(s.values()) for s in steady)
    return out


TABLE_HEADER = (
    "| run | start to first finished step | first step: generation / scoring / selection / update "
    "| steady step (median) | generation | scoring | selection | update | plan's roofline | steady / roofline "
    "| compiled before the first step | wall |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|")


def table_row(label: str, s: dict) -> str:
    """One run's row of the table under :data:`TABLE_HEADER`."""
    first = " / ".join(f"{s['first'][p]:.2f}" for p in PHASES)
    if "steady" in s:
        total = s["steady_total"]
        steady = f"{total:.2f} s | " + " | ".join(
            f"{s['steady'][p]:.2f} s ({s['steady'][p] / max(total, 1e-9):.0%})" for p in PHASES)
    else:
        steady = "n/a (one step) | | | |"
    roof = s["roofline_s"]
    ratio = f"{s['steady_total'] / roof:.1f}x" if roof and "steady" in s else "n/a"
    roof = f"{roof:.2f} s" if roof else "not printed (no fit check)"
    return (f"| {label} | {s['first_step_s']:.1f} s | {first} s | {steady} | {roof} | {ratio} "
            f"| {s['compiles']} | {s['wall_s']:.0f} s |")


def main(argv=None):
    # No abbreviations: --cli-flags passes the CLI's own --n / --m through.
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    add_shape_args(parser)
    parser.add_argument("--setting", default="a", help="the paper's setting the CLI runs (default a)")
    parser.add_argument("--method", default="pods", choices=("grpo", "grpo-ga", "pods"))
    parser.add_argument("--max-steps", type=int, default=4, help="PODS steps per run (the first one compiles)")
    parser.add_argument("--eval-limit", type=int, default=8, help="test examples of the step-0 evaluation")
    parser.add_argument("--remat", choices=("full", "none", "dots"), help="passed to the CLI (default: its own)")
    parser.add_argument("--runs", type=int, default=2, help="CLI runs sharing one fresh compile cache (cold, warm)")
    parser.add_argument("--train-examples", type=int, default=64, help="GSM8K train lines in the local split")
    parser.add_argument("--tokenizer-vocab", type=int, default=8192, help="BPE vocabulary (capped at the model's)")
    parser.add_argument("--data", default=DEFAULT_DATA, help="folder holding gsm8k/train.jsonl and test.jsonl")
    parser.add_argument("--work", help="keep checkpoint, data, cache and runs here (default: a temp dir, removed)")
    parser.add_argument("--variant-xla-flags", metavar="FLAGS",
                        help="then one more run, cold (a compile cache of its own), with these XLA_FLAGS added (with =, "
                             "e.g. --variant-xla-flags=--xla_gpu_enable_triton_gemm=false)")
    parser.add_argument("--kernel-variant", metavar="NAME",
                        help="run the CLI under this decode-attention variant (benchmarks.kernel_variants)")
    parser.add_argument("--cli-flags", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for the CLI, e.g. --n 8 --m 4 --max-completion-length 32 (must come last)")
    args = parser.parse_args(argv)
    if args.max_steps < 1 or args.runs < 1 or args.eval_limit < 1:
        raise SystemExit("error: --max-steps, --runs and --eval-limit must be >= 1")

    # A time limit's SIGTERM unwinds like an error, so run_cli stops the CLI it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    backend, device_kind = accelerator_backend()
    import jax

    jax.config.update("jax_platforms", "cpu")  # this process only writes the checkpoint; the CLI gets the device
    from benchmarks import kernel_variants

    if args.kernel_variant is not None and args.kernel_variant not in kernel_variants.VARIANTS:
        raise SystemExit(f"error: unknown --kernel-variant {args.kernel_variant!r}; expected one of "
                         f"{sorted(kernel_variants.VARIANTS)}")
    if args.dtype is None:
        args.dtype = "float32" if backend == "cpu" else "bfloat16"
    resolve(args)

    work = args.work or tempfile.mkdtemp(prefix="podsjax-cli-step-")
    try:
        t0 = time.perf_counter()
        data = write_data(args.data, os.path.join(work, "data"), args.train_examples, args.eval_limit)
        ckpt = os.path.join(work, "checkpoint")
        num_params = write_checkpoint(args, ckpt, os.path.join(args.data, "gsm8k", "train.jsonl"))
        print(f"device for the CLI: {device_kind} ({backend}); checkpoint: {args.shape} shape, {num_params:,} params, "
              f"{args.dtype}, random weights, written in {time.perf_counter() - t0:.0f} s; data: "
              f"{args.train_examples} train / {args.eval_limit} test GSM8K lines")
        remat = ["--remat", args.remat] if args.remat else []
        variant = ["benchmarks.kernel_variants", args.kernel_variant] if args.kernel_variant else []
        cache_flag = cli_supports("--compile-cache-dir")
        runs = [(f"{i + 1}: {'cold' if i == 0 else 'warm'} compile cache", "compile_cache", "")
                for i in range(args.runs)]
        if args.variant_xla_flags:
            runs.append((f"{args.runs + 1}: cold, XLA_FLAGS +{args.variant_xla_flags}", "compile_cache_variant",
                         args.variant_xla_flags))
        summaries = []
        for i, (label, cache_name, xla_flags) in enumerate(runs):
            cache, env = os.path.join(work, cache_name), dict(os.environ)
            if xla_flags:
                env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
            cache_flags = []
            if cache_flag:
                cache_flags = ["--compile-cache-dir", cache]
            else:
                env["JAX_COMPILATION_CACHE_DIR"] = cache
            out = os.path.join(work, f"run{i + 1}")
            command = [sys.executable, "-m", *variant, "experiments.gsm8k", "--model", ckpt, "--data", data, "--eval-data", data,
                       "--setting", args.setting, "--method", args.method, "--max-steps", str(args.max_steps),
                       "--eval-limit", str(args.eval_limit), "--dtype", args.dtype, "--out", out, "--no-progress",
                       "--run.keep_best", "false",  # a second merged export at the end, timed by nothing
                       *cache_flags, *remat, *args.cli_flags]
            if i == 0:
                print("command: " + shlex.join(command))
            # The CLI as a user runs it: JAX takes its memory up front (the benchmarks share the GPU with torch).
            env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
            run = run_cli(command, out, env, f"run {i + 1}", args.max_steps)
            print(f"  run {i + 1}: after launch: {timeline(run['lines'])}")
            summaries.append(summarize(run))
            # Each row as its run ends: a time limit that stops a later run keeps the earlier ones.
            print((TABLE_HEADER + "\n" if i == 0 else "") + table_row(label, summaries[-1]), flush=True)
        if args.runs >= 2 and len(summaries) > 1:  # run 2 is the warm run of run 1's cache (a variant runs cold)
            print(f"warm/cold start to first step: {summaries[1]['first_step_s'] / summaries[0]['first_step_s']:.2f}")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
