"""7. Parser cost: what vLLM's own tool-call parser costs per streamed token, against the stream's length.

vLLM's streaming parsers are handed the text accumulated so far with every output (``Parser.parse_delta`` in
``vllm/parser/abstract_parser.py`` keeps ``previous_text`` / ``current_text`` and the token ids, and the hermes tool
parser, ``vllm/tool_parsers/hermes_tool_parser.py``, re-reads them). Both paths to a client pay it: vLLM's stream
generator over HTTP/SSE and the engine lane over NNRP call the same ``parse_delta`` once per output. This measures
it in-process, without a server: one parser object of the installed vLLM's ``ParserManager.get_parser(
tool_parser_name="hermes")`` for a request with one function tool and ``tool_choice`` auto, driven one token per call
(``finished`` on the last) as vLLM's generator drives it, over a stream of ``n`` tokens (the model's tokenizer,
``--model`` / ``$VLLM_NNRP_TEST_MODEL``) of two kinds:

* ``content``: plain text, no tool call (what an agent's answer is most of the time);
* ``tool_call``: ``<tool_call>{"name": "lookup", "arguments": {"city": "<long text>"}}`` — one call whose
  arguments grow for the whole stream (an agent writing a file through a tool).

Rows ``parser_cost.<kind>.n<n>`` (µs per token over the last tenth of the stream, one sample per repetition): if the
parser is linear in the stream's length, these stay flat as ``n`` grows; ``parser_cost.<kind>.growth`` is the
p50 at the largest ``n`` over the p50 at the smallest (1.0: flat; about largest/smallest: the parser re-reads the
whole stream per token, quadratic over the stream). Needs vLLM's environment.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench.results import Result

LENGTHS = (256, 1024, 4096, 16384)
WORDS = "the sea rolls over grey stones and the wind carries salt to the town where the harbour lights burn "
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up current information about a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _tokens(tokenizer: Any, kind: str, n: int) -> list[int]:
    """``n`` token ids of a stream of ``kind`` (module docstring)."""
    body = tokenizer.encode(WORDS * (n // 8 + 8), add_special_tokens=False)
    if kind == "content":
        return body[:n]
    head = tokenizer.encode('<tool_call>\n{"name": "lookup", "arguments": {"city": "', add_special_tokens=False)
    return (head + body)[:n]


def _drive(parser_cls: Any, tokenizer: Any, request: Any, ids: list[int]) -> list[float]:
    """Seconds per ``parse_delta`` call over ``ids``, one token per call, as vLLM's stream generator calls it."""
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=None, model_config=None)
    pieces = [tokenizer.decode([token]) for token in ids]  # ASCII text: each token decodes on its own
    spent = []
    last = len(ids) - 1
    for k, token in enumerate(ids):
        started = time.perf_counter()
        parser.parse_delta(pieces[k], [token], request, [1], finished=k == last)
        spent.append(time.perf_counter() - started)
    return spent


def run(model: str | None = None, lengths: tuple[int, ...] = LENGTHS, repetitions: int = 3) -> list[Result]:
    """The rows of the module docstring. Raises ``SystemExit`` without a model."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    model = model or os.environ.get("VLLM_NNRP_TEST_MODEL")
    if not model:
        raise SystemExit("parser cost benchmark: give --model or set VLLM_NNRP_TEST_MODEL")
    tokenizer = get_tokenizer(model)
    parser_cls = ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True)
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=[TOOL], tool_choice="auto", stream=True
    )
    rows: list[Result] = []
    for kind in ("content", "tool_call"):
        made = []
        for n in lengths:
            ids = _tokens(tokenizer, kind, n)
            samples = []
            for _ in range(repetitions):
                spent = _drive(parser_cls, tokenizer, request, ids)
                tail = spent[-max(1, n // 10) :]
                samples.append(sum(tail) / len(tail) * 1e6)
            made.append(
                Result.of(
                    f"parser_cost.{kind}.n{n}",
                    "us",
                    samples,
                    parameters={"parser": "hermes", "tokens": n, "tool_choice": "auto"},
                )
            )
        rows += made
        growth = made[-1].p50 / made[0].p50 if made[0].p50 else 0.0
        rows.append(
            Result.of(
                f"parser_cost.{kind}.growth",
                "ratio",
                [growth],
                parameters={"from_tokens": lengths[0], "to_tokens": lengths[-1]},
            )
        )
    return rows
