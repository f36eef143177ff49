#!/usr/bin/env bash
# Unpacks the pinned llama-cpp-python sdist into DIR/llama_cpp_python-VERSION with patches/llama-cpp/*.patch applied
# to its vendored llama.cpp, and prints that path. The Python package and llama.cpp's own tools are built from it, so
# both run the same kernels. Usage: scripts/llama-cpp-source.sh DIR
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=$(sed -n 's/.*llama-cpp-python==\([0-9.]*\).*/\1/p' "$ROOT/pyproject.toml" | head -1)
PY=${PYTHON:-python3}
DIR=$(mkdir -p "$1" && cd "$1" && pwd)
SRC="$DIR/llama_cpp_python-$VERSION"
if [ ! -f "$SRC/.patched" ]; then
    rm -rf "$SRC"
    [ -f "$DIR/llama_cpp_python-$VERSION.tar.gz" ] ||
        "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR" >&2
    tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
    for p in "$ROOT"/patches/llama-cpp/*.patch; do
        patch -s -p1 -d "$SRC" < "$p" >&2
    done
    touch "$SRC/.patched"
fi
echo "$SRC"
