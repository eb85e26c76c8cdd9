# One entry point for set-up, demo, tests and benchmarks. `make demo` and `make test` do all set-up on a
# fresh machine (see README.md), in the project's venv.
#
# Note [The project venv]
# Set-up installs into .venv, which it makes with `python3 -m venv`, never into the system's Python (Debian 12
# and Ubuntu 24.04 refuse that: externally-managed-environment). When the system's python3 already imports
# torch, the venv also sees the system's packages (--system-site-packages): a GPU user keeps the CUDA torch
# they have, and a machine with torch preinstalled (CI's) downloads nothing twice. Otherwise the venv is clean
# and set-up installs $(TORCH), which on this project's machines pip resolves to their local CPU build;
# elsewhere pass TORCH='torch==2.13.0 --index-url <a CPU wheel index>' for a CPU-only one. PY=<python> runs
# everything with that interpreter instead (set-up then installs into it). The gpu targets run on offline
# machines whose python3 carries their CUDA torch: they use the venv when there is one, else python3.
VENV ?= .venv
SYSTEM_PY ?= python3
TORCH ?= torch==2.13.0
ifeq ($(origin PY),undefined)
PY := $(abspath $(VENV))/bin/python
VENV_PY := $(PY)
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
else
GPU_PY := $(PY)
endif
ASAN_PKG := build/asan/pkg
# Every install goes through the pins (Note [Pinned set-up] in constraints.txt).
PIP_INSTALL = $(PY) -m pip install -q -c $(CURDIR)/constraints.txt

.PHONY: setup setup-test demo demo-allocator test test-python test-sanitize lint bench-latency bench-plan bench-clock clean fakecuda \
  package-check

# Note [A lean set-up]
# `setup` installs what the packages and the demo need: torch, numpy, ninja and the build requirements
# (pyproject.toml; the editable install builds without isolation), and the CUDA header wheel only where no
# cuda.h is found (a toolkit's, or a CUDA torch's wheels). `setup-test` adds the test tools (pytest-xdist runs
# them in parallel: Note [Tests in parallel]) and the packages the integration tests train with (pyproject.toml's
# `test` and `integrations` extras, listed here because the editable install takes no dependencies): about
# 290 MiB that a user running the demo does not need
# (docs/development.md says what each weighs and how that was measured).
setup: $(VENV_PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP_INSTALL) $(TORCH)
	$(PIP_INSTALL) "setuptools>=64" wheel pybind11 cmake ninja numpy
	@$(PY) vmalloc/cuda_paths.py cuda.h >/dev/null || $(PIP_INSTALL) "nvidia-cuda-runtime>=13,<14"
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

setup-test: setup
	$(PIP_INSTALL) pytest pytest-xdist hypothesis matplotlib ruff
	$(PIP_INSTALL) cuda-python transformers accelerate lightning diffusers peft

$(abspath $(VENV))/bin/python:
	$(SYSTEM_PY) -m venv $$($(SYSTEM_PY) -c "import torch" 2>/dev/null && echo --system-site-packages) $(VENV)

# The sdist and the wheel pip builds from it, installed into a fresh venv as users do (.ci/check_package.sh; CI runs it).
package-check:
	bash .ci/check_package.sh

demo: setup
	$(PY) examples/train_beyond_memory.py

demo-allocator: setup
	$(PY) examples/fragmentation_demo.py

test: setup-test test-python test-sanitize

# Note [Tests in parallel]
# The suite runs in PYTEST_WORKERS processes (pytest-xdist; auto: one per core, CI's machine has 2), a whole
# test file at a time, in its order (--dist loadfile): a file's tests share its module-level models and fixtures
# as in one process, built once, and each file goes to whichever worker is free. Tests are parallel-safe as
# processes: what they measure is their own process's (live storages, RSS), gloo ranks meet through files in
# their own tmp_path, the emulated driver is built before pytest starts (fakecuda), and build/trace-cache is
# written by rename (bench/traces.py). PYTEST_WORKERS=0 runs everything in this one process.
# The default is 0, for now: the first whole-suite run on 2 workers (a fresh clone, 2026-11-28) had 9 failures and
# 2 errors where serial runs pass, nearly all InfeasibleBudget with megabytes "not swappable" — tests that measure
# the CPU budget (every live storage in the process) ran after other files than they do in one process. Which
# leftovers those were is not known: the files' cached reference runs keep NumPy copies, not tensors (0 bytes of
# CPU storage alive after tests/plan/test_plan.py, then after swap/test_training.py, run in that order in one
# process, 2026-11-28). Parallel runs come back as the default once
# `make test PYTEST_WORKERS=2` passes twice on a fresh clone. Meanwhile CI keeps its second core busy with the
# ASan half (Note [CI in three lanes] in .ci/run), and the suite's garbage collections skip what collection
# loaded (Note [Frozen before the tests] in tests/conftest.py).
PYTEST_WORKERS ?= 0
PYTEST_PARALLEL = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)
# What test-python runs: the whole suite, or a part of it (CI runs it as two parts, Note [CI in three lanes]).
PYTEST_SELECT ?= tests

test-python: fakecuda
	$(PY) -m pytest -q --durations=25 $(PYTEST_PARALLEL) $(PYTEST_SELECT)

# The allocator's tests again, against a build with AddressSanitizer + UndefinedBehaviorSanitizer.
# Python itself is not instrumented, so libasan is preloaded and leak checking (Python's own) is off.
# The cuda backend's tests (tests/vmalloc/test_cuda_fake.py and the backend-parametrized ones) run here too,
# in child processes on the emulated driver (Note [cuda tests in a child process], tests/vmalloc/backends.py).
test-sanitize: fakecuda
	VMALLOC_SANITIZE=1 VMALLOC_BUILD_DIR=build/asan/cmake $(PY) setup.py -q build_ext --build-lib $(ASAN_PKG)
	cp vmalloc/*.py $(ASAN_PKG)/vmalloc/
	cd $(ASAN_PKG) && VMALLOC_EXPECT_SANITIZED=1 ASAN_OPTIONS=detect_leaks=0 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libstdc++.so)" \
	  $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_PARALLEL) --rootdir=$(CURDIR) $(CURDIR)/tests/vmalloc

# The emulated CUDA driver the cuda backend's tests run against (tests/fakecuda/README.md): test
# infrastructure, never a backend. FAKECUDA_SANITIZE=1 builds it with ASan + UBSan into build/fakecuda-asan.
FAKECUDA_SRC := $(wildcard tests/fakecuda/src/*.cpp)
FAKECUDA_OUT := build/fakecuda$(if $(filter 1,$(FAKECUDA_SANITIZE)),-asan)
FAKECUDA_OBJ := $(patsubst tests/fakecuda/src/%.cpp,$(FAKECUDA_OUT)/obj/%.o,$(FAKECUDA_SRC))
FAKECUDA_CXXFLAGS := -std=c++17 -O1 -g -fPIC -Wall -Wextra -MMD -MP \
  $(if $(filter 1,$(FAKECUDA_SANITIZE)),-fsanitize=address -fsanitize=undefined -fno-omit-frame-pointer)
# cuda.h as setup.py finds it (Note [Finding the CUDA headers], vmalloc/cuda_paths.py): CUDA_HOME, CUDA_PATH,
# /usr/local/cuda, then the nvidia/cu13 (CUDA 13) or nvidia/cuda_runtime (CUDA 12) wheel layouts.
# Asked when a compile runs (=, not :=): set-up may have just made the venv or installed the header wheel.
ifndef CUDA_INCLUDE
CUDA_INCLUDE = $(shell $(PY) vmalloc/cuda_paths.py cuda.h 2>/dev/null)
endif

fakecuda: $(FAKECUDA_OUT)/libcuda.so.1

$(FAKECUDA_OUT)/libcuda.so.1: $(FAKECUDA_OBJ) tests/fakecuda/src/exports.map
	$(CXX) -shared -Wl,-soname,libcuda.so.1 -Wl,--version-script=tests/fakecuda/src/exports.map \
	  $(filter -fsanitize%,$(FAKECUDA_CXXFLAGS)) -o $@ $(FAKECUDA_OBJ) -lpthread

$(FAKECUDA_OUT)/obj/%.o: tests/fakecuda/src/%.cpp
	@test -n "$(CUDA_INCLUDE)" || { echo "fakecuda: cuda.h not found: set CUDA_HOME, or pip install nvidia-cuda-runtime (cu13: the nvidia/cu13 layout)"; exit 1; }
	@mkdir -p $(@D)
	$(CXX) $(FAKECUDA_CXXFLAGS) -isystem $(CUDA_INCLUDE) -c $< -o $@

-include $(FAKECUDA_OBJ:.o=.d)

lint: $(VENV_PY)
	@$(PY) -m ruff --version >/dev/null 2>&1 || $(PIP_INSTALL) ruff
	$(PY) -m ruff check vmalloc swap bench tests examples

bench-latency: setup
	$(PY) -m bench.alloc_latency

# The planner's predicted peaks against real CPU training of three third-party models (bench/results/plan_vs_reality.*).
bench-plan: setup-test
	$(PY) -m bench.plan_vs_reality

# The planner's step times against measured ones on this machine's CPU, calibrated first (plan_vs_reality_time.*).
bench-clock: setup-test
	$(PY) -m bench.cpu_profile
	$(PY) -m bench.plan_vs_reality_time

clean:
	rm -rf build vmalloc/*.so

# --- GPU: `make gpu` proves the project on a machine with an NVIDIA GPU and a CUDA build of torch (offline).
# gpu-test (tests/gpu, <= 8 min on an H100) then gpu-bench (bench/gpu, ~11 min, results under
# bench/results/gpu/<device>/). GPU_OUT=DIR writes the logs there as they run, and a tarball of the results (the
# device tool's $OUT); GPU_BENCH_PARTS picks benchmark parts (vmm pinned replay training), so the bench can
# be split over two commands of at most 10 minutes. Without a GPU every gpu target stops at once, saying so.
GPU_OUT ?=
GPU_BENCH_PARTS ?= vmm pinned replay training
GPU_LOGS := build/gpu-logs
GPU_LOG_DIR = $(or $(GPU_OUT),$(GPU_LOGS))

.PHONY: gpu gpu-quick gpu-check gpu-build gpu-test gpu-sanitize gpu-bench gpu-lease gpu-lease-smoke
gpu-quick gpu-check gpu-build gpu-test gpu-sanitize gpu-bench gpu-lease gpu-lease-smoke: SHELL := /bin/bash
gpu gpu-quick gpu-check gpu-build gpu-test gpu-sanitize gpu-bench gpu-lease gpu-lease-smoke: PY := $(GPU_PY)

# The first and only command to give a newly lent GPU machine, before anything else (issue 38): at most 9.5
# minutes on an H100 or H200, highest value first, each phase under its own time box, results written to GPU_OUT
# after every phase (at most 8 files: lease.log, summary.md, lease.json, failures.xml, model_state_gpu.json,
# alloc_ratio.json, results.tar.gz). Note [One lease, phase by phase] in bench/gpu/lease.py. Run it with the
# device tool's timeout_s=570; `make gpu`, gpu-test and gpu-bench are for longer leases.
gpu-lease:
	@test -n "$(GPU_OUT)" || { echo "gpu-lease: give the folder that comes back: make gpu-lease GPU_OUT=DIR"; exit 2; }
	PYTHONUNBUFFERED=1 $(PY) -m bench.gpu.lease --out $(GPU_OUT)

# The same phases on tiny sizes on the CPU (no GPU): what needs CUDA runs its CPU stand-in or says "skipped: no
# CUDA"; the time boxes, files and summary run for real (tests/gpu_lease/test_lease_smoke.py runs it in CI).
gpu-lease-smoke:
	@test -n "$(GPU_OUT)" || { echo "gpu-lease-smoke: give an output folder: make gpu-lease-smoke GPU_OUT=DIR"; exit 2; }
	PYTHONUNBUFFERED=1 $(PY) -m bench.gpu.lease --smoke --out $(GPU_OUT)

gpu: gpu-test gpu-bench

# About three minutes on an H100 or H200, at most five: the core built, then bench/gpu/quick.py (at most
# four minutes), whose checks (the adapter built and installed with no fallback, rebuilds bitwise, the ResNet
# swapped on vmalloc, host waits per planned iteration, profiled against unhooked step time, region events
# alive, vmalloc's maps and event waits per steady iteration, copy bandwidth against pinned peak) each run in
# a process of their own under a time limit, so a hang costs its check, not the lease. Each prints PASS or
# FAIL with its figure; logs go to GPU_LOG_DIR as they run, the summary to
# bench/results/gpu/<device>/quick.json (and GPU_LOG_DIR). The first command to give a newly lent GPU: what
# it finds decides what `make gpu` is worth running.
gpu-quick: gpu-check
	@mkdir -p $(GPU_LOG_DIR)
	$(PY) setup.py -q build_ext --inplace
	set -o pipefail; PYTHONUNBUFFERED=1 $(PY) -m bench.gpu.quick --out $(GPU_LOG_DIR) 2>&1 \
	  | tee $(GPU_LOG_DIR)/gpu-quick.log

gpu-check:
	@$(PY) -m bench.gpu.run --check

# The core in place, then the torch adapter for the installed torch (cached per torch version).
gpu-build: gpu-check
	$(PY) setup.py -q build_ext --inplace
	$(PY) -m vmalloc.torch_adapter || echo "gpu-build: no torch adapter (see above): vmalloc.allocator() will refuse, saying why; tests/gpu reports it"

# Logs are written with tee straight into GPU_LOG_DIR (GPU_OUT when given): a command the device tool stops
# at its time limit still returns the log up to that point.
gpu-test: gpu-build
	@mkdir -p $(GPU_LOG_DIR)
	set -o pipefail; PYTHONUNBUFFERED=1 $(PY) -m pytest -q -rs --durations=15 tests/gpu \
	  --junitxml=$(GPU_LOG_DIR)/gpu-test.xml 2>&1 | tee $(GPU_LOG_DIR)/gpu-test.log

# The cuda-backend allocator tests under compute-sanitizer's memcheck (also part of tests/gpu).
gpu-sanitize: gpu-build
	@mkdir -p $(GPU_LOG_DIR)
	set -o pipefail; PYTHONUNBUFFERED=1 $(PY) -m pytest -q -rs tests/gpu/test_sanitizer.py 2>&1 \
	  | tee $(GPU_LOG_DIR)/gpu-sanitize.log

gpu-bench: gpu-build
	@mkdir -p $(GPU_LOG_DIR)
	set -o pipefail; PYTHONUNBUFFERED=1 $(PY) -m bench.gpu.run --parts $(GPU_BENCH_PARTS) 2>&1 \
	  | tee $(GPU_LOG_DIR)/gpu-bench-$(word 1,$(GPU_BENCH_PARTS)).log; rc=$$?; \
	  if [ -n "$(GPU_OUT)" ]; then tar czf $(GPU_OUT)/gpu-results-$(word 1,$(GPU_BENCH_PARTS)).tar.gz bench/results/gpu; fi; \
	  exit $$rc
