"""The official ``openai`` SDK over NNRP (extra ``[openai]``): the transports are
:class:`vllm_nnrp_plugin.client.openai.transport.NNRPTransport` and ``AsyncNNRPTransport`` (also importable from
:mod:`vllm_nnrp_plugin.client`). Imports are absolute: this package is ``vllm_nnrp_plugin.client.openai``, and
``import openai`` anywhere still means the SDK.

* :mod:`.transport` — the ``httpx`` / ``httpx2`` transports, sync and async shells around one exchange;
* :mod:`.exchange` — one SDK call's exchange: submit, refusals, timeouts, cancel; the sessions the calls run on
  are the asyncio client's pool (:mod:`vllm_nnrp_plugin.client.aio.pool`), sized by the server's credit;
* :mod:`.calls` — which SDK request is which profile operation, and how its events become the HTTP answer;
* :mod:`.sse` — profile events → ``/v1/chat/completions`` SSE bytes, vLLM's error bodies, the model list (no I/O);
* :mod:`.responses_sse` — profile events → ``/v1/responses`` SSE bytes (no I/O).
"""
