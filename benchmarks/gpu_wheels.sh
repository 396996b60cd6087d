#!/bin/bash
# Downloads into .whl/ (ignored by git) the wheels of the `run` extra that a stock GPU image
# may lack: pure-Python packages, so a host without the GPU (any OS, with pip and a network)
# can fetch them for the GPU host's Python. benchmarks/gpu_check.sh installs them from there.
#
#   bash benchmarks/gpu_wheels.sh [python version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}  # the versions installed here
rm -rf .whl && mkdir -p .whl
# draccus (flags and config files) with its needs, the graders (math-verify, its LaTeX
# parser and ANTLR runtime, pylatexenc), TensorBoard's writer. Versions: what `pip install
# -e '.[run]'` resolves here, so both machines run the same graders. pytest and xdist (the
# project's pytest options name -n) for the check's kernel stage.
for pkg in draccus mergedeep pyyaml-include toml typing-inspect mypy-extensions math-verify latex2sympy2_extended \
           antlr4-python3-runtime pylatexenc tensorboardX pytest pluggy iniconfig pytest-xdist execnet; do
  version=$("$PY" -m pip show "$pkg" 2>/dev/null | sed -n 's/^Version: //p' || true)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d .whl "$pkg${version:+==$version}"
done
# Pure-Python wheels only: one built for this host's Python (or an sdist) would make the GPU
# host's one `pip install` of the folder refuse every wheel.
if ls .whl | grep -v -e '-none-any\.whl$'; then
  echo "error: the files above are no pure-Python wheels; the GPU host could not install them" >&2
  exit 2
fi
ls .whl
du -sh .whl
