"""The one base of every start-up refusal: NNRP is enabled but cannot serve as configured.

Raised while ``vllm serve`` starts (configuration, addresses, binding, vLLM line), never while it serves; the
message names the cause and the fix, and raising it stops ``vllm serve`` instead of leaving a healthy-looking
server without a listener. Errors of one operation are :class:`vllm_nnrp_plugin.profile.errors.ProfileError`
(sent to the client as ``response.error``), never this.
"""

from __future__ import annotations


class NNRPStartupError(RuntimeError):
    """NNRP is enabled but cannot work in this ``vllm serve``; the message names the cause and the fix."""
