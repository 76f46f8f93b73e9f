"""The backend on a vLLM API server: one binding per operation the server's own serving objects offer.

Which operations a server serves follows from ``app.state`` (filled by vLLM's ``init_app_state`` from the
tasks the model supports): ``openai_serving_chat`` (``generate`` task) -> ``chat.completions.create``;
``openai_serving_responses`` (``generate`` task) -> ``responses.create``; ``openai_serving_models`` (every
server) -> ``models.list``; ``serving_embedding`` (the ``embed`` pooling task, ``--convert embed``) ->
``embeddings.create``. The capability document lists exactly these
(:func:`vllm_nnrp_plugin.profile.capabilities.runtime_document`); a server whose serving objects make up no
whole profile level (e.g. a ``classify``-only server: ``models.list`` alone) is refused at start-up. The setting
``nnrp.operations`` (:mod:`vllm_nnrp_plugin.config`) narrows them to the operations it lists.

Every binding has ``name`` (the profile operation), ``operation()`` (its capability entry), ``async
create(body, request_id, traceparent) -> Call``, ``engine_request_id(request_id)`` (the id recorded in the
observation) and ``engine_request_ids(request_id)`` (what an unfinished operation aborts: one engine request, one
per input of an embedding, none for ``models.list``); aborting is the same for all:
``engine_client.abort(<engine request ids>)``.
"""

from __future__ import annotations

from typing import Any

from vllm_nnrp_plugin.core.adapter import Call
from vllm_nnrp_plugin.core.controls import PRIORITY_CLASSES, RuntimeControls
from vllm_nnrp_plugin.errors import NNRPStartupError
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, RESPONSES_CREATE
from vllm_nnrp_plugin.profile.capabilities import runtime_document
from vllm_nnrp_plugin.vllm_binding.chat import ChatBinding
from vllm_nnrp_plugin.vllm_binding.embeddings import EmbeddingsBinding
from vllm_nnrp_plugin.vllm_binding.families import Binding, family_of
from vllm_nnrp_plugin.vllm_binding.models import ModelsBinding
from vllm_nnrp_plugin.vllm_binding.responses import ResponsesBinding

#: how an operation's streams reach the profile mapper, for the start-up log: (label, on the lane with vLLM's
#: parser, on the lane without one, off the lane — ``{}`` the reason; :mod:`.engine_lane`, :mod:`.responses_lane`)
STREAM_PATHS = {
    CHAT_COMPLETIONS_CREATE: (
        "chat",
        "outputs straight from the engine through vLLM's own tool-call/reasoning parser object, vLLM's chunk strings "
        "for the first, finish and first tool-call chunks (engine lane with vLLM's parser)",
        "text outputs straight from the engine, vLLM's chunk strings for the rest (engine lane)",
        "vLLM's chunk strings for every chunk (engine lane off: {})",
    ),
    RESPONSES_CREATE: (
        "Responses",
        "text and reasoning deltas straight from the engine through vLLM's own parser object and event state, "
        "vLLM's event objects for the rest (Responses lane with vLLM's parser)",
        "text deltas straight from the engine, vLLM's event objects for the rest (Responses lane)",
        "vLLM's event objects for every event (Responses lane off: {})",
    ),
}


class VLLMBackend:
    """:class:`vllm_nnrp_plugin.core.adapter.Backend` over ``app.state`` (its serving objects, ``engine_client``,
    ``openai_serving_models``) of vLLM ``vllm_version`` served by the line ``binding`` (the start-up gate's decision,
    :mod:`.gate`), serving
    ``operations`` (profile operation names; None: every operation the serving objects offer). Raises
    ``NNRPStartupError`` when ``operations`` names one this server does not serve, or what is served makes up
    no whole profile level."""

    def __init__(
        self,
        state: Any,
        operations: tuple[str, ...] | None = None,
        *,
        vllm_version: str,
        binding: Binding,
        priorities: tuple[int, ...] | None = None,
    ) -> None:
        self._engine = state.engine_client
        self._models = state.openai_serving_models
        #: vLLM ``priority`` by NNRP priority class, when the server schedules by priority (else ``None``)
        self.priorities = priorities if priorities is not None and scheduling_policy(state) == "priority" else None
        self._bindings = {
            served.name: served for served in _bindings(state, family_of(vllm_version), binding, self.priorities)
        }
        if operations is not None:
            missing = [name for name in operations if name not in self._bindings]
            if missing:
                raise NNRPStartupError(
                    f"nnrp.operations names {', '.join(missing)}, which this vLLM server does not serve (it serves: "
                    f"{', '.join(self._bindings) or 'nothing'}). Fix: drop {', '.join(missing)} from nnrp.operations, "
                    "or serve a model whose task offers it."
                )
            self._bindings = {name: binding for name, binding in self._bindings.items() if name in operations}
        try:
            self._capabilities = runtime_document(
                models=self.model_ids(),
                owned_by="vllm",
                operations=[binding.operation() for binding in self._bindings.values()],
            )
        except ValueError as exc:
            raise NNRPStartupError(f"NNRP cannot serve this vLLM server: {exc}") from None

    async def prove_lanes(self) -> None:
        """Run each streamed operation's lane self-check on the installed vLLM (:mod:`.self_check`; the chat and
        Responses bindings' ``prove_lane``), switching off the lanes that fail it; before the listener starts."""
        model = self.model_ids()[0]
        for binding in self._bindings.values():
            prove_lane = getattr(binding, "prove_lane", None)
            if prove_lane is not None:
                await prove_lane(model)

    def stream_paths(self) -> list[tuple[str, str]]:
        """(label, how its streams reach the profile mapper) per streamed operation this server serves, for the
        start-up log (:data:`STREAM_PATHS`)."""
        paths = []
        for operation, (label, with_parser, lane, off) in STREAM_PATHS.items():
            binding = self._bindings.get(operation)
            if binding is not None:
                on_lane = with_parser if binding.lane_parser else lane
                paths.append((label, on_lane if binding.lane_off is None else off.format(binding.lane_off)))
        return paths

    def priority_note(self) -> str:
        """What NNRP priority classes do on this server, for the start-up log."""
        if self.priorities is None:
            return (
                "ignored: vLLM schedules first come, first served (start vllm serve with --scheduling-policy "
                "priority to use them)"
            )
        return (
            "vLLM request priority "
            + ", ".join(f"{name} {value}" for name, value in zip(PRIORITY_CLASSES, self.priorities, strict=True))
            + " (a request body's own priority wins)"
        )

    def model_ids(self) -> list[str]:
        """Served model names (``--served-model-name``, else ``--model``)."""
        return [path.name for path in self._models.base_model_paths]

    def capabilities(self) -> dict[str, Any]:
        """The runtime capability document of this vLLM server (its configuration is fixed once it runs)."""
        return self._capabilities

    async def create(
        self,
        operation: str,
        body: dict[str, Any],
        request_id: str,
        traceparent: str | None = None,
        controls: RuntimeControls | None = None,
    ) -> Call:
        """Run ``operation`` through its binding (the adapter only dispatches advertised operations)."""
        return await self._bindings[operation].create(body, request_id, traceparent, controls)

    def engine_request_id(self, operation: str, request_id: str) -> str:
        return self._bindings[operation].engine_request_id(request_id)

    async def abort(self, operation: str, request_id: str) -> None:
        """Abort the engine request(s) (no-op if they already finished)."""
        targets = self._bindings[operation].engine_request_ids(request_id)
        if targets:
            await self._engine.abort(targets)


def scheduling_policy(state: Any) -> str:
    """vLLM's ``--scheduling-policy`` (``fcfs``, ``priority``; ``SchedulerConfig.policy``, ``vllm/config/scheduler.py``
    0.18–0.32)."""
    return str(state.vllm_config.scheduler_config.policy)


def _bindings(state: Any, family: tuple[int, int], binding: Binding, priorities: tuple[int, ...] | None) -> list[Any]:
    """The operation bindings of the serving objects ``state`` of vLLM line ``family`` (served by the line binding
    ``binding``) has, in the capability document's order."""
    bindings: list[Any] = []
    if getattr(state, "openai_serving_chat", None) is not None:
        bindings.append(ChatBinding(state.openai_serving_chat, binding, priorities))
    if getattr(state, "openai_serving_responses", None) is not None:
        bindings.append(ResponsesBinding(state.openai_serving_responses, family, binding, priorities))
    bindings.append(ModelsBinding(state.openai_serving_models))
    if getattr(state, "serving_embedding", None) is not None:
        bindings.append(EmbeddingsBinding(state.serving_embedding, priorities))
    return bindings
