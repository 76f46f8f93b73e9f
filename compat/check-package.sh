#!/usr/bin/env bash
# Build the sdist and the wheel of this checkout and check them, as a user's `pip install` and vLLM would see them.
#
#   compat/check-package.sh [OUT_DIR]
#
# 1. `python -m build` (sdist, then the wheel built from that sdist) into OUT_DIR (default dist/ of the checkout;
#    earlier vllm_nnrp_plugin-* files there are removed first);
# 2. `twine check --strict` on both;
# 3. compat/check_package.py: the wheel's entry points (vllm.general_plugins and vllm.endpoint_plugins `nnrp`,
#    console script `vllm-nnrp`) point at modules and names the wheel holds, every module of the checkout is in the
#    wheel and the sdist, the version is pyproject.toml's, and aioquic is only an extra.
#
# build and twine run from their own venv under $VLLM_NNRP_CACHE (default ~/.cache/vllm-nnrp-plugin/tools/package),
# made with $PYTHON (default python3) on first use. Progress goes to stderr. Output contract: on success the last
# line of stdout is the absolute path of the wheel (exit 0); on any failure the exit status is non-zero and stdout
# has no path.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
OUT=${1:-$ROOT/dist}
CACHE=${VLLM_NNRP_CACHE:-$HOME/.cache/vllm-nnrp-plugin}
TOOLS="$CACHE/tools/package"
PY=${PYTHON:-python3}

if [ ! -x "$TOOLS/bin/python" ] || ! "$TOOLS/bin/python" -c 'import build, twine' 2>/dev/null; then
  echo "check-package: making the build tools' venv in $TOOLS" >&2
  "$PY" -m venv --clear "$TOOLS" >&2
  "$TOOLS/bin/python" -m pip install -q "build>=1.2" "twine>=5" >&2
fi

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/vllm_nnrp_plugin-*.whl "$OUT"/vllm_nnrp_plugin-*.tar.gz
echo "check-package: building the sdist and the wheel into $OUT" >&2
"$TOOLS/bin/python" -m build --outdir "$OUT" "$ROOT" >&2
shopt -s nullglob
WHEELS=("$OUT"/vllm_nnrp_plugin-*.whl)
SDISTS=("$OUT"/vllm_nnrp_plugin-*.tar.gz)
if [ ${#WHEELS[@]} -ne 1 ] || [ ${#SDISTS[@]} -ne 1 ]; then
  echo "check-package: expected one wheel and one sdist in $OUT, found ${#WHEELS[@]} and ${#SDISTS[@]}" >&2
  exit 1
fi
echo "check-package: twine check" >&2
"$TOOLS/bin/python" -m twine check --strict "${WHEELS[0]}" "${SDISTS[0]}" >&2
echo "check-package: entry points, modules and metadata" >&2
"$TOOLS/bin/python" "$HERE/check_package.py" "${WHEELS[0]}" "${SDISTS[0]}"
echo "check-package: ok: $(basename "${SDISTS[0]}"), $(basename "${WHEELS[0]}")" >&2
echo "${WHEELS[0]}"
