#!/bin/bash
# A GPU check at setting a's shape, in two calls of about 5 minutes on one GPU, from the root of a clone:
#   1. decode at setting a's shape (Qwen2.5-1.5B, 1 prompt x 64 samples, 512 + 512 tokens,
#      bf16): the step's time against its memory floor, then the kernels of one traced call;
#      decode_triton: the same with XLA's Triton GEMMs, autotuned, instead of cuBLAS calls;
#   2. the CLI on setting a (a random 1.5B checkpoint, PODS n 64 m 16, LoRA r64): start to
#      the first finished step with a cold and then a warm compile cache (and when the params
#      were loaded, the fit check began and ended, and the step-0 evaluation printed), the
#      programs compiled before it, the steady step and its phases, and the plan's roofline
#      beside them. Each run is ended once its last step lands.
# Before them, optionally: the decode kernel compiled through Triton against the XLA form (stage kernel:
# tests/models/test_decode_kernel.py; pytest comes with .whl/), and one layer's decode attention under several splits
# (stage attention: benchmarks/kernel_variants.py) against the XLA form, JAX's own Pallas kernels and its floor.
# The decode and CLI stages run under $KERNEL_VARIANT, else the attention stage's pick (the plan, unless another
# split matches the XLA form and is 5 % faster), else the plan.
#
#   bash benchmarks/gpu_wheels.sh     # once, on any host with pip: the run extra's wheels into .whl/
#   bash benchmarks/gpu_check.sh      # on the GPU host; installs .whl/ first when it is there
#
# On the device machine, as two calls (about 12 minutes of device time with the start-up). Each
# carries .whl/, which git ignores (the device tool's carry [".whl"]; without it the check
# stops at once), and runs under a timeout of its stages' limits plus 30 s (printed first):
#   1. The main job's own XLA flags (GEMMs as cuBLAS calls: podsjax.devices.accelerators.GPU_XLA_FLAGS):
#      decode under the plan, then the CLI cold then warm (timeout 330 s: the limits sum to 300 s):
#        STAGES="decode cli" T_DECODE=100 T_CLI=190 DECODE=--no-reference bash benchmarks/gpu_check.sh
#   2. One layer's attention under each split, beside JAX's own Pallas decode kernels
#      (benchmarks/jax_decode_kernels.py); then decode under the sweep's pick, with cuBLAS and with
#      Triton's GEMMs (timeout 330 s: the limits sum to 295 s):
#        STAGES="attention decode decode_triton" T_ATTENTION=90 T_DECODE=95 T_DECODE_TRITON=95 \
#          DECODE=--no-reference bash benchmarks/gpu_check.sh
# A cold CLI start with Triton's GEMMs took 212 s and more than 310 s before; it wants a call of its own:
#   STAGES=cli T_CLI=290 RUNS=1 XLA_FLAGS_CLI=--xla_gpu_enable_triton_gemm=true bash benchmarks/gpu_check.sh
# The CLI's console is echoed with times as it lands, so a limit that stops a run still shows
# each program's compile; the stopped CLI is ended with it, its last lines echoed.
# VARIANT adds a further CLI run, cold, with those XLA flags (each run's row prints as it ends,
# so a limit that stops the last keeps the earlier ones).
#
# Logs go to $OUT (default /tmp/podsjax-gpu-check), one file a stage, and stages.log, which
# stamps each stage's XLA_FLAGS as its python sees them. T_KERNEL, T_ATTENTION, T_DECODE,
# T_DECODE_TRITON and T_CLI are the stages' time limits in seconds; STAGES picks stages (e.g.
# STAGES="decode cli"). XLA_FLAGS passes through to every stage; XLA_FLAGS_<STAGE> (e.g.
# XLA_FLAGS_CLI) replaces it for that stage alone.
# RUNS sets the CLI stage's runs on one compile cache (default 2: cold, then warm).
# PROMPTS and SAMPLES set the decode stages' shape (default 1 x 64, setting a's: the prompt held once for its samples).
# DECODE adds flags to the decode stages (e.g. DECODE=--no-reference: podsjax alone, no transformers).
# STEPS_PER_CHECK sets the decode stages' steps between two stop checks (1: a check every token, as before).
# A dry run on a CPU, cut down: ATTENTION="--rows 8 --prompt-len 32 --slots 32 --filled 16 --head-dim 16
# --sets 1 --iters 1 --dtype float32" MODEL="--layers 1 --hidden 64 --intermediate 128 --heads 4
# --kv-heads 2 --vocab 1024" DTYPE=float32 SAMPLES=8 PL=32 NT=16 CLI="--n 8 --m 4
# --max-completion-length 16" bash benchmarks/gpu_check.sh
set -o pipefail
OUT=${OUT:-/tmp/podsjax-gpu-check}
source "$(dirname "$0")/gpu_stages.sh"
stamp "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null); the caller's XLA_FLAGS=${XLA_FLAGS:-}"
# decode_triton: the decode stage again, with XLA's Triton GEMMs (autotuned) instead of cuBLAS calls.
XLA_FLAGS_DECODE_TRITON=${XLA_FLAGS_DECODE_TRITON-"${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_triton_gemm=true"}
T_KERNEL=${T_KERNEL:-60} T_ATTENTION=${T_ATTENTION:-90} T_DECODE=${T_DECODE:-190} \
  T_DECODE_TRITON=${T_DECODE_TRITON:-190} T_CLI=${T_CLI:-340}
limits=0
for pair in "kernel $T_KERNEL" "attention $T_ATTENTION" "decode $T_DECODE" "decode_triton $T_DECODE_TRITON" "cli $T_CLI"; do
  set -- $pair
  if selected "$1"; then limits=$(( limits + $2 + 5 )); fi
done
stamp "the stages' limits: $limits s in all (a caller's own time limit wants about 30 s more)"
stage kernel "$T_KERNEL" "$PY" -m pytest -rs -n 0 -p no:cacheprovider tests/models/test_decode_kernel.py -k on_a_gpu
pick="$OUT/split_for_decoding.txt"
if selected attention; then rm -f "$pick"; fi  # an earlier sweep's pick must not stand in for this one's
stage attention "$T_ATTENTION" "$PY" -m benchmarks.decode_attention --best-to "$pick" ${ATTENTION:-}
# The decode and CLI stages run under $KERNEL_VARIANT, else the attention stage's pick, else the plan.
variant=${KERNEL_VARIANT:-$(cat "$pick" 2>/dev/null || echo "the plan")}
stamp "kernel variant: $variant"
model=(${MODEL:---shape qwen2.5-1.5b} --dtype "${DTYPE:-bfloat16}")
decode() {  # stage name, time limit
  stage "$1" "$2" "$PY" -m benchmarks.kernel_variants "$variant" benchmarks.generate "${model[@]}" \
    --prompts "${PROMPTS:-1}" --samples "${SAMPLES:-64}" \
    --prompt-len "${PL:-512}" --new-tokens "${NT:-512}" --tasks '' --repeats 1 --profile "/tmp/podsjax-trace-$1" \
    ${DECODE:-} ${STEPS_PER_CHECK:+--steps-per-check $STEPS_PER_CHECK}
}
decode decode "$T_DECODE"
decode decode_triton "$T_DECODE_TRITON"
stage cli "$T_CLI" "$PY" -m benchmarks.cli_step "${model[@]}" --max-steps 4 --eval-limit 16 --runs "${RUNS:-2}" \
  --kernel-variant "$variant" ${VARIANT:+"--variant-xla-flags=$VARIANT"} ${CLI:+--cli-flags $CLI}
stamp done
