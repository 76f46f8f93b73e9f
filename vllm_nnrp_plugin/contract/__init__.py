"""What the plugin's server and its clients agree on above NNRP/1 itself (plain data, no I/O), so that both sides
import one definition:

* :mod:`.wire_mapping` — the frozen wire mapping of the ``openai-compatible/1`` profile (envelope and terminal ↔
  typed bodies, partial results, drop reasons);
* :mod:`.endpoints` — the address URIs, which carrier each names, its ALPN id and the WebSocket path;
* :mod:`.auth_block` — the authentication block: ``Bearer <key>`` in UTF-8 and the ``auth_status`` values;
* :mod:`.draining` — how a draining replica says so on the wire.

Submodules are imported by name; this package imports none of them.
"""
