#!/usr/bin/env bash
# tox -e matrix: the binding core on every vLLM line this release binds, each on its own real CPU `vllm serve`.
#
#   compat/run-matrix.sh [VERSION…]     (default: every tested anchor of vllm_binding/families.py)
#
# Per line, in order: builds or reuses the line's CPU environment (compat/build-vllm-env.sh, from
# compat/vllm-<version>/env.sh), then runs the e2e tests marked binding_core on it (attach through the line's
# first attach path, chat streamed and not, typed errors, cancel aborts the vLLM request, tool calls, Responses,
# SIGTERM shutdown, a probe-failing version string refused before the model loads) through
# compat/run-vllm-tests.sh with VLLM_NNRP_RECORD_COMPAT=1: the result goes to
# compat/results/vllm-<version>-core.json and the compatibility table of docs/compatibility.md. A failing line
# does not stop the others; the exit status is 1 when any line failed. Needs `python` with attrs (the tox env has
# it) to read the anchors.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
LINES=("$@")
if [ ${#LINES[@]} -eq 0 ]; then
  mapfile -t LINES < <(PYTHONPATH="$ROOT" python -c \
    'from vllm_nnrp_plugin.vllm_binding.families import TESTED_ANCHORS; print(*TESTED_ANCHORS, sep="\n")')
fi
STATUS=0
SUMMARY=()
for version in "${LINES[@]}"; do
  started=$(date +%s)
  echo "run-matrix: vLLM $version" >&2
  line_status=0
  VLLM_NNRP_RECORD_COMPAT=1 bash "$HERE/run-vllm-tests.sh" "$version" -q -p no:cacheprovider -m binding_core \
    tests/e2e || line_status=$?
  took=$(( $(date +%s) - started ))
  if [ "$line_status" -eq 0 ]; then SUMMARY+=("$version passed (${took} s)"); else SUMMARY+=("$version FAILED (${took} s)"); STATUS=1; fi
done
LINE=$(printf '%s, ' "${SUMMARY[@]}")
echo "run-matrix: ${LINE%, }" >&2
exit "$STATUS"
