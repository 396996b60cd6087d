#!/bin/bash
# The GPU figures in one command, from the root of a clone, on a host with one GPU:
# the benchmarks one at a time (each against CUDA torch or the memory floor), then the suite.
#
#   bash benchmarks/gpu_suite.sh [stage ...]    stages: env generate profile train forward cli tests
#
# Logs go to $OUT (default /tmp/podsjax-gpu-suite), one file a stage, and stages.log times
# them. Every stage has a time limit (T_<STAGE> seconds) so a slow one cannot stop the rest.
# SHAPE (default qwen2.5-1.5b) and SHAPE_ARGS choose the model; ROWS, PL, NT the decode shape.
set -o pipefail
OUT=${OUT:-/tmp/podsjax-gpu-suite}
SHAPE=${SHAPE:-qwen2.5-1.5b}
source "$(dirname "$0")/gpu_stages.sh"
model=(--shape "$SHAPE" $SHAPE_ARGS --dtype bfloat16)
for s in ${*:-env generate train forward cli tests}; do case $s in
env) stage env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc;
  $PY -c 'import jax, torch, transformers; print(\"jax\", jax.__version__, jax.devices(), \"torch\", torch.__version__, \"transformers\", transformers.__version__)'" ;;
generate) stage generate "${T_GENERATE:-300}" $PY -m benchmarks.generate "${model[@]}" --rows "${ROWS:-256}" \
  --prompt-len "${PL:-512}" --new-tokens "${NT:-512}" --tasks '' ;;
profile) stage profile "${T_PROFILE:-240}" $PY -m benchmarks.generate "${model[@]}" --rows "${ROWS:-64}" \
  --prompt-len "${PL:-512}" --new-tokens "${NT:-256}" --tasks '' --repeats 1 --profile "$OUT/trace" ;;
train) stage train "${T_TRAIN:-240}" $PY -m benchmarks.train_step "${model[@]}" --batch "${TB:-16}" \
  --prompt-len "${PL:-512}" --completion-len "${NT:-512}" --update "${UPDATE:-lora,full}" ;;
forward) stage forward "${T_FORWARD:-120}" $PY -m benchmarks.forward "${model[@]}" --batch 8 --seq 1024 ;;
cli) stage cli "${T_CLI:-420}" $PY -m benchmarks.cli_step "${model[@]}" --max-steps "${STEPS:-4}" --eval-limit 16 ;;
tests) stage tests "${T_TESTS:-900}" bash -c "$PY -m pytest -n ${WORKERS:-8} -vv -p no:cacheprovider -rfEs \
  --durations=20 -m 'not cpu_mesh'; $PY -m pytest -n ${WORKERS:-8} -vv -p no:cacheprovider -rfEs -m cpu_mesh" ;;
*) echo "unknown stage $s (env generate profile train forward cli tests)"; exit 2 ;;
esac; done
stamp done
