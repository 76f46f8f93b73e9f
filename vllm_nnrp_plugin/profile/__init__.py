"""The ``openai-compatible/1`` API profile (Levels 1–3): envelopes, events, errors and stream mapping.

Everything here takes plain data (bytes, dicts) and returns plain data. Source of every rule: the
``openai-compatible/1`` profile of the NNRP documentation (its profile design page and normative contract file
``openai-compatible-1.json``) as exercised by the public ``nnrp-conformance`` suite
(``profiles/openai-compatible/1/``, ``schemas/api-profile-*.schema.json``). Modules cite its sections by name:
"Request envelope", "Events", "Capability documents", "Wire mapping" (implemented in
:mod:`vllm_nnrp_plugin.contract.wire_mapping`), "TRACE_CONTEXT → traceparent".
"""

PROFILE = "openai-compatible"
SCHEMA_VERSION = "openai-compatible/1"
CHAT_COMPLETIONS_CREATE = "chat.completions.create"
RESPONSES_CREATE = "responses.create"
MODELS_LIST = "models.list"
EMBEDDINGS_CREATE = "embeddings.create"
#: the profile's compatibility levels ("Identity, levels, operations"): level -> the operations it consists of
LEVELS = {1: (CHAT_COMPLETIONS_CREATE,), 2: (RESPONSES_CREATE,), 3: (MODELS_LIST, EMBEDDINGS_CREATE)}
