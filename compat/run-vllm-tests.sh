#!/usr/bin/env bash
# Run pytest inside a real CPU vLLM environment for one anchor (used by the tox env vllm-<version>).
#
#   compat/run-vllm-tests.sh 0.26.0 [pytest args…]
#
# Builds or reuses the anchor's venv (build-vllm-env.sh) and the small model (build-model.sh), then runs
# the given tests with VLLM_NNRP_TEST_MODEL pointing at the model directory.
set -euo pipefail
VERSION=${1:?usage: run-vllm-tests.sh VLLM_VERSION [pytest args]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=$(bash "$HERE/build-vllm-env.sh" "$VERSION" | tail -n1)
export VLLM_NNRP_TEST_MODEL
VLLM_NNRP_TEST_MODEL=$(bash "$HERE/build-model.sh" "$VENV/bin/python" | tail -n1)
cd "$(dirname "$HERE")"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, whichever one did the editable install
exec "$VENV/bin/python" -m pytest "$@"
