#!/usr/bin/env bash
# Installs the pinned llama-cpp-python into the venv, compiled for this CPU from its sdist with our patches
# (patches/llama-cpp/). PyPI has no wheels for it, so pip would compile it anyway (~8 min on 2 cores); the wheel is
# kept under the cache, keyed by version, patches, CPU flags and CMAKE_ARGS, so a second venv on the same machine
# installs it in seconds. Usage: PYTHON=.venv/bin/python scripts/build-llama-cpp-python.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
VERSION=$(sed -n 's/.*llama-cpp-python==\([0-9.]*\).*/\1/p' "$ROOT/pyproject.toml" | head -1)
CACHE=${SPECDECODE_CACHE:-$HOME/.cache/specdecode}
CMAKE_ARGS="-DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}"
KEY=$( { echo "$VERSION"; cat "$ROOT"/patches/llama-cpp/*.patch; grep -m1 '^flags' /proc/cpuinfo; echo "$CMAKE_ARGS";
         "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
WHEELS="$CACHE/llama-cpp-python/$KEY"
if ! ls "$WHEELS"/llama_cpp_python-*.whl > /dev/null 2>&1; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    src=$(PYTHON="$PY" "$ROOT/scripts/llama-cpp-source.sh" "$work")
    echo "compiling llama-cpp-python $VERSION for this CPU (patched; about 8 minutes on 2 cores, once per machine)"
    start=$(date +%s)
    CMAKE_ARGS="$CMAKE_ARGS" "$PY" -m pip wheel -q --no-deps -w "$work/wheel" "$src"
    mkdir -p "$WHEELS"
    mv "$work"/wheel/llama_cpp_python-*.whl "$WHEELS/"
    echo "llama-cpp-python $VERSION compiled in $(( $(date +%s) - start )) s -> $WHEELS"
fi
"$PY" -m pip install -q "$WHEELS"/llama_cpp_python-*.whl
