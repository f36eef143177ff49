#!/usr/bin/env bash
# Installs the pinned arctic-inference (its suffix trees: the `suffix` drafter) into the venv. PyPI has only its
# sdist, whose build would fetch a CUDA torch into an isolated build environment; it is built here without
# isolation against the venv's own CPU torch (only the small nanobind extension compiles, ~1 min on 2 cores). The
# wheel is kept under the cache, keyed by version and Python. Usage: PYTHON=.venv/bin/python scripts/build-arctic-inference.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
VERSION=$(sed -n 's/.*arctic-inference==\([0-9.]*\).*/\1/p' "$ROOT/pyproject.toml" | head -1)
TORCH=$(sed -n 's/.*"torch==\([0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -1)
CACHE=${SPECDECODE_CACHE:-$HOME/.cache/specdecode}
KEY=$( { echo "$VERSION"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
WHEELS="$CACHE/arctic-inference/$KEY"
if ! ls "$WHEELS"/arctic_inference-*.whl > /dev/null 2>&1; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    # What its build needs, without isolation: its setup.py imports torch; nanobind builds the extension.
    "$PY" -m pip install -q "torch==$TORCH" "nanobind==2.9.2" ninja setuptools wheel
    echo "building arctic-inference $VERSION (suffix trees; about a minute, once per machine)"
    start=$(date +%s)
    # CMake must find the venv's Python (it holds nanobind), not the first python3 on PATH.
    CMAKE_ARGS="-DPython_EXECUTABLE=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" \
        "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheel" "arctic-inference==$VERSION"
    mkdir -p "$WHEELS"
    mv "$work"/wheel/arctic_inference-*.whl "$WHEELS/"
    echo "arctic-inference $VERSION built in $(( $(date +%s) - start )) s -> $WHEELS"
fi
"$PY" -m pip install -q --no-deps "$WHEELS"/arctic_inference-*.whl
