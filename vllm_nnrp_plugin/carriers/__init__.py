"""The carriers' NNRP mappings, sans-IO, shared by the server (:mod:`vllm_nnrp_plugin.nnrp_binding`) and the
client (:mod:`vllm_nnrp_plugin.client`): :mod:`.websocket` NNRP packets over RFC 6455 messages (wsproto),
:mod:`.quic` the NNRP stream of a QUIC connection (aioquic). A byte-stream carrier (TCP, TLS, unix sockets) needs
no mapping: its bytes are the NNRP stream (:mod:`vllm_nnrp_plugin.nnrp_wire.framing`)."""
