"""The ``openai-compatible/1`` API profile (Level 1): envelopes, events, errors and stream mapping.

Everything here takes plain data (bytes, dicts) and returns plain data. Source of every rule:
``profile-contract.md`` §2 (envelope), §3 (events), §5 (wire mapping, implemented in
:mod:`vllm_nnrp_plugin.nnrp_binding.wire`).
"""

PROFILE = "openai-compatible"
SCHEMA_VERSION = "openai-compatible/1"
CHAT_COMPLETIONS_CREATE = "chat.completions.create"
