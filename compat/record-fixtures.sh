#!/usr/bin/env bash
# Record one line's vLLM HTTP outputs into compat/fixtures/vllm/<version>/ (python -m compat.record_fixtures: the
# requests of compat/fixtures/vllm/0.32.0, replayed against real `vllm serve` processes without the plugin).
#
#   compat/record-fixtures.sh 0.29.0
set -euo pipefail
VERSION=${1:?usage: record-fixtures.sh VLLM_VERSION}
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=$(bash "$HERE/build-vllm-env.sh" "$VERSION" | tail -n1)
MODEL=$(bash "$HERE/build-model.sh" "$VENV/bin/python" | tail -n1)
# shellcheck source=/dev/null
[ ! -f "$HERE/vllm-$VERSION/runtime.sh" ] || . "$HERE/vllm-$VERSION/runtime.sh"  # e.g. 0.18.1's LD_PRELOAD
cd "$(dirname "$HERE")"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$VENV/bin/python" -m compat.record_fixtures --model "$MODEL" --out "$HERE/fixtures/vllm/$VERSION"
