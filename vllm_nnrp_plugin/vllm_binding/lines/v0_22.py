"""vLLM 0.22.x (anchor 0.22.1), the ``vllm-0.22`` binding.

* Attach: no API-server plugin hook, so ``--middleware`` as on 0.18; ``build_app(args, supported_tasks,
  model_config)`` in ``vllm/entrypoints/openai/api_server.py``.
* Chat parser: ``parser_cls`` exists, but its ``parse_delta`` has no ``finished`` argument and the stream generator
  keeps text, token and ``reasoning_end_arr`` state of its own beside the parser, so the engine lane cannot drive it
  (text streams still take the lane).
* Responses: ``SimpleStreamingEventProcessor`` as on 0.26, so text streams take the Responses lane; with a parser
  vLLM makes its own inside the processor, out of the lane's reach. Its Responses stream uses other call ids than
  its completed Response.
"""

from vllm_nnrp_plugin.vllm_binding.lines.surface import (
    BUILD_APP_022,
    CHAT,
    MIDDLEWARE,
    NO_ENDPOINT_PLUGINS,
    NOT_RELOCATED,
    Binding,
)

BINDING = Binding(
    "vllm-0.22",
    ("0.22.1",),
    (MIDDLEWARE,),
    (BUILD_APP_022, NO_ENDPOINT_PLUGINS, CHAT, NOT_RELOCATED),
    chat_parser_lane_off="vLLM keeps this line's parser state in its stream generator (parse_delta has no "
    "finished argument)",
    responses_parser_lane_off="vLLM makes this line's Responses parser inside its stream processor",
)
