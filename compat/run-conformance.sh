#!/usr/bin/env bash
# tox -e conformance: the conformance suite against real CPU `vllm serve` deployments with this plugin.
#
#   compat/run-conformance.sh 0.26.0 [extra `vllm-nnrp conformance` args…]
#
# Builds or reuses the anchor's venv (build-vllm-env.sh) and the small model (build-model.sh), then runs three
# deployments in sequence, each its own `vllm serve` of the model as `example-model` with NNRP on a free TCP
# port through the checkout's launcher (python -m compat.launcher, the anchor's attach path), each followed by
# `python -m vllm_nnrp_plugin.client.conformance`:
#
#   level1          generate server restricted to Level 1 (nnrp.operations ["chat.completions.create"]): the
#                   external suite's openai-compatible/1 recipes (when present) and recipes/ (the suite's mandatory
#                   unsupported-operation case expects responses.create to be refused, as by a Level-1-only
#                   adapter);
#   all-operations  the same generate server serving every operation it offers: recipes/responses and
#                   recipes/level3 only (--no-suite-recipes, or --no-suite without the suite);
#   pooling         a pooling server (--convert embed, the same model): recipes/level3 only.
#
# The external suite: the public nnrp-conformance suite (https://github.com/NagareWorks/nnrp-conformance,
# Apache-2.0) at $NNRP_CONFORMANCE_ROOT (default ../shared/nnrp-conformance next to this checkout). Present, its
# schemas validate everything and its recipes run in level1. Absent, the project's recipes still run (the runner's
# --no-suite: not validated against the suite's schemas, which the project does not copy), and the summary says the
# suite was not found;
# with NNRP_CONFORMANCE_REQUIRED=1 (what CI sets) its absence fails the run at once (status 2), before any build.
#
#   compat/run-conformance.sh --plan     says where the suite is looked for, whether it was found and what would
#                                        run, and exits (0; 2 when it is required and missing), building nothing
#
# A recipe directory without a manifest.json is skipped with a message, and so is a deployment left without
# recipes. Each deployment's capabilities.json, plan.json and results.json go to $CONFORMANCE_OUT/<deployment>
# (default a new temporary directory), its vLLM log to <deployment>.log next to them. With VLLM_NNRP_WHEEL set (CI)
# the plugin under test is that wheel, installed into the anchor's environment by build-vllm-env.sh, not the checkout. Exit status: 0 when every
# deployment run passed, else the highest status of the failed ones (the runner's: 1 a failed case, 2 the suite,
# the server or a document unusable; 2 also when vllm serve did not start, whose log end is then printed).
#
# The generate deployments (what their capability documents advertise follows from these flags):
#   --enable-auto-tool-choice --tool-call-parser hermes --chat-template compat/tool_chat_template_hermes_oneshot.jinja
#       tool calls on (the suite's tool-call case uses implicit tool_choice "auto": the template's one-shot
#       example makes the 135M model call the tool; see the template's header);
#   --override-generation-config '{"temperature": 0, "max_new_tokens": 64}'
#       greedy by default, and requests without max_tokens (the suite's) stop after 64 tokens;
#   "fault_injection_backend_error_model": "backend-error" in level1's nnrp settings
#       the suite's backend-error case (test-only setting, off by default).
set -euo pipefail
VERSION=${1:?usage: run-conformance.sh VLLM_VERSION [conformance args] | run-conformance.sh --plan}
shift
RUNNER_ARGS=("$@")
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
WANTED=${NNRP_CONFORMANCE_ROOT:-$ROOT/../shared/nnrp-conformance}
SUITE=$(cd "$WANTED" 2>/dev/null && pwd) || SUITE=""
SUITE_RECIPES=()  # level1's runner arguments for the suite's own recipes: none (they run), or --no-suite (no suite)
ONLY_OURS=(--no-suite-recipes)  # the other deployments': the project's recipes only (--no-suite without a suite)
if [ -n "$SUITE" ] && [ -f "$SUITE/schemas/api-profile-recipe.schema.json" ] \
    && [ -f "$SUITE/profiles/openai-compatible/1/manifest.json" ]; then
  SUITE_STATE="external suite at $SUITE"
  echo "run-conformance: the nnrp-conformance suite is at $SUITE: its recipes and the project's run" >&2
elif [ "${NNRP_CONFORMANCE_REQUIRED:-0}" = 1 ]; then
  echo "run-conformance: the nnrp-conformance suite is not at $WANTED, and NNRP_CONFORMANCE_REQUIRED=1 requires it." >&2
  echo "run-conformance: get it (git clone https://github.com/NagareWorks/nnrp-conformance) and set NNRP_CONFORMANCE_ROOT to its directory" >&2
  exit 2
else
  SUITE=""
  SUITE_RECIPES=(--no-suite)
  ONLY_OURS=(--no-suite)
  SUITE_STATE="external suite not found at $WANTED: the project's recipes only"
  echo "run-conformance: the external nnrp-conformance suite was not found at $WANTED: running the project's" \
    "recipes only (to run the suite's too: git clone https://github.com/NagareWorks/nnrp-conformance and set" \
    "NNRP_CONFORMANCE_ROOT to its directory)" >&2
fi
if [ "$VERSION" = "--plan" ]; then
  if [ ${#SUITE_RECIPES[@]} -eq 0 ]; then LEVEL1="the suite recipes and recipes/"; else LEVEL1="recipes/ only"; fi
  echo "run-conformance: plan: schemas from ${SUITE:-nowhere (no suite: documents not validated)}; level1: $LEVEL1; all-operations: recipes/responses and" \
    "recipes/level3; pooling: recipes/level3" >&2
  exit 0
fi
VENV=$(bash "$HERE/build-vllm-env.sh" "$VERSION" | tail -n1)
MODEL=$(bash "$HERE/build-model.sh" "$VENV/bin/python" | tail -n1)
PY="$VENV/bin/python"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vllm-nnrp-conformance.XXXXXX")
OUT=${CONFORMANCE_OUT:-$WORK/results}
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)  # absolute: the wheel's run below works from another directory
if [ -n "${VLLM_NNRP_WHEEL:-}" ]; then
  # the wheel build-vllm-env.sh installed is under test (CI): only compat/ comes from the checkout (a path holding
  # nothing else), and nothing runs from the checkout's root, so vllm_nnrp_plugin is the installed one
  mkdir -p "$WORK/path"
  ln -s "$HERE" "$WORK/path/compat"
  export PYTHONPATH="$WORK/path${PYTHONPATH:+:$PYTHONPATH}"
  cd "$WORK"
  ORIGIN=$("$PY" -c 'import vllm_nnrp_plugin; print(vllm_nnrp_plugin.__file__)')
  case "$ORIGIN" in
    "$ROOT"/*) echo "run-conformance: VLLM_NNRP_WHEEL is set but vllm_nnrp_plugin comes from the checkout ($ORIGIN)" >&2; exit 2 ;;
  esac
  echo "run-conformance: testing the installed wheel ($ORIGIN)" >&2
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, whichever one did the editable install
fi
# shellcheck source=/dev/null
[ ! -f "$HERE/vllm-$VERSION/runtime.sh" ] || . "$HERE/vllm-$VERSION/runtime.sh"  # e.g. 0.18.1's LD_PRELOAD

GENERATE=(
  --enable-auto-tool-choice --tool-call-parser hermes --chat-template "$HERE/tool_chat_template_hermes_oneshot.jinja"
  --override-generation-config '{"temperature": 0, "max_new_tokens": 64}'
)

free_port() { "$PY" -c 'from compat.launcher import free_port; print(free_port())'; }

SKIPPED=" "
# skipped NAME: NAME has no recipes to run (said, and remembered for the summary)
skipped() { echo "run-conformance: [$1] no recipes: skipped" >&2; SKIPPED+="$1 "; }

# recipe_options DIR…: "--recipes DIR" (one word a line) for each DIR with a manifest.json; says which it skips
recipe_options() {
  local dir
  for dir in "$@"; do
    if [ -f "$dir/manifest.json" ]; then
      printf '%s\n' --recipes "$dir"
    else
      echo "run-conformance: no recipes at ${dir#"$ROOT/"} (no manifest.json): skipped" >&2
    fi
  done
}

# serve_and_run NAME [vllm serve args…] -- [runner args…]: one `vllm serve` with NNRP on a free port, the
# runner against it (results in $OUT/NAME); returns the runner's status (2 when vllm serve did not start)
serve_and_run() {
  local name=$1 serve=() nnrp
  shift
  while [ "$1" != "--" ]; do serve+=("$1"); shift; done
  shift
  nnrp="tcp://127.0.0.1:$(free_port)"
  mkdir -p "$OUT/$name"
  echo "run-conformance: [$name] vllm serve $VERSION (log $OUT/$name.log), NNRP $nnrp" >&2
  "$PY" -m compat.launcher --listen "$nnrp" --log "$OUT/$name.log" "$MODEL" "${serve[@]}" \
    -- "$PY" -m vllm_nnrp_plugin.client.conformance --endpoint "$nnrp" ${SUITE:+--suite "$SUITE"} --out "$OUT/$name" \
    "$@" ${RUNNER_ARGS[@]+"${RUNNER_ARGS[@]}"}
}

level1_deployment() {
  serve_and_run level1 "${GENERATE[@]}" \
    --additional-config '{"nnrp": {"operations": ["chat.completions.create"], "fault_injection_backend_error_model": "backend-error"}}' \
    -- ${SUITE_RECIPES[@]+"${SUITE_RECIPES[@]}"} --recipes "$ROOT/recipes"
}

all_operations_deployment() {
  local recipes
  mapfile -t recipes < <(recipe_options "$ROOT/recipes/responses" "$ROOT/recipes/level3")
  if [ ${#recipes[@]} -eq 0 ]; then skipped all-operations; return 0; fi
  serve_and_run all-operations "${GENERATE[@]}" -- "${ONLY_OURS[@]}" "${recipes[@]}"
}

pooling_deployment() {
  local recipes
  mapfile -t recipes < <(recipe_options "$ROOT/recipes/level3")
  if [ ${#recipes[@]} -eq 0 ]; then skipped pooling; return 0; fi
  serve_and_run pooling --convert embed -- "${ONLY_OURS[@]}" "${recipes[@]}"
}

STATUS=0
SUMMARY=()
for deployment in level1 all_operations pooling; do
  status=0
  "${deployment}_deployment" || status=$?
  name=${deployment//_/-}
  if [ "$status" -ne 0 ]; then SUMMARY+=("$name: FAILED (status $status)")
  elif [[ $SKIPPED == *" $name "* ]]; then SUMMARY+=("$name: skipped")
  else SUMMARY+=("$name: passed"); fi
  [ "$status" -le "$STATUS" ] || STATUS=$status
done
LINE=$(printf '%s, ' "${SUMMARY[@]}")
echo "run-conformance: ${LINE%, } ($SUITE_STATE); results in $OUT" >&2
exit "$STATUS"
