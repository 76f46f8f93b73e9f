"""The address scheme of several API-server processes (vllm_binding/ranks.py)."""

import pytest

from vllm_nnrp_plugin.vllm_binding.ranks import RankAddressError, rank_listen

LISTEN = ("tcp://127.0.0.1:9400", "unix:///run/vllm/nnrp.sock", "tcp://[::1]:9500")


def test_one_api_server_keeps_the_configured_addresses():
    assert rank_listen(LISTEN, 0, 1) == LISTEN


def test_rank_zero_keeps_them_and_rank_r_adds_r():
    assert rank_listen(LISTEN, 0, 3) == LISTEN
    assert rank_listen(LISTEN, 2, 3) == ("tcp://127.0.0.1:9402", "unix:///run/vllm/nnrp-2.sock", "tcp://[::1]:9502")


def test_ranks_never_share_an_address():
    addresses = [uri for rank in range(4) for uri in rank_listen(LISTEN, rank, 4)]
    assert len(addresses) == len(set(addresses))


def test_a_port_beyond_65535_is_a_clear_error():
    with pytest.raises(RankAddressError, match="port 65536") as info:
        rank_listen(("tcp://127.0.0.1:65535",), 1, 2)
    assert "Fix:" in str(info.value)


def test_tls_websocket_and_quic_addresses_keep_their_scheme_and_path():
    listen = (
        "nnrps://127.0.0.1:9400",
        "ws://127.0.0.1:9401/nnrp",
        "wss://127.0.0.1:9402/nnrp",
        "quic://127.0.0.1:9403",
    )
    assert rank_listen(listen, 1, 2) == (
        "nnrps://127.0.0.1:9401",
        "ws://127.0.0.1:9402/nnrp",
        "wss://127.0.0.1:9403/nnrp",
        "quic://127.0.0.1:9404",
    )
