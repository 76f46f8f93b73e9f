"""vllm-nnrp-plugin: serve the ``openai-compatible/1`` API profile over NNRP from inside ``vllm serve``.

Three boundaries, one package each:

* :mod:`vllm_nnrp_plugin.profile` — the profile: envelopes, events, errors, chunk-to-event mapping.
  Pure data in, data out; no NNRP, no vLLM, no I/O.
* :mod:`vllm_nnrp_plugin.nnrp_binding` — NNRP: listeners, sessions, frames, the frozen wire mapping.
* :mod:`vllm_nnrp_plugin.vllm_binding` — vLLM: plugin entry points, attaching to the API server,
  calling ``app.state.openai_serving_chat`` and aborting engine requests.

:mod:`vllm_nnrp_plugin.core` joins them: the per-operation state machine (:mod:`~vllm_nnrp_plugin.core.operation`)
and the adapter (one submitted operation -> one backend call -> ordered events). Each operation leaves one
:mod:`~vllm_nnrp_plugin.observability.observation` record, from which its log line, diagnostics, metrics and span
are derived (:mod:`vllm_nnrp_plugin.observability`). What the server and the clients (:mod:`vllm_nnrp_plugin.client`)
agree on above NNRP itself is :mod:`vllm_nnrp_plugin.contract`. Importing this package never imports vLLM.
"""

__version__ = "0.1.0"
