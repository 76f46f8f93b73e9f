#!/usr/bin/env bash
# The main job, end to end on this machine: build/reuse a CPU vLLM and the small model, start
# `VLLM_PLUGINS=nnrp vllm serve` with the plugin (plus --middleware before 0.26), stream one answer over
# NNRP with `vllm-nnrp chat`, stop.
#
#   compat/serve-and-chat.sh 0.26.0 "Say hello."
set -euo pipefail
VERSION=${1:?usage: serve-and-chat.sh VLLM_VERSION MESSAGE}
MESSAGE=${2:-Say hello.}
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=$(bash "$HERE/build-vllm-env.sh" "$VERSION" | tail -n1)
MODEL=$(bash "$HERE/build-model.sh" "$VENV/bin/python" | tail -n1)
# shellcheck source=/dev/null
[ ! -f "$HERE/vllm-$VERSION/runtime.sh" ] || . "$HERE/vllm-$VERSION/runtime.sh"  # e.g. 0.18.1's LD_PRELOAD
ATTACH=()  # 0.26: the endpoint plugin (VLLM_PLUGINS=nnrp); 0.18/0.22: vLLM's --middleware flag
case "$VERSION" in 0.26.*) ;; *) ATTACH=(--middleware vllm_nnrp_plugin.vllm_binding.middleware.NNRPMiddleware) ;; esac
LISTEN=${VLLM_NNRP_LISTEN:-tcp://127.0.0.1:9400}
LOG=$(mktemp -t vllm-nnrp-demo.XXXXXX.log)

echo "starting vllm serve (log: $LOG) ..." >&2
VLLM_PLUGINS=nnrp VLLM_NNRP_LISTEN="$LISTEN" VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  "$VENV/bin/vllm" serve "$MODEL" --host 127.0.0.1 --port "${VLLM_HTTP_PORT:-8000}" \
  --served-model-name example-model --max-model-len 2048 --dtype bfloat16 --enforce-eager "${ATTACH[@]}" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until grep -q "NNRP listening on" "$LOG"; do
  kill -0 $SERVER 2>/dev/null || { tail -n 40 "$LOG" >&2; exit 1; }
  sleep 1
done
grep -o "NNRP listening on.*" "$LOG" >&2
if "$VENV/bin/vllm-nnrp" chat --endpoint "${LISTEN%%,*}" --max-tokens 64 --temperature 0 "$MESSAGE"; then
  rm -f "$LOG"
else
  echo "vllm-nnrp chat failed; vLLM's log: $LOG" >&2
  exit 1
fi
