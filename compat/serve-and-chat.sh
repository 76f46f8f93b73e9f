#!/usr/bin/env bash
# The main job, end to end on this machine: build/reuse a CPU vLLM and the small model, serve it with the plugin
# through the checkout's launcher (python -m compat.launcher: VLLM_PLUGINS=nnrp, plus --middleware on lines
# without the endpoint plugin hook), stream one answer over NNRP with `vllm-nnrp chat`, stop.
#
#   compat/serve-and-chat.sh 0.26.0 "Say hello."
set -euo pipefail
VERSION=${1:?usage: serve-and-chat.sh VLLM_VERSION MESSAGE}
MESSAGE=${2:-Say hello.}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
VENV=$(bash "$HERE/build-vllm-env.sh" "$VERSION" | tail -n1)
MODEL=$(bash "$HERE/build-model.sh" "$VENV/bin/python" | tail -n1)
# shellcheck source=/dev/null
[ ! -f "$HERE/vllm-$VERSION/runtime.sh" ] || . "$HERE/vllm-$VERSION/runtime.sh"  # e.g. 0.18.1's LD_PRELOAD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, whichever one did the editable install
LISTEN=${VLLM_NNRP_LISTEN:-tcp://127.0.0.1:9400}
LOG=$(mktemp -t vllm-nnrp-demo.XXXXXX.log)

if "$VENV/bin/python" -m compat.launcher --port "${VLLM_HTTP_PORT:-8000}" --listen "$LISTEN" --log "$LOG" "$MODEL" \
  -- "$VENV/bin/vllm-nnrp" chat --endpoint "${LISTEN%%,*}" --max-tokens 64 --temperature 0 "$MESSAGE"; then
  rm -f "$LOG"
else
  echo "vllm-nnrp chat failed; vLLM's log: $LOG" >&2
  exit 1
fi
