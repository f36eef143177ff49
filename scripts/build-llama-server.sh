#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-server, llama-bench, llama-batched-bench, llama-speculative-simple,
# llama-quantize) from the llama.cpp vendored in the pinned llama-cpp-python sdist, patched as ours
# (patches/llama-cpp/), so the anchors run the same kernels as our backend.
# Not part of CI. Usage: scripts/build-llama-server.sh [BUILD_DIR]   (default: .llama-cpp-tools)
set -euo pipefail
VERSION=$(sed -n 's/.*llama-cpp-python==\([0-9.]*\).*/\1/p' pyproject.toml | head -1)
OUT=${1:-.llama-cpp-tools}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# the same patched sources the Python package is compiled from (scripts/build-llama-cpp-python.sh)
if [ ! -d "$OUT/src" ]; then
    sdist=$(PYTHON=${PYTHON:-.venv/bin/python} scripts/llama-cpp-source.sh "$OUT/sdist")
    mv "$sdist/vendor/llama.cpp" "$OUT/src"
fi
start=$(date +%s)
cmake -S "$OUT/src" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF > "$OUT/cmake.log"
cmake --build "$OUT/build" -j "$(nproc)" --target llama-server llama-bench llama-batched-bench llama-speculative-simple llama-quantize \
    > "$OUT/build.log"
echo "llama.cpp $VERSION tools built in $(( $(date +%s) - start )) s: $OUT/build/bin"
ls "$OUT/build/bin"
