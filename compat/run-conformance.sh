#!/usr/bin/env bash
# tox -e conformance: the conformance suite against a real CPU `vllm serve` with this plugin.
#
#   compat/run-conformance.sh 0.26.0 [extra `vllm-nnrp conformance` args…]
#
# Builds or reuses the anchor's venv (build-vllm-env.sh) and the small model (build-model.sh), serves the model
# as `example-model` with NNRP on a free TCP port, then runs `python -m vllm_nnrp_plugin.conformance` with the
# suite's openai-compatible/1 recipes (from $NNRP_CONFORMANCE_ROOT, default ../shared/nnrp-conformance next to
# this checkout) and this project's recipes/. Exits with the runner's status: non-zero unless every selected
# case passed. The server is stopped on exit; its log is printed when something fails.
#
# The deployment under test (what its capability document advertises follows from it):
#   --enable-auto-tool-choice --tool-call-parser hermes --chat-template compat/tool_chat_template_hermes_oneshot.jinja
#       tool calls on (the suite's tool-call case uses implicit tool_choice "auto": the template's one-shot
#       example makes the 135M model call the tool; see the template's header);
#   --override-generation-config '{"temperature": 0, "max_new_tokens": 64}'
#       greedy by default, and requests without max_tokens (the suite's) stop after 64 tokens;
#   --additional-config '{"nnrp": {"fault_injection_backend_error_model": "backend-error"}}'
#       the suite's backend-error case (test-only setting, off by default).
set -euo pipefail
VERSION=${1:?usage: run-conformance.sh VLLM_VERSION [conformance args]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
SUITE=$(cd "${NNRP_CONFORMANCE_ROOT:-$ROOT/../shared/nnrp-conformance}" 2>/dev/null && pwd) || SUITE=""
if [ -z "$SUITE" ] || [ ! -f "$SUITE/schemas/api-profile-recipe.schema.json" ]; then
  echo "run-conformance: the nnrp-conformance suite is not at ${NNRP_CONFORMANCE_ROOT:-$ROOT/../shared/nnrp-conformance}" >&2
  echo "run-conformance: set NNRP_CONFORMANCE_ROOT to the suite's directory" >&2
  exit 2
fi
VENV=$(bash "$HERE/build-vllm-env.sh" "$VERSION" | tail -n1)
MODEL=$(bash "$HERE/build-model.sh" "$VENV/bin/python" | tail -n1)
PY="$VENV/bin/python"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, whichever one did the editable install
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vllm-nnrp-conformance.XXXXXX")
OUT=${CONFORMANCE_OUT:-$WORK/results}
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
HTTP_PORT=$(free_port)
NNRP="tcp://127.0.0.1:$(free_port)"
LOG="$WORK/vllm.log"

env -u VLLM_PLUGINS VLLM_PLUGINS=nnrp VLLM_NNRP_LISTEN="$NNRP" VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  "$VENV/bin/vllm" serve "$MODEL" --host 127.0.0.1 --port "$HTTP_PORT" --served-model-name example-model \
  --max-model-len 2048 --dtype bfloat16 --enforce-eager \
  --enable-auto-tool-choice --tool-call-parser hermes --chat-template "$HERE/tool_chat_template_hermes_oneshot.jinja" \
  --override-generation-config '{"temperature": 0, "max_new_tokens": 64}' \
  --additional-config '{"nnrp": {"fault_injection_backend_error_model": "backend-error"}}' \
  >"$LOG" 2>&1 &
SERVER=$!
stop() {
  kill -TERM "$SERVER" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || return 0; sleep 1; done
  kill -KILL "$SERVER" 2>/dev/null || true
}
trap stop EXIT
echo "run-conformance: vllm serve $VERSION (log $LOG), NNRP $NNRP" >&2
if ! "$PY" - "$HTTP_PORT" "$SERVER" <<'PYEOF'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("vllm serve exited during start-up")
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit("vllm serve not ready after 600 s")
PYEOF
then
  tail -n 60 "$LOG" >&2
  exit 2
fi
STATUS=0
"$PY" -m vllm_nnrp_plugin.conformance --endpoint "$NNRP" --suite "$SUITE" --recipes "$ROOT/recipes" --out "$OUT" "$@" \
  || STATUS=$?
if [ "$STATUS" -ne 0 ]; then
  echo "run-conformance: failed (status $STATUS); last lines of the vLLM log:" >&2
  tail -n 40 "$LOG" >&2
fi
exit "$STATUS"
