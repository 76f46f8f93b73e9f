"""vLLM 0.18.x (anchor 0.18.1), the ``vllm-0.18`` binding.

* Attach: no API-server plugin hook (``vllm.plugins`` has no ``load_endpoint_plugins``), so vLLM's ``--middleware``
  flag naming :class:`~vllm_nnrp_plugin.vllm_binding.middleware.NNRPMiddleware`. ``build_app(args,
  supported_tasks)`` in ``vllm/entrypoints/openai/api_server.py``, without ``model_config``.
* Chat parser: the tool parser is ``OpenAIServingChat.tool_parser`` and the reasoning parser
  ``reasoning_parser_cls``; the stream generator feeds their ``extract_*_streaming`` with its own ``previous_texts``,
  so the engine lane cannot drive them (text streams still take it).
* Responses: ``_process_simple_streaming_events`` keeps its event state in the generator itself (no
  ``SimpleStreamingEventProcessor`` whose state the lane could add to); the method lives in
  ``vllm/entrypoints/openai/engine/serving.py``. A streamed request whose text format is a JSON schema breaks off
  before its first event (``responses_stream_generator`` dumps its initial Response with ``model_dump()``, which
  names the format's schema ``schema_``, so ``ResponseCreatedEvent`` fails validation; recorded:
  ``compat/fixtures/vllm/0.18.1/responses-d-stream-tool-required.sse``).
* The hermes stream sends no argument text for a parameterless tool call (the profile mapper completes it).
* On CPU it needs tcmalloc and Intel's libiomp5 preloaded (``compat/vllm-0.18.1/runtime.sh``).
"""

from vllm_nnrp_plugin.vllm_binding.lines.surface import (
    BUILD_APP_018,
    CHAT,
    MIDDLEWARE,
    NO_ENDPOINT_PLUGINS,
    NOT_RELOCATED,
    Binding,
)

BINDING = Binding(
    "vllm-0.18",
    ("0.18.1",),
    (MIDDLEWARE,),
    (BUILD_APP_018, NO_ENDPOINT_PLUGINS, CHAT, NOT_RELOCATED),
    chat_parser_lane_off="vLLM keeps this line's parser state in its stream generator (tool_parser and "
    "reasoning_parser_cls fed with the generator's own previous_texts)",
    responses_lane_off="vLLM keeps this line's Responses event state in its stream generator",
    json_schema_stream_fails=True,
)
