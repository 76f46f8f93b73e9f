"""What a streamed tool call ends with: the rules the chat (:mod:`.chat_stream`) and the Responses
(:mod:`.responses_stream`) mappers share (the profile's tool-call events; docs/wire-mapping.md *Tool calls*).

* :func:`is_one_json_value`: a call completes only with arguments that are exactly one JSON value.
* :func:`tools_without_required_arguments` and :func:`ending_arguments`: a call of a tool whose declared
  parameters accept the empty object, ended normally with no argument text at all, completes with ``"{}"``.
  That is what vLLM's non-streaming answer gives for it: its tool parsers re-serialise the parsed arguments
  (``json.dumps(function_call["arguments"])`` in ``Hermes2ProToolParser.extract_tool_calls``,
  ``vllm/tool_parsers/hermes_tool_parser.py``; ``tool_call_dict.get("arguments", {})`` in
  ``ernie45_tool_parser.py``, ``step3_tool_parser.py``), while its streaming parsers may send no argument
  fragment for empty arguments: on 0.18.x ``Hermes2ProToolParser.extract_tool_calls_streaming`` skips every
  delta while the parsed arguments are falsy (``if not cur_arguments and not prev_arguments``), so the call's
  ``{}`` never reaches the stream.
"""

from __future__ import annotations

import json
from typing import Any

#: JSON-schema keywords that do not constrain which members an object has (annotations and the ones the
#: empty-object rule checks itself)
_OBJECT_KEYWORDS = frozenset(
    {"type", "properties", "required", "additionalProperties", "title", "description", "$schema"}
)


def is_one_json_value(text: str) -> bool:
    """True when ``text`` is exactly one JSON value (Python's ``json.loads``, as vLLM's tool parsers read
    arguments): what a tool call's arguments must be for ``response.tool_call.completed``."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # json.JSONDecodeError (also "" and whitespace), absurd nesting
        return False
    return True


def tools_without_required_arguments(tools: object) -> frozenset[str]:
    """Names of the request's function tools (``tools`` of a chat or a Responses body) whose declared
    ``parameters`` accept the empty object ``{}``:

    * no ``parameters``, ``null`` or ``{}``: vLLM treats these as ``{"type": "object", "properties": {}}``
      (``_get_tool_schema_from_tool`` in ``vllm/tool_parsers/utils.py``);
    * ``{"type": "object", …}`` with no ``required`` or ``required: []``, ``properties`` an object (any, all of
      them optional then), and otherwise only ``additionalProperties``, ``title``, ``description``, ``$schema``.

    Any other declaration (a non-empty ``required``, ``minProperties``, ``anyOf``/``oneOf``/``allOf``, ``$ref``,
    another ``type``, …) is not known to accept ``{}``, and neither is a tool that is declared twice with
    different answers. Declarations: chat ``{"type": "function", "function": {"name", "parameters"}}``,
    Responses ``{"type": "function", "name", "parameters"}``; other entries are ignored."""
    verdicts: dict[str, bool] = {}
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue
        function = tool.get("function")
        declared = function if isinstance(function, dict) else tool
        name = declared.get("name")
        if isinstance(name, str):
            verdicts[name] = verdicts.get(name, True) and _accepts_empty_object(declared.get("parameters"))
    return frozenset(name for name, accepts in verdicts.items() if accepts)


def _accepts_empty_object(parameters: Any) -> bool:
    if parameters is None or parameters == {}:
        return True
    return (
        isinstance(parameters, dict)
        and parameters.keys() <= _OBJECT_KEYWORDS
        and parameters.get("type") == "object"
        and isinstance(parameters.get("properties", {}), dict)
        and parameters.get("required", []) == []
    )


def ending_arguments(name: str, arguments: str, no_argument_tools: frozenset[str]) -> str | None:
    """The arguments a named call that ended normally (not cut by the token budget or a stop condition)
    completes with: ``arguments`` when they are one JSON value, ``"{}"`` when they are empty (no fragment, or
    only ``""`` ones) and ``name`` is one of ``no_argument_tools`` (:func:`tools_without_required_arguments`),
    else ``None`` (the call ends with ``response.tool_call.error``)."""
    if is_one_json_value(arguments):
        return arguments
    return "{}" if arguments == "" and name in no_argument_tools else None
