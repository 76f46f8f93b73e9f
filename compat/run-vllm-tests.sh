#!/usr/bin/env bash
# Run pytest inside a real CPU vLLM environment for one anchor (used by the tox env vllm-<version>).
#
#   compat/run-vllm-tests.sh 0.26.0 [pytest args…]
#
# Builds or reuses the anchor's venv (build-vllm-env.sh, with the extras named in compat/vllm-<version>/test-extras)
# and the small model (build-model.sh), applies the
# anchor's runtime settings (compat/vllm-<version>/runtime.sh, if any), then runs the given tests with
# VLLM_NNRP_TEST_MODEL pointing at the model directory: against the checkout, or with VLLM_NNRP_WHEEL=<wheel>
# against that wheel installed (the tests themselves from the checkout). With VLLM_NNRP_RECORD_COMPAT=1 the outcome is recorded
# and the compatibility table of docs/compatibility.md is regenerated from the recorded files
# (compat/compat_table.py): a run of
# the whole suite (`VLLM_NNRP_RECORD_COMPAT=1 python3 -m tox -e vllm-0.26.0`, or `... -e vllm-0.22.1 -- tests`) in
# compat/results/vllm-<version>.json, a run of the binding core (`-m binding_core`, as the matrix and the trimmed
# anchors run it) in compat/results/vllm-<version>-core.json; other runs leave the checkout untouched.
set -euo pipefail
VERSION=${1:?usage: run-vllm-tests.sh VLLM_VERSION [pytest args]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=$(bash "$HERE/build-vllm-env.sh" "$VERSION" | tail -n1)
# shellcheck source=/dev/null
[ ! -f "$HERE/vllm-$VERSION/runtime.sh" ] || . "$HERE/vllm-$VERSION/runtime.sh"  # e.g. 0.18.1's LD_PRELOAD
export VLLM_NNRP_TEST_MODEL
VLLM_NNRP_TEST_MODEL=$(bash "$HERE/build-model.sh" "$VENV/bin/python" | tail -n1)
ROOT=$(dirname "$HERE")
cd "$ROOT"
if [ -n "${VLLM_NNRP_WHEEL:-}" ]; then
  # the installed wheel is under test: pytest appends the checkout to sys.path (after site-packages), so the
  # tests, compat/ and bench/ come from the checkout and vllm_nnrp_plugin from the wheel (tests/e2e/conftest.py
  # checks where it came from)
  export PYTEST_ADDOPTS="--import-mode=append${PYTEST_ADDOPTS:+ $PYTEST_ADDOPTS}"
  SAFE_PATH=-P  # python -P: the working directory is not put first on sys.path either
  # bench/ and compat/ importable in every process the tests start (a benchmark's vllm serve loads
  # bench.drain.DrainMiddleware), from a directory that holds nothing else
  SHIM=$(mktemp -d -t vllm-nnrp-path.XXXXXX)
  ln -s "$ROOT/bench" "$SHIM/bench"
  ln -s "$ROOT/compat" "$SHIM/compat"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, whichever one did the editable install
fi
# a grafted environment (RECIPE=graft: vLLM 0.33+, Triton interpreted, each decode step 0.2-0.5 s) runs the part of
# the binding core listed in compat/grafted-core.txt (a pytest -k expression: the start-up line, chat streamed
# against HTTP, cancel, API keys, SIGTERM, the lanes' start-up log and their parity with vLLM's own streams on the
# plain, tool-call and reasoning servers, Responses tool calls and cancel) when asked for the binding core
ARGS=("$@")
if grep -q '^RECIPE=graft' "$HERE/vllm-$VERSION/env.sh" && [[ " $* " == *" -m binding_core "* ]]; then
  echo "run-vllm-tests: vLLM $VERSION is a grafted environment: the binding core's part in compat/grafted-core.txt" >&2
  ARGS+=(-k "$(cat "$HERE/grafted-core.txt")")
  GRAFTED=1
fi
REPORT=$(mktemp -t "vllm-$VERSION-junit.XXXXXX.xml")
status=0
"$VENV/bin/python" ${SAFE_PATH:-} -m pytest --junitxml="$REPORT" "${ARGS[@]}" || status=$?
if [ "${VLLM_NNRP_RECORD_COMPAT:-0}" = 1 ]; then
  case " $* " in
    *" -m binding_core "*) SCOPE="binding core${GRAFTED:+, grafted part}" ;;
    *) SCOPE="whole suite" ;;
  esac
  env -u LD_PRELOAD "$VENV/bin/python" "$HERE/compat_table.py" record "$VERSION" "$REPORT" "$SCOPE" >&2 || true
fi
rm -f "$REPORT"
exit $status
