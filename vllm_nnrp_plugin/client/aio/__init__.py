"""The project's asyncio client, on the sans-IO client core (:mod:`vllm_nnrp_plugin.nnrp_wire.client`): no thread,
no poll, one event loop. Its public names (:func:`connect`, :class:`Connection`, :class:`Session`,
:class:`Operation`) are exported by :mod:`vllm_nnrp_plugin.client`.

* :mod:`.connection` — :func:`~.connection.connect` and the connection, its sessions and operations; TCP, TLS and
  unix sockets directly;
* :mod:`.websocket`, :mod:`.quic` — the asyncio shells of the :mod:`vllm_nnrp_plugin.carriers` mappings for
  ``ws(s)://`` and ``quic://``;
* :mod:`.priority` — an operation's own priority class in its envelope;
* :mod:`.pool` — sessions on connections to one endpoint, sized by the server's credit (what the ``openai``
  transports and each replica of a fleet run on).

Named ``aio`` so that it never shadows the standard library's ``asyncio``.
"""
