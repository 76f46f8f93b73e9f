"""``vllm-nnrp --priority``: the session's NNRP priority class and the envelope's ``nnrp.priority_class``."""

from __future__ import annotations

import asyncio

import pytest

from vllm_nnrp_plugin.client import cli
from vllm_nnrp_plugin.nnrp_wire import events as ev

from .test_client_controls import Server, settle


def parse(*argv):
    return cli.build_parser().parse_args(argv)


def test_priority_goes_into_the_envelope_only_when_given():
    for argv in (("chat", "hi"), ("respond", "hi"), ("models",), ("embed", "a")):
        args = parse(*argv)
        assert "nnrp" not in cli.COMMANDS[args.command](args)[0]
        args = parse(argv[0], "--priority", "background", *argv[1:])
        assert cli.COMMANDS[args.command](args)[0]["nnrp"] == {"priority_class": "background"}
    assert parse("capabilities", "--priority", "interactive").priority == "interactive"
    with pytest.raises(SystemExit):
        parse("chat", "--priority", "urgent", "hi")


@pytest.mark.parametrize(
    ("argv", "code"), [((), 1), (("--priority", "interactive"), 0), (("--priority", "background"), 2)]
)
def test_priority_opens_the_session_with_that_class(argv, code):
    async def main() -> None:
        server = Server()
        async with server as uri:
            opened = await cli._session(parse("models", "--endpoint", uri, *argv))
            assert opened is not None
            (request,) = await settle(server, ev.SessionOpenRequested)
            assert request.priority_class == code
            await opened[0].close()

    asyncio.run(asyncio.wait_for(main(), 20))
