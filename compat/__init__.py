"""The checkout's vLLM side: per-anchor environments and model (shell scripts), the ``vllm serve`` launcher
(:mod:`compat.launcher`), the compatibility-table generator and recorded vLLM outputs. Not installed with the
package; importable from a checkout."""
