"""The engine lanes proven on the installed vLLM before the listener starts: the same recorded outputs through vLLM's
own serving code, once as HTTP runs it and once through the lane, must give the same profile events.

The chat lane (:mod:`.engine_lane`) and the Responses lane (:mod:`.responses_lane`) rely on how vLLM's serving code
behaves: which parser object its stream generator makes and how it calls it, how it builds each chunk or event, which
state its Responses processor changes per delta, that it awaits its result generator in its own frame. Reading
vLLM's source cannot prove that, and a patch release may change any of it. So each lane is run, at start-up and with
no engine or model work, on a few requests (:func:`chat_cases`, :func:`responses_cases`): vLLM's own
``create_chat_completion`` / ``create_responses`` run on a view of the serving object whose engine client is a
:class:`ScriptedEngine`, which answers ``generate`` with :data:`OUTPUT_TEXTS` split into the server's own tokens (and
hands every other call to vLLM's engine client). Each request runs twice, on vLLM's path and on the lane, and the two
event sequences are compared after the profile's stream mapper (:data:`vllm_nnrp_plugin.core.adapter.STREAM_MAPPERS`),
ids and timestamps made canonical (:func:`canonical`). A difference, an exception, a run that outlasts
:data:`CASE_TIMEOUT_S`, an engine generator left open, or a lane that took no output itself (it would only add
work) switches the lane off with the reason (the start-up log names it); streams then take vLLM's own path: a
changed vLLM costs speed, never correctness.

:func:`lane_difference` is the comparison over plain async callables, testable without vLLM; :class:`ProvenLane` is
the check as a binding with a lane runs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import attrs

from vllm_nnrp_plugin.core.adapter import STREAM_MAPPERS, Call

#: longest a self-check run may take (a lane whose feed leaks out of vLLM's frame would otherwise hang), seconds
CASE_TIMEOUT_S = 10.0
#: the outputs the scripted engine gives: plain text, text around a Hermes-style tool call, a reasoning block
OUTPUT_TEXTS = {
    "text": "Hello! How can I help you today? Ask me anything.",
    "tool-call": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "reasoning": "<think>The user greets me; I greet back.</think>Hello there, nice to meet you!",
}
_WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
#: keys whose values differ between two runs of the same request: timestamps, and vLLM's random ids
_TIMESTAMPS = frozenset({"created", "created_at", "completed_at", "system_fingerprint"})


@attrs.frozen
class Case:
    """One self-check request: ``name`` (for the reason), the request ``body`` and the engine's output ``text``."""

    name: str
    body: dict[str, Any]
    text: str


def chat_cases(model: str, tool_parser: bool) -> list[Case]:
    """The chat requests of the check: every output text with a plain streamed request (usage asked), and, on a server
    with a tool-call parser, the tool-call text with ``tool_choice`` ``auto`` and ``none``."""
    base = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 256,
    }
    cases = [Case(f"chat {name}", base, text) for name, text in OUTPUT_TEXTS.items()]
    if tool_parser:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": _WEATHER_PARAMETERS}}]
        for choice in ("auto", "none"):
            body = {**base, "tools": tools, "tool_choice": choice}
            cases.append(Case(f"chat tool_choice {choice}", body, OUTPUT_TEXTS["tool-call"]))
    return cases


def responses_cases(model: str, tool_parser: bool) -> list[Case]:
    """The Responses requests of the check: every output text streamed, and the tool-call text with a tool
    (``tool_choice`` ``auto``) on a server with a tool-call parser."""
    base = {"model": model, "input": "Say hello.", "stream": True, "max_output_tokens": 256}
    cases = [Case(f"Responses {name}", base, text) for name, text in OUTPUT_TEXTS.items()]
    if tool_parser:
        tools = [{"type": "function", "name": "get_weather", "parameters": _WEATHER_PARAMETERS}]
        cases.append(
            Case(
                "Responses tool_choice auto", {**base, "tools": tools, "tool_choice": "auto"}, OUTPUT_TEXTS["tool-call"]
            )
        )
    return cases


#: ``run(case, lane)``: (the profile events of ``case`` run on the lane (``lane`` true) or on vLLM's path, how many
#: engine outputs the lane turned into events itself)
Runner = Callable[[Case, bool], Awaitable[tuple[list[Any], int]]]


async def lane_difference(run: Runner, cases: Sequence[Case], timeout_s: float = CASE_TIMEOUT_S) -> str | None:
    """Why the lane is not vLLM's path for ``cases`` (the first difference, or what a run raised, or that the lane
    took no engine output itself in any case), else ``None``.

    Each case runs on vLLM's path first (a case vLLM itself fails is skipped: it proves nothing about the lane),
    then on the lane; the events of both are compared after :func:`canonical`."""
    taken = compared = 0
    for case in cases:
        try:
            expected, _ = await asyncio.wait_for(run(case, False), timeout_s)
        except Exception:  # noqa: BLE001 - vLLM's own path cannot run this case here: nothing to compare
            continue
        try:
            got, took = await asyncio.wait_for(run(case, True), timeout_s)
        except TimeoutError:
            return f"{case.name}: the lane did not finish within {timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure of the lane is a failed check
            return f"{case.name}: the lane raised {type(exc).__name__}: {exc}"
        difference = first_difference(canonical(expected), canonical(got))
        if difference is not None:
            return f"{case.name}: {difference}"
        taken, compared = taken + took, compared + 1
    if not compared:
        return "vLLM's own path ran none of the self-check's requests"
    if not taken:
        return "the lane took no engine output itself (it hands every one to vLLM's own code on this vLLM)"
    return None


def first_difference(expected: list[Any], got: list[Any]) -> str | None:
    """Where the lane's events ``got`` first differ from vLLM's ``expected``, or ``None``."""
    for index, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            return f"event {index} is {_short(have)} on the lane, {_short(want)} on vLLM's path"
    if len(expected) != len(got):
        return f"{len(got)} events on the lane, {len(expected)} on vLLM's path"
    return None


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def canonical(value: Any, ids: dict[str, str] | None = None) -> Any:
    """``value`` (events, bodies) with timestamps (:data:`_TIMESTAMPS`) blanked and every id (a string under a key
    ending in ``id``) replaced by ``<id N>``, N counting distinct ids in order of first appearance: two runs of the
    same request compare equal when they differ only in vLLM's random ids and clock."""
    ids = {} if ids is None else ids
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in _TIMESTAMPS:
                out[key] = "<time>"
            elif isinstance(item, str) and key.endswith("id"):
                out[key] = ids.setdefault(item, f"<id {len(ids)}>")
            else:
                out[key] = canonical(item, ids)
        return out
    if isinstance(value, list | tuple):
        return [canonical(item, ids) for item in value]
    return value


class ScriptedEngine:
    """vLLM's engine client ``engine`` with ``generate`` answered from ``pieces`` ((text, token ids) per output, the
    last one finished with ``stop``) instead of the engine; every other attribute is ``engine``'s. ``closed``: the
    outputs of every ``generate`` call were closed (read to the end, or ``aclose``)."""

    def __init__(self, engine: Any, pieces: Sequence[tuple[str, list[int]]]) -> None:
        self._engine = engine
        self._pieces = list(pieces)
        self._open = 0
        self.calls = 0
        #: engine outputs a lane turned into events itself, without vLLM's code (:meth:`report_lane`)
        self.lane_taken = 0

    @property
    def closed(self) -> bool:
        return self._open == 0

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self._open += 1
        return self._outputs(_prompt_token_ids(prompt), request_id)

    def report_lane(self, taken: int) -> None:
        """A lane's count of the outputs it took itself (called once, when its stream ends)."""
        self.lane_taken += taken

    async def abort(self, *args: Any, **kwargs: Any) -> None:
        """Nothing runs in the engine for a scripted request."""

    async def _outputs(self, prompt_token_ids: list[int], request_id: str) -> AsyncIterator[Any]:
        from vllm.outputs import CompletionOutput, RequestOutput

        try:
            last = len(self._pieces) - 1
            for n, (text, token_ids) in enumerate(self._pieces):
                await asyncio.sleep(0)
                completion = CompletionOutput(
                    index=0,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=None,
                    logprobs=None,
                    finish_reason="stop" if n == last else None,
                    stop_reason=None,
                )
                yield RequestOutput(
                    request_id=request_id,
                    prompt=None,
                    prompt_token_ids=prompt_token_ids,
                    prompt_logprobs=None,
                    outputs=[completion],
                    finished=n == last,
                    num_cached_tokens=0,
                )
        finally:
            self._open -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _prompt_token_ids(prompt: Any) -> list[int]:
    """The token ids of vLLM's engine prompt (a ``TokensPrompt`` dict, or an object with ``prompt_token_ids``)."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else getattr(prompt, "prompt_token_ids", None)
    return list(ids) if ids else [1]


def pieces_of(text: str, tokenizer: Any) -> list[tuple[str, list[int]]]:
    """``text`` as the engine would stream it with ``tokenizer`` (a Hugging Face-style tokenizer: ``encode``,
    ``decode``): one output per token, its text the decoded token."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return [(tokenizer.decode([token_id]), [token_id]) for token_id in token_ids]


async def tokenizer_of(serving: Any) -> Any:
    """The tokenizer vLLM's serving object renders with: ``serving.renderer.tokenizer`` (chat 0.26+),
    ``serving.renderer.get_tokenizer()`` (Responses 0.26+), else the engine client's ``get_tokenizer()`` (0.18,
    0.22). Raises ``LookupError`` when there is none (``--skip-tokenizer-init``)."""
    renderer = getattr(serving, "renderer", None)
    tokenizer = getattr(renderer, "tokenizer", None)
    if tokenizer is None and renderer is not None and hasattr(renderer, "get_tokenizer"):
        tokenizer = renderer.get_tokenizer()
    if tokenizer is None:
        getter = getattr(getattr(serving, "engine_client", None), "get_tokenizer", None)
        tokenizer = getter() if getter is not None else None
        if asyncio.iscoroutine(tokenizer):
            tokenizer = await tokenizer
    if tokenizer is None:
        raise LookupError("vLLM's serving object has no tokenizer")
    return tokenizer


#: ``run_case(body, request_id, lane, engine)``: a binding's call of ``body`` on the lane (``lane`` true) or on vLLM's
#: path, on the engine client ``engine``
CaseRunner = Callable[[dict[str, Any], str, bool, Any], Awaitable[Any]]


async def prove(serving: Any, cases: Sequence[Case], run_case: CaseRunner, operation: str) -> str | None:
    """Why the lane of the profile ``operation`` on vLLM's serving object ``serving`` failed its self-check over
    ``cases`` (:func:`lane_difference`), else ``None``. ``run_case`` runs one case (the binding's call on either path,
    an :class:`~vllm_nnrp_plugin.core.adapter.Call`); its events are the profile stream mapper's. Never raises."""
    try:
        tokenizer = await tokenizer_of(serving)
    except Exception as exc:  # noqa: BLE001 - no way to script outputs: the check cannot pass
        return f"no tokenizer to script the engine's outputs with ({exc})"
    runs = 0

    async def run(case: Case, lane: bool) -> tuple[list[Any], int]:
        nonlocal runs
        runs += 1
        engine = ScriptedEngine(serving.engine_client, pieces_of(case.text, tokenizer))
        call = await run_case(case.body, f"nnrp-self-check-{runs}", lane, engine)
        mapper = STREAM_MAPPERS[operation](case.body)
        events: list[Any] = []
        if call.stream is None:
            events.append(call.body)
        else:
            async for item in call.stream:
                events.extend(mapper.feed(item))
            events.extend(mapper.finish())
            events.append(mapper.completed_body())
        if not engine.closed:
            raise RuntimeError("the engine's outputs were left open")
        if engine.calls != 1:
            raise RuntimeError(f"the request reached the engine {engine.calls} times")
        return events, engine.lane_taken

    try:
        return await lane_difference(run, cases)
    except Exception as exc:  # noqa: BLE001 - a self-check that raises is a failed check, never a failed start
        return f"the self-check raised {type(exc).__name__}: {exc}"


class ProvenLane:
    """The start-up self-check of a binding with a lane (:class:`~.chat.ChatBinding`,
    :class:`~.responses.ResponsesBinding`), mixed into it. The binding has ``name`` (its profile operation),
    ``_serving`` (vLLM's serving object), ``_vllm_views`` and ``_lane_views`` (what a request runs on, on vLLM's
    path and on the lane; ``None``: no lane), ``_views`` (what its requests take), ``lane_off`` and ``lane_parser``;
    it gives ``_cases(model)`` (the requests of its check) and ``_create(views, body, request_id, traceparent,
    controls, engine)`` (its call)."""

    name: str
    lane_off: str | None
    lane_parser: bool
    _serving: Any
    _vllm_views: Any
    _lane_views: Any
    _views: Any
    _cases: Callable[[str], list[Case]]
    _create: Callable[..., Awaitable[Call]]

    async def prove_lane(self, model: str) -> None:
        """Run the lane's start-up self-check (:func:`prove`) for the served ``model``; when the lane is not
        vLLM's path on the installed vLLM, switch it off (:attr:`lane_off` says why). Never raises."""
        if self._lane_views is None:
            return
        off = await prove(self._serving, self._cases(model), self._run_case, self.name)
        if off is not None:
            self.lane_off, self.lane_parser, self._views = (
                f"the start-up self-check failed: {off}",
                False,
                self._vllm_views,
            )

    async def _run_case(self, body: dict[str, Any], request_id: str, lane: bool, engine: Any) -> Call:
        return await self._create(self._lane_views if lane else self._vllm_views, body, request_id, None, None, engine)
