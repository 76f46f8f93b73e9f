"""Each NNRP request runs on a view of vLLM's serving object whose engine client is tapped for that request.

vLLM's chat and Responses serving objects start a request with ``self.engine_client.generate(prompt,
sampling_params, request_id, …)`` (``vllm/entrypoints/openai/chat_completion/serving.py``,
``…/responses/serving.py``; on 0.18 ``…/engine/serving.py`` for Responses; the same three leading parameters
on ``AsyncLLM.generate`` 0.18–0.32, ``vllm/v1/engine/async_llm.py``) and read its ``RequestOutput`` objects.
:func:`view_maker` makes, per request, an object that shares the serving object's state (its ``__dict__``) and
methods but whose ``engine_client`` is an :class:`_TappedEngine` for that request's
:class:`~vllm_nnrp_plugin.core.controls.RuntimeControls`. vLLM's own HTTP routes keep the serving object itself:
nothing in vLLM is patched. The tapped ``generate`` hands every output on unchanged, and on the way:

* the first output marks the request started in the engine (``engine_started``) and gives its prefix-cache hits
  (``RequestOutput.num_cached_tokens``, reported whatever ``--enable-prompt-tokens-details`` says);
* with a token budget (a BUDGET_UPDATE after dispatch), the first output that brings the request's output tokens
  to the budget ends it: a copy of that output is handed on as the engine's last, ``finish_reason`` ``length`` — what
  the engine itself reports when ``max_tokens`` ends a request (``vllm/v1/core/sched/utils.py`` ``check_stop``) — so
  vLLM's own generator writes the finish chunk and usage, and the engine request is aborted first
  (``AsyncLLM.abort``) when the operation's lifecycle says so (its ``BUDGET`` input:
  :meth:`~vllm_nnrp_plugin.core.controls.RuntimeControls.end_at_budget`). Outputs count by request: a request of one
  choice streamed with ``DELTA`` or
  ``CUMULATIVE`` outputs; a non-streaming request (``FINAL_ONLY``: one output at the end) or one of ``n`` > 1
  choices takes a budget only before dispatch. An output that carries several tokens (speculative decoding)
  is kept whole, so such a stream may end a few tokens past the budget.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm_nnrp_plugin.core.controls import RuntimeControls


def view_maker(serving: Any, namespace: dict[str, Any] | None = None) -> Callable[[RuntimeControls | None], Any]:
    """``make(controls, engine=None)``: a new view of ``serving`` (an instance of a subclass of its class, made once,
    with ``namespace``'s attributes and an ``engine_client`` property; it shares ``serving.__dict__``) whose engine
    client is tapped for ``controls`` (``None``: untapped). The engine client is vLLM's own, or ``engine`` when given
    (the lanes' start-up self-checks run vLLM's serving code on recorded outputs: :mod:`.self_check`).
    ``namespace`` may list ``__slots__`` of its own."""
    base = type(serving)
    body = dict(namespace or {})
    body["__slots__"] = ("_nnrp_engine", *body.get("__slots__", ()))
    body.setdefault("__module__", __name__)
    body["engine_client"] = property(_engine_client)
    view_cls = type(base.__name__, (base,), body)

    def make(controls: RuntimeControls | None = None, engine: Any = None) -> Any:
        view: Any = object.__new__(view_cls)  # a view of vLLM's serving object
        view.__dict__ = serving.__dict__
        if controls is None:
            view._nnrp_engine = engine
        else:
            view._nnrp_engine = _TappedEngine(serving.__dict__["engine_client"] if engine is None else engine, controls)
        return view

    return make


def _engine_client(view: Any) -> Any:
    """The view's ``engine_client``: the tapped one, else the serving object's own."""
    tapped = view._nnrp_engine
    return tapped if tapped is not None else view.__dict__["engine_client"]


class _TappedEngine:
    """vLLM's engine client with ``generate`` tapped for one request's ``controls``; every other attribute is the
    engine client's own."""

    __slots__ = ("_engine", "_controls")

    def __init__(self, engine: Any, controls: RuntimeControls) -> None:
        self._engine, self._controls = engine, controls

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        outputs = self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs)
        return _tapped(outputs, self._engine, request_id, _counting(sampling_params), self._controls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _counting(sampling_params: Any) -> int:
    """How outputs count tokens: 1 for ``DELTA`` (each output's token ids are new), 2 for ``CUMULATIVE`` (all so
    far), 0 when a budget cannot end the stream (``FINAL_ONLY``, ``n`` > 1)."""
    from vllm.sampling_params import RequestOutputKind

    if getattr(sampling_params, "n", 1) != 1:
        return 0
    kind = getattr(sampling_params, "output_kind", None)
    return {RequestOutputKind.DELTA: 1, RequestOutputKind.CUMULATIVE: 2}.get(kind, 0)


async def _tapped(
    outputs: Any, engine: Any, request_id: str, counting: int, controls: RuntimeControls
) -> AsyncIterator[Any]:
    """``outputs`` handed on (module docstring); closing this generator closes ``outputs`` (vLLM's ``generate``
    aborts an unfinished request when closed)."""
    produced = 0
    try:
        async for output in outputs:
            if not controls.engine_started:
                controls.engine_started = True
                controls.cached_tokens = output.num_cached_tokens
            if counting:
                completion = output.outputs[0] if output.outputs else None
                if completion is not None:
                    ids = len(completion.token_ids)
                    produced = produced + ids if counting == 1 else ids
                budget = controls.token_budget
                if budget is not None and produced >= budget and not output.finished and completion is not None:
                    if controls.end_at_budget():
                        await engine.abort(request_id)
                    yield _ended_by_budget(output)
                    return
            yield output
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()


def _ended_by_budget(output: Any) -> Any:
    """A shallow copy of ``RequestOutput`` ``output`` (its one choice copied too) that ends the request as the engine
    ends one at ``max_tokens``: ``finished``, ``finish_reason`` ``length``, no ``stop_reason``. The engine's objects
    are not changed."""
    completion = copy.copy(output.outputs[0])
    completion.finish_reason, completion.stop_reason = "length", None
    ended = copy.copy(output)
    ended.outputs = [completion, *output.outputs[1:]]
    ended.finished = True
    return ended
