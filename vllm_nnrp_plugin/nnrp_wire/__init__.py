"""The project's own NNRP/1 (preview4) wire core, sans-IO in the h11 style: bytes in → typed events out
(:mod:`.events`), calls in → bytes out; no sockets, threads or clock reads.

* :mod:`.framing` — packet reassembly and encoding (the common header rules);
* :mod:`.layouts` — the layout rules of the session-scoped packets either side receives, written once;
* :mod:`.server` — one server connection, a dispatcher: the connection start and session opens and closes are
  :mod:`.handshake` (the ids used: :mod:`.session_ids`), the operations of its sessions :mod:`.operations`;
* :mod:`.client` — one client connection, the same protocol from the other side;
* :mod:`.errors` — what both cores raise: :class:`~.errors.LocalProtocolError` at the application, and the
  internal errors of a peer's packet.

The I/O shells live elsewhere: the server's carriers in :mod:`vllm_nnrp_plugin.nnrp_binding`, the client's in
:mod:`vllm_nnrp_plugin.client`. Metadata layouts are nnrp-py's own struct codecs (``nnrp.core.messages``,
``nnrp.runtime.types``); this package adds what nnrp-py has no codec for (SESSION_OPEN_ACK,
SESSION_CLOSE_ACK) and the connection and session rules.
"""
