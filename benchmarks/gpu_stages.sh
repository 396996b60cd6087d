# Sourced by gpu_suite.sh and gpu_check.sh: $OUT made, the GPU's environment, the run extra's
# wheels from .whl/ when they are there (benchmarks/gpu_wheels.sh), and `stage NAME LIMIT
# COMMAND...`, which runs a command with a time limit (unless $STAGES names others) and its
# own XLA flags when $XLA_FLAGS_<NAME> is set, logs it to $OUT/NAME.log and times it in
# $OUT/stages.log.
mkdir -p "$OUT"
PY=${PY:-python3}
# JAX and CUDA torch share the GPU in one benchmark process: JAX takes memory as it needs it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/podsjax-site \
      .whl/*.whl; then
    export PYTHONPATH="/tmp/podsjax-site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "warning: the wheels in .whl/ did not install" >&2
  fi
fi
# The run extra's packages, at once: missing, the CLI stage would fail minutes in.
if ! "$PY" -c "import draccus, math_verify, latex2sympy2_extended, pylatexenc, tensorboardX" 2>/dev/null; then
  echo "error: the run extra's packages are missing: run bash benchmarks/gpu_wheels.sh where pip reaches the" \
    "registry, and bring .whl/ along (the device tool: carry [\".whl\"])" >&2
  exit 2
fi
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/stages.log"; }
selected() { [ -z "${STAGES:-}" ] || [[ " $STAGES " == *" $1 "* ]]; }  # $STAGES (names, space-separated) picks stages
stage() {  # name, time limit, command...: under XLA_FLAGS_<NAME> when set (e.g. XLA_FLAGS_CLI), else XLA_FLAGS
  local name=$1 limit=$2; shift 2
  if ! selected "$name"; then stamp "skip $name"; return; fi
  local own="XLA_FLAGS_${name^^}"
  local flags=${!own-${XLA_FLAGS:-}}
  # As the stage's python sees them: the benchmarks add the main job's GPU flags that these leave unset.
  stamp "start $name; XLA_FLAGS=$(XLA_FLAGS="$flags" "$PY" -c 'import benchmarks, os; print(os.environ.get("XLA_FLAGS", ""))')"
  XLA_FLAGS="$flags" timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  stamp "end $name rc=$?"
}
