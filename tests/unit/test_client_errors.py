"""Both clients raise one error hierarchy (:mod:`vllm_nnrp_plugin.client.errors`): an unusable endpoint URI is a
``ClientAddressError`` (a ``ValueError``) from either, and ``connect``'s is still a ``ClientConnectionError``."""

import asyncio

import pytest

from vllm_nnrp_plugin.client import ClientAddressError, ClientConnectionError, ClientError, ProfileClient, connect


@pytest.mark.parametrize("uri", ["http://127.0.0.1:9400", "tcp://127.0.0.1:notaport", "tcp://127.0.0.1:99999"])
@pytest.mark.parametrize("connect_to", [connect, ProfileClient.connect], ids=["asyncio", "profile_client"])
def test_an_unusable_uri_is_a_client_address_error_from_either_client(connect_to, uri):
    with pytest.raises(ClientAddressError) as raised:
        asyncio.run(connect_to(uri))
    assert isinstance(raised.value, ClientError) and isinstance(raised.value, ValueError)
    assert isinstance(raised.value, ClientConnectionError) == (connect_to is connect)
