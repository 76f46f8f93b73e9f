#!/usr/bin/env bash
# tox -e conformance: the conformance suite against a real CPU `vllm serve` with this plugin.
#
#   compat/run-conformance.sh 0.26.0 [extra `vllm-nnrp conformance` args…]
#
# Builds or reuses the anchor's venv (build-vllm-env.sh) and the small model (build-model.sh), serves the model
# as `example-model` with NNRP on a free TCP port through the checkout's launcher (python -m compat.launcher,
# the anchor's attach path), then runs `python -m vllm_nnrp_plugin.conformance` with the suite's
# openai-compatible/1 recipes (from $NNRP_CONFORMANCE_ROOT, default ../shared/nnrp-conformance next to this
# checkout) and this project's recipes/. Exits with the runner's status: non-zero unless every selected case
# passed (2 when vllm serve did not start). The server is stopped on exit; the end of its log is printed when
# something fails.
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
free_port() { "$PY" -c 'from compat.launcher import free_port; print(free_port())'; }
NNRP="tcp://127.0.0.1:$(free_port)"
# shellcheck source=/dev/null
[ ! -f "$HERE/vllm-$VERSION/runtime.sh" ] || . "$HERE/vllm-$VERSION/runtime.sh"  # e.g. 0.18.1's LD_PRELOAD

echo "run-conformance: vllm serve $VERSION (log $WORK/vllm.log), NNRP $NNRP" >&2
exec "$PY" -m compat.launcher --listen "$NNRP" --log "$WORK/vllm.log" "$MODEL" \
  --enable-auto-tool-choice --tool-call-parser hermes --chat-template "$HERE/tool_chat_template_hermes_oneshot.jinja" \
  --override-generation-config '{"temperature": 0, "max_new_tokens": 64}' \
  --additional-config '{"nnrp": {"fault_injection_backend_error_model": "backend-error"}}' \
  -- "$PY" -m vllm_nnrp_plugin.conformance --endpoint "$NNRP" --suite "$SUITE" --recipes "$ROOT/recipes" --out "$OUT" "$@"
