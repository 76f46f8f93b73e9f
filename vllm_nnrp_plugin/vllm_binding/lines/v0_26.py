"""vLLM 0.26.x–0.28.x (anchors 0.26.0, 0.27.1, 0.28.0), the ``vllm-0.26`` binding.

* Attach: the ``vllm.endpoint_plugins`` hook (``vllm/plugins/endpoint_plugins/interface.py``: ``attach_router``,
  ``init_state``; vLLM loads it only when ``VLLM_PLUGINS`` names it), or ``--middleware``; ``build_app(args,
  supported_tasks, model_config)`` in ``vllm/entrypoints/openai/api_server.py``, which ``vllm serve`` imports.
* Chat parser: one stateful ``parser_cls`` object per choice (``ParserManager.get_parser``), made by the stream
  generator through ``self.parser_cls(…)`` and called once per output as ``parse_delta(…, finished=…)``
  (``vllm/parser/abstract_parser.py``): the engine lane drives it, once its self-check passes.
* Responses: ``SimpleStreamingEventProcessor`` (``vllm/entrypoints/openai/responses/streaming_events.py``) whose
  delta events change only ``state.accumulated_text``, and the request's parser on its context
  (``ctx.response_parser``): the Responses lane with or without a parser, once its self-check passes.
* 0.27 and 0.28 render Hermes tool definitions into 10 more prompt tokens; from 0.28 non-streaming bodies carry
  ``usage.completion_tokens_details: null`` (``chunk_shapes.py`` drops it).
"""

from vllm_nnrp_plugin.vllm_binding.lines.surface import (
    BUILD_APP_022,
    CHAT,
    ENDPOINT_PLUGIN,
    ENDPOINT_PLUGINS,
    MIDDLEWARE,
    NOT_RELOCATED,
    Binding,
)

BINDING = Binding(
    "vllm-0.26",
    ("0.26.0", "0.27.1", "0.28.0"),
    (ENDPOINT_PLUGIN, MIDDLEWARE),
    (ENDPOINT_PLUGINS, BUILD_APP_022, CHAT, NOT_RELOCATED),
)
