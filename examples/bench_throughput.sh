#!/usr/bin/env bash
# Offline throughput with ddtree speculative decoding: `vllm bench throughput` on random prompts
# (no dataset download: --dataset-name random makes token-id prompts from the target's vocabulary).
#
#   bash examples/bench_throughput.sh [more `vllm bench throughput` options, e.g. --output-json r.json]
#
# Environment: NUM_PROMPTS (8), INPUT_LEN (64), OUTPUT_LEN (32), TREE_BUDGET (auto), TARGET,
# DRAFTER, PYTHON, VLLM (see examples/_env.sh). Drop --speculative-config for the baseline.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

# shellcheck disable=SC2086  # $VLLM is a word list
exec $VLLM bench throughput --model "$TARGET" --speculative-config "$SPEC_CONFIG" \
  --dtype float32 --enforce-eager --max-model-len 1024 \
  --dataset-name random --random-input-len "${INPUT_LEN:-64}" --random-output-len "${OUTPUT_LEN:-32}" \
  --num-prompts "${NUM_PROMPTS:-8}" "$@"
