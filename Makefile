# graphfp8: build, test, benchmark and profile targets. `make help` lists them.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_CPU_VERSION ?= 2.13.0
export MAX_JOBS ?= $(shell nproc)
export TORCH_CUDA_ARCH_LIST ?= 9.0
OUT ?= build/out
# The framework packages the CPU tests use; the torch pin in `setup` keeps pip off torch.
# transformers: setup.cfg's [hf] minimum (the version these tests run).
HF_PACKAGES ?= "transformers>=5.24" accelerate==1.15.0 peft==0.21.0 lightning==2.6.6

# The extension is rebuilt only when a C++/CUDA source or the build files changed.
CSRC := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h')
BUILD_FILES := setup.py setup.cfg pyproject.toml
INSTALLED := build/.installed
EXT := build/.ext-built

.PHONY: help setup install build test test-gpu gpu-check bench profile train lint format clean

help:
	@echo "setup      install torch $(TORCH_CPU_VERSION) (CPU) if torch is missing, plus nvtx/pytest/ruff/matplotlib"
	@echo "           and transformers, accelerate, peft, lightning (the framework tests), never changing torch"
	@echo "install    setup + editable install of graphfp8; rebuilds graphfp8._C when csrc/ changed"
	@echo "build      (re)build graphfp8._C in place, unconditionally"
	@echo "test       CPU test suite (what CI runs)"
	@echo "test-gpu   CUDA tests only (needs a GPU)"
	@echo "gpu-check  build + CUDA tests + benchmarks; logs and JSON under \$$OUT"
	@echo "bench      kernel benchmark (python -m benchmarks kernels)"
	@echo "train      the main job: graphfp8-train with its defaults (FP8 + graphs; tiny on CPU)"
	@echo "profile    a few graphed training steps under nsys or torch.profiler -> profiles/"
	@echo "lint       ruff check + format check"

# Each step says what it installs; pip shows the download progress of the large ones.
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || { \
		echo "== installing torch $(TORCH_CPU_VERSION), the CPU build (about 200 MB; minutes on a fresh machine)"; \
		$(PIP) install --progress-bar on torch==$(TORCH_CPU_VERSION); }
	@$(PYTHON) -c "import wheel" 2>/dev/null || { \
		echo "== installing wheel (the editable build of graphfp8 needs it with setuptools < 70.1)"; \
		$(PIP) install -q wheel; }
	@$(PYTHON) -c "import nvtx, pytest, ruff, matplotlib" 2>/dev/null || { \
		echo "== installing nvtx, pytest, ruff, matplotlib (seconds)"; \
		$(PIP) install -q nvtx pytest ruff matplotlib; }
	@$(PYTHON) -c "import transformers, accelerate, peft, lightning" 2>/dev/null || { \
		echo "== installing transformers, accelerate, peft, lightning (the framework tests; a minute)"; \
		$(PIP) install -q $(HF_PACKAGES) \
			"torch==$$($(PYTHON) -c 'import torch; print(torch.__version__.split("+")[0])')"; }

# First install (editable; builds the extension), again only when the build files change.
$(INSTALLED): $(BUILD_FILES)
	@echo "== installing graphfp8 (editable) and building graphfp8._C: the C++ CPU kernels, and the"
	@echo "   CUDA kernels when torch has CUDA and nvcc exists (about 2.5 min of CPU time for the CPU kernels)"
	@$(PIP) install --no-build-isolation --no-deps -v -e . 2>&1 | $(PYTHON) scripts/build_progress.py
	@mkdir -p build && touch $@ $(EXT)

# Rebuild when a source changed since the last build; the compiler lines show the progress.
$(EXT): $(CSRC) $(INSTALLED)
	@echo "== csrc/ changed: rebuilding graphfp8._C"
	$(PYTHON) setup.py build_ext --inplace
	@touch $@

install: setup $(INSTALLED) $(EXT)

build:
	$(PYTHON) setup.py build_ext --inplace
	@mkdir -p build && touch $(EXT)

test: install
	$(PYTHON) -m pytest -q -m "not cuda" tests

test-gpu:
	$(PYTHON) -m pytest -q -m cuda tests

gpu-check:
	OUT=$(OUT) bash scripts/gpu_check.sh

bench: install
	$(PYTHON) -m benchmarks kernels

train: install
	$(PYTHON) -m graphfp8.training $(TRAIN_ARGS)

profile: install
	$(PYTHON) -m graphfp8.training.step_profile $(PROFILE_ARGS)

lint:
	$(PYTHON) -m ruff check graphfp8 benchmarks tests scripts setup.py
	$(PYTHON) -m ruff format --check graphfp8 benchmarks tests scripts setup.py

format:
	$(PYTHON) -m ruff format graphfp8 benchmarks tests scripts setup.py
	$(PYTHON) -m ruff check --fix graphfp8 benchmarks tests scripts setup.py

clean:
	rm -rf build dist *.egg-info graphfp8/_C*.so .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
