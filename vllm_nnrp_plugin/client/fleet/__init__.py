"""A fleet of replicas for the NNRP clients:

* :mod:`.policy` — which replica a new call goes to, which replicas are out and when they are tried again, which
  failures leave a call safe to submit elsewhere (sans-IO, plain data, time passed in);
* :mod:`.pool` — :class:`~.pool.FleetPool`, its asyncio shell: one session pool
  (:class:`vllm_nnrp_plugin.client.aio.pool.Pool`) per replica; used by the ``openai`` transports and the
  ``vllm-nnrp`` command for several addresses, exported by :mod:`vllm_nnrp_plugin.client`.
"""
