"""vLLM 0.29.x–0.32.x (anchors 0.29.0, 0.30.0, 0.31.0, 0.32.0), the ``vllm-0.32`` binding.

* Attach: as on 0.26, but ``build_app`` moved to ``vllm/entrypoints/launchers/app.py`` (the old
  ``vllm/entrypoints/openai/api_server.py`` is a deprecated re-export that ``vllm serve`` never imports, which is why
  the start-up gate recognises the ``vllm serve`` process by its process facts, ``general.py``).
* Chat parser: as on 0.26; 0.32 makes it through ``self._make_parser(…)``, which calls ``self.parser_cls(…)``.
* Responses: as on 0.26; on 0.32 the stream's call ids match the completed Response.
* 0.32 reads a ``traceparent`` header even with tracing off (0.18–0.26 only with ``--otlp-traces-endpoint``).
"""

from vllm_nnrp_plugin.vllm_binding.lines.surface import ENDPOINT_PLUGIN, MIDDLEWARE, RELOCATED_LAYOUT, Binding

BINDING = Binding(
    "vllm-0.32", ("0.29.0", "0.30.0", "0.31.0", "0.32.0"), (ENDPOINT_PLUGIN, MIDDLEWARE), RELOCATED_LAYOUT
)
