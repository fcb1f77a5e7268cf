#!/usr/bin/env bash
# Start an OpenAI-compatible `vllm serve` with ddtree speculative decoding, query it with
# examples/openai_client.py (chat, completion, streamed chat, /metrics), then stop the server.
#
#   bash examples/serve_and_query.sh [openai_client.py options, e.g. --max-tokens 32 --json out.json]
#
# Environment: PORT (8000), HOST (127.0.0.1), TREE_BUDGET (auto), TARGET, DRAFTER, PYTHON, VLLM,
# SERVE_ARGS (extra `vllm serve` options), HEALTH_TIMEOUT (seconds to wait for /health, 900),
# LOG (server log file; default: a temporary file, printed on failure). See examples/_env.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-8000}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-900}"
LOG="${LOG:-$(mktemp -t vllm-serve.XXXXXX.log)}"

echo "serving $TARGET with --speculative-config '$SPEC_CONFIG' on $HOST:$PORT (log: $LOG)"
# shellcheck disable=SC2086  # $VLLM and $SERVE_ARGS are word lists
$VLLM serve "$TARGET" --speculative-config "$SPEC_CONFIG" --dtype float32 --enforce-eager \
  --max-model-len 1024 --host "$HOST" --port "$PORT" ${SERVE_ARGS:-} >"$LOG" 2>&1 &
SERVER=$!
stop() { kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null || true; }
trap stop EXIT
trap 'exit 143' TERM INT

health() { "$PYTHON" -c "import urllib.request as u; u.urlopen('http://$HOST:$PORT/health', timeout=5)" 2>/dev/null; }
start=$SECONDS
until health; do
  if ! kill -0 "$SERVER" 2>/dev/null; then echo "vllm serve exited; its log:" >&2; tail -n 60 "$LOG" >&2; exit 1; fi
  if (( SECONDS - start > HEALTH_TIMEOUT )); then echo "no /health after ${HEALTH_TIMEOUT}s; log:" >&2; tail -n 60 "$LOG" >&2; exit 1; fi
  sleep 2
done
echo "server healthy after $((SECONDS - start))s"

"$PYTHON" "$ROOT/examples/openai_client.py" --base-url "http://$HOST:$PORT/v1" "$@"
