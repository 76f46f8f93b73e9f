"""Hostile envelopes end to end (the service on its own loop, the project's asyncio client over tcp://): deeply nested
fields get a typed error at once and free their slots, a raw backend exception reaches the client as its type only,
and a model name with a newline or of 900 KB stays one short log line."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.support import ServedNNRP, free_port, wait_until
from vllm_nnrp_plugin.client.aio.connection import connect

DEPTH = 1000  # ~2 KB envelopes, under orjson's own limit of 1024 levels


@pytest.fixture(scope="module")
def served():
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), max_envelope_bytes=1 << 21)
    yield served
    served.stop()


def run_all(served, payloads: list[bytes], timeout_s: float = 5.0) -> list[list[dict]]:
    """Submit every payload on one session at once; each operation's events (terminal last)."""

    async def main():
        conn = await connect(served.bound[0])
        try:
            session = await conn.open_session()
            ops = [session.submit(payload) for payload in payloads]

            async def events(op):
                return [event async for event in op]

            return await asyncio.wait_for(asyncio.gather(*(events(op) for op in ops)), timeout_s)
        finally:
            await conn.close()

    return asyncio.run(main())


def chat(
    model: bytes = b'"c-nonstream-text"',
    schema: bytes = b'"openai-compatible/1"',
    timeout: bytes = b"60000",
    tools: bytes = b"[]",
) -> bytes:
    return (
        b'{"schema_version":'
        + schema
        + b',"operation":"chat.completions.create","nnrp":{"timeout_ms":'
        + timeout
        + b'},"body":{"model":'
        + model
        + b',"messages":[],"tools":'
        + tools
        + b"}}"
    )


def test_deeply_nested_fields_get_invalid_envelope_at_once_and_free_their_slots(served, caplog):
    deep = b"[" * DEPTH + b"]" * DEPTH
    payloads = [chat(schema=deep), chat(timeout=deep), chat(model=deep), chat(tools=deep)]
    assert all(len(p) < 2200 for p in payloads)
    with caplog.at_level(logging.INFO):
        results = run_all(served, payloads * 5)  # 20 at once on one session
        assert wait_until(lambda: served.service.in_flight.used == 0)
    for events in results:
        (terminal,) = events
        assert terminal["type"] == "response.error" and terminal["error"]["code"] == "invalid_envelope"
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert problems == []  # no "Task exception was never retrieved", no failed callback or flush
    assert served.backend.started == []


def test_a_raw_backend_exception_reaches_the_client_as_its_type_only(served, caplog):
    # "raise" makes the recorded backend raise RuntimeError("engine exploded"); an unknown model makes it open a
    # recording that does not exist (FileNotFoundError naming a path on the server)
    with caplog.at_level(logging.INFO):
        (raised,), (missing,) = run_all(served, [chat(model=b'"raise"'), chat(model=b'"no-such-recording"')])
    for terminal, kind in ((raised, "RuntimeError"), (missing, "FileNotFoundError")):
        assert terminal["error"]["code"] == "backend_error" and f"({kind})" in terminal["error"]["message"]
    assert "exploded" not in raised["error"]["message"] and "/" not in missing["error"]["message"]
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failures) == 2 and all("Traceback" in m for m in failures)  # each logged once, with its traceback
    assert any("RuntimeError: engine exploded" in m for m in failures)  # what failed stays in the server log


def service_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vllm_nnrp_plugin.service"]


def test_a_hostile_model_name_stays_one_short_log_line(served, caplog):
    model = b'"hostile\\nFORGED forged line transport=tcp ' + b"x" * 900_000 + b'"'
    with caplog.at_level(logging.INFO):
        ((terminal,),) = run_all(served, [chat(model=model)])
        assert wait_until(lambda: any("nnrp operation" in text and "hostile" in text for text in service_lines(caplog)))
    assert terminal["error"]["code"] == "backend_error"
    (line,) = [text for text in service_lines(caplog) if "nnrp operation" in text and "hostile" in text]
    assert "\n" not in line and line.isprintable() and len(line) < 1000
    assert 'model="hostile\\x0aFORGED forged line transport=tcp xxx' in line and "chars]" in line
    # the backend's exception names the model too (a file name here): its log record is bounded and escaped as well
    (failure,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "hostile" in r.getMessage()]
    assert len(failure) < 10_000 and "\nFORGED" not in failure
