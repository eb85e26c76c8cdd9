# One entry point for set-up, demo, tests and benchmarks. `make demo` and `make test` do all set-up on a
# fresh machine (see README.md).
PY ?= python3
ASAN_PKG := build/asan/pkg

.PHONY: setup demo demo-allocator test test-python test-sanitize lint bench-latency bench-plan clean

# torch: keep an installed build (GPU users keep their CUDA torch); otherwise 2.13.0, which on this
# project's CPU machines is a local CPU build.
setup:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "setuptools>=64" wheel pybind11 numpy pytest hypothesis matplotlib ruff
	$(PY) -m pip install -q transformers accelerate lightning diffusers
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

demo: setup
	$(PY) examples/train_beyond_memory.py

demo-allocator: setup
	$(PY) examples/fragmentation_demo.py

test: setup test-python test-sanitize

test-python:
	$(PY) -m pytest -q tests

# The allocator's tests again, against a build with AddressSanitizer + UndefinedBehaviorSanitizer.
# Python itself is not instrumented, so libasan is preloaded and leak checking (Python's own) is off.
test-sanitize:
	VMALLOC_SANITIZE=1 VMALLOC_BUILD_DIR=build/asan/cmake $(PY) setup.py -q build_ext --build-lib $(ASAN_PKG)
	cp vmalloc/*.py $(ASAN_PKG)/vmalloc/
	cd $(ASAN_PKG) && VMALLOC_EXPECT_SANITIZED=1 ASAN_OPTIONS=detect_leaks=0 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libstdc++.so)" \
	  $(PY) -m pytest -q -p no:cacheprovider --rootdir=$(CURDIR) $(CURDIR)/tests/vmalloc

lint:
	$(PY) -m ruff check vmalloc swap bench tests examples

bench-latency: setup
	$(PY) -m bench.alloc_latency

# The planner's predicted peaks against real CPU training of three third-party models (bench/results/plan_vs_reality.*).
bench-plan: setup
	$(PY) -m bench.plan_vs_reality

clean:
	rm -rf build vmalloc/*.so
