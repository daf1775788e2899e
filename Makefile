# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv with the pinned stack, then train a small model with monitoring on
#   make test   create .venv with the pinned stack, then run the whole test suite
# torch is pinned in every install command (an unpinned torch pulls gigabytes of CUDA packages).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := torch==2.13.0
# Machines of this project keep a local CPU wheel of torch here; elsewhere PyPI's is used.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
EXTRAS := test,parquet,prometheus,dynamic,deepspeed,megatron,msprobe,hf,lightning,duckdb
# pyspark (Spark's analysis engine) is one 456 MB download from PyPI that a CI host once had cut off mid-way
# every time: it is installed in a step of its own, and without it the Spark tests say they were not run.
OPTIONAL_EXTRAS := spark
OPTIONAL_FAILED := make: WARNING: could not install the optional extras '$(OPTIONAL_EXTRAS)' (see above): \
  their tests will be reported as skipped, not run
# DeepSpeed builds as pure Python (no C++ ops compiled at install time).
export DS_BUILD_OPS := 0
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml setup.py trainermon/stats/_fused.c exporters/_csvtext.c Makefile | cksum | cut -d' ' -f1)

SHELL := /bin/bash
# Installs the pinned torch and the project with the extras named in `extras`: uv first (fast), pip if uv
# fails, three tries 20 s apart, because a download cut off by the network is how a clean install fails.
INSTALL = for try in 1 2 3; do \
	  $(BIN)/uv pip install -q --python $(BIN)/python $(FIND_LINKS) "$(TORCH)" -e ".[$$extras]" && break; \
	  $(BIN)/python -m pip install -q $(FIND_LINKS) "$(TORCH)" -e ".[$$extras]" && break; \
	  if [ $$try = 3 ]; then false; else echo "make: install of [$$extras] failed (try $$try of 3)"; sleep 20; fi; \
	done
#: The engine's tests, run again under each CPU capability torch dispatches to and with the native kernel
#: off: the accuracy contract must hold on every x86 host (AVX2 or AVX-512), not only this one.
ENGINE_TESTS := tests/unit/test_stats.py tests/unit/test_engine_accuracy.py tests/unit/test_fused.py

.PHONY: venv demo test test-variants lint bench clean

$(STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip uv
	extras=$(EXTRAS); $(INSTALL)
	extras=$(EXTRAS),$(OPTIONAL_EXTRAS); $(INSTALL) || echo "$(OPTIONAL_FAILED)"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/trainermon demo

test: venv test-variants
	$(BIN)/python -m pytest -q

test-variants: venv
	@# ("default" is ATen's scalar baseline; the host's own capability is the main run's, not run twice)
	@best=$$($(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	for cap in default avx2 avx512; do \
	  flag=$$cap; [ $$cap = avx512 ] && flag=avx512f; \
	  if [ $$cap = "$$best" ]; then \
	    echo "== engine tests, ATEN_CPU_CAPABILITY=$$cap: this CPU's own, run by the main run"; continue; fi; \
	  if [ $$cap != default ] && ! grep -qw $$flag /proc/cpuinfo 2>/dev/null; then \
	    echo "== engine tests, ATEN_CPU_CAPABILITY=$$cap: not run, this CPU lacks $$flag"; continue; fi; \
	  echo "== engine tests, ATEN_CPU_CAPABILITY=$$cap"; \
	  ATEN_CPU_CAPABILITY=$$cap $(BIN)/python -m pytest -q -p no:cacheprovider $(ENGINE_TESTS) || exit 1; \
	done
	@echo "== engine tests, TRAINERMON_FUSED=0 (eager path everywhere)"
	TRAINERMON_FUSED=0 $(BIN)/python -m pytest -q -p no:cacheprovider $(ENGINE_TESTS)

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: venv
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) monitor_output
