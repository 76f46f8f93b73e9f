"""NNRP side: one runtime on vLLM's event loop — the listener and its carriers (TCP, TLS, unix sockets,
WebSocket, QUIC; :mod:`.listener`, :mod:`.connection`, :mod:`.websocket`, :mod:`.quic`), the session rules every
carrier applies (:mod:`.session_policy`), each operation's outbox (:mod:`.server_operation`), bounds,
authentication and exposure — around the sans-IO wire core (:mod:`vllm_nnrp_plugin.nnrp_wire`)."""
