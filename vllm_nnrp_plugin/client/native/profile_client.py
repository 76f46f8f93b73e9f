"""A small ``openai-compatible/1`` client over nnrp-py's native client (used by ``vllm-nnrp``, the conformance
driver and the tests, as the oracle of nnrp-py's own client). One session, no fan-out: more operations at once
than the session's ``max_in_flight_per_session`` get ``too_many_requests`` (the ``openai`` transports fan out,
:mod:`vllm_nnrp_plugin.client.aio.pool`).

::

    client = await ProfileClient.connect("tcp://127.0.0.1:9400")
    op = client.submit({"schema_version": "openai-compatible/1", "operation": "chat.completions.create",
                        "body": {"messages": [...], "stream": True}})
    for event in client.events(op, timeout_s=60):
        ...   # ClientEvent: partial events in order, then exactly one terminal
    client.close()

NNRP runtime metadata: ``connect(..., priority_class=…)`` opens the session with that priority class;
``submit(..., deadline_ms=N)`` sends a DEADLINE control (now + N ms, wall clock) for the operation right after its
submit; ``update_priority`` / ``supersede`` / ``update_budget`` send PRIORITY_UPDATE / SUPERSEDE / BUDGET_UPDATE
for a running operation (nnrp-py's ``update_runtime_priority``, ``supersede_runtime_operation``,
``update_runtime_budget``; ``control_sequence`` counted per operation from 1); ``trace_context(...)`` sends a
TRACE_CONTEXT (session scope, or one operation's); ``capabilities()`` fetches the server's capability document
(operation ``nnrp.capabilities``).

Errors (:mod:`vllm_nnrp_plugin.client.errors`): every failure is a :class:`ClientError` —
:class:`ClientAddressError` (an unusable endpoint URI), :class:`ClientTransportError` (nnrp-py's native layer
failed a call: connect, open session, submit, control, poll), :class:`ClientTimeout` (no terminal in time),
:class:`ClientResponseError` (the server answered, but not as asked). nnrp-py's own exceptions never leave this
module.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

import orjson
from nnrp.client import (
    NativeClientOptions,
    NativeClientProviderRoute,
    NativeClientSessionOptions,
    SubmitIdentity,
    SubmitPolicy,
    SubmitRequest,
    TypedPayloadInputFrame,
    TypedPayloadSubmitInput,
    connect_native_client_connection,
)
from nnrp.core import MessageType, PayloadKind, TransportPolicy
from nnrp.native import (
    NativeArtifactError,
    NativeInvalidStateError,
    NativeRuntimeError,
    NativeTransportClientSecurity,
)
from nnrp.runtime import TraceContextMetadata
from nnrp.schema import StreamSemantics

from vllm_nnrp_plugin.client.errors import (
    ClientAddressError,
    ClientError,
    ClientResponseError,
    ClientTimeout,
    ClientTransportError,
)
from vllm_nnrp_plugin.client.events import ClientEvent
from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.contract.endpoints import EndpointError, parse_endpoint
from vllm_nnrp_plugin.core.controls import priority_class_of
from vllm_nnrp_plugin.profile import SCHEMA_VERSION
from vllm_nnrp_plugin.profile.capabilities import CAPABILITIES_OPERATION

_POLICY = {
    "tcp": TransportPolicy.FORCE_TCP,
    "ipc": TransportPolicy.FORCE_IPC,
    "websocket": TransportPolicy.FORCE_WEBSOCKET,
    "quic": TransportPolicy.FORCE_QUIC,
}


@contextlib.contextmanager
def _native(action: str) -> Iterator[None]:
    """Raise nnrp-py's failures of ``action`` as :class:`ClientTransportError`."""
    try:
        yield
    except (NativeRuntimeError, NativeArtifactError) as exc:
        if isinstance(exc, ClientError):
            raise
        raise ClientTransportError(f"{action}: {exc}", getattr(exc, "status", None)) from exc


class ProfileClient:
    """One NNRP connection with one session. Not thread-safe; one caller at a time."""

    def __init__(self, stack: contextlib.ExitStack, connection: Any, session: Any) -> None:
        self._stack = stack
        self.connection = connection
        self.session = session
        self._ids = itertools.count(1)
        self._sequences: dict[int, int] = {}  # operation id → last control_sequence sent for it
        self._pending: dict[int, collections.deque[ClientEvent]] = collections.defaultdict(collections.deque)

    @classmethod
    async def connect(
        cls, uri: str, *, trusted_cert_der: bytes | None = None, priority_class: str = "balanced"
    ) -> ProfileClient:
        """Connect to any URI of :mod:`vllm_nnrp_plugin.contract.endpoints` and open a session.
        TLS URIs (``nnrps``, ``wss``, ``quic``) need ``trusted_cert_der``: the server certificate (or its CA), DER.
        ``priority_class``: the session's, ``"interactive"`` / ``"balanced"`` / ``"background"`` (SESSION_OPEN
        ``priority_class`` 0 / 1 / 2 through nnrp-py's ``NativeClientSessionOptions``; its other options are
        nnrp-py's defaults). Raises ``ValueError`` for another class, :class:`ClientAddressError`, or
        :class:`ClientTransportError` when nothing answers or the server refuses the session (e.g. over its
        ``max_sessions``)."""
        priority_class_of(priority_class)  # nnrp-py's NativeSessionPriorityClass uses the same names
        session_options = NativeClientSessionOptions(priority_class=priority_class)
        try:
            carrier = parse_endpoint(uri)
        except EndpointError as exc:
            raise ClientAddressError(str(exc)) from None
        security = None
        if carrier.tls:
            if trusted_cert_der is None:
                raise ClientAddressError(f"{uri} uses TLS: pass trusted_cert_der")
            security = NativeTransportClientSecurity(server_name=carrier.host, trusted_certificate_der=trusted_cert_der)
        stack = contextlib.ExitStack()
        with _native(f"cannot connect to {uri}"):
            connection = stack.enter_context(
                connect_native_client_connection(
                    NativeClientOptions(
                        endpoint=carrier.endpoint,
                        provider_routes={
                            carrier.transport: NativeClientProviderRoute(
                                provider_endpoint=carrier.provider_uri, security=security
                            )
                        },
                        transport_policy=_POLICY[carrier.transport],
                    )
                )
            )
        try:
            with _native(f"{uri} did not open a session"):
                session = await connection.open_session(session_options)
        except BaseException:
            stack.close()
            raise
        return cls(stack, connection, session)

    def submit(self, envelope: dict[str, Any] | bytes, *, deadline_ms: int | None = None) -> Any:
        """Submit one envelope (a dict, or raw bytes sent as they are); returns the native operation.

        ``deadline_ms``: send an NNRP DEADLINE control (``deadline_unix_ms`` = now + ``deadline_ms``) for the
        operation right after the submit (nnrp-py accepts controls for active operations only). Raises
        :class:`ClientTransportError`."""
        payload = envelope if isinstance(envelope, bytes) else orjson.dumps(envelope)
        operation_id = next(self._ids)
        deadline_unix_ms = None if deadline_ms is None else time.time_ns() // 1_000_000 + deadline_ms
        request = SubmitRequest.typed_payload(
            TypedPayloadSubmitInput(
                identity=SubmitIdentity(operation_id=operation_id, frame_id=operation_id),
                policy=SubmitPolicy(),
                frames=(
                    TypedPayloadInputFrame(
                        profile_id=0,
                        payload_kind=PayloadKind.STRUCTURED_EVENT,
                        payload=payload,
                        stream_semantics=StreamSemantics.SNAPSHOT,
                    ),
                ),
            )
        )
        with _native(f"submit of operation {operation_id} failed"):
            operation = self.session.submit_operation(request)
            if deadline_unix_ms is not None:
                self.connection.update_runtime_deadline(
                    self.session,
                    operation_id=operation_id,
                    control_sequence=self._sequence(operation_id),
                    deadline_unix_ms=deadline_unix_ms,
                )
        return operation

    def update_priority(self, op: Any, priority_class: str) -> None:
        """PRIORITY_UPDATE for ``op``: ``priority_class`` ``"interactive"`` / ``"balanced"`` / ``"background"``,
        delta 0. Raises ``ValueError`` for another class, :class:`ClientTransportError` (e.g. ``op`` finished)."""
        code = priority_class_of(priority_class)
        with _native(f"PRIORITY_UPDATE of operation {op.operation_id} failed"):
            self.connection.update_runtime_priority(
                self.session,
                operation_id=op.operation_id,
                control_sequence=self._sequence(op.operation_id),
                priority_class=code,
            )

    def supersede(self, op: Any, new: Any = None) -> None:
        """SUPERSEDE of ``op`` by ``new`` (another operation of this client, or None: new_operation_id 0), drop
        reason superseded; ``op``'s terminal is then a drop (``reason`` ``superseded``). Raises
        :class:`ClientTransportError`."""
        with _native(f"SUPERSEDE of operation {op.operation_id} failed"):
            self.connection.supersede_runtime_operation(
                self.session,
                old_operation_id=op.operation_id,
                new_operation_id=0 if new is None else new.operation_id,
                control_sequence=self._sequence(op.operation_id),
            )

    def update_budget(self, op: Any, tokens: int) -> None:
        """BUDGET_UPDATE for ``op``: ``token_budget`` = ``tokens`` (1..2**32-1), the other budgets 0. Raises
        ``ValueError`` out of range, :class:`ClientTransportError`."""
        if not 0 < tokens < 1 << 32:
            raise ValueError(f"token budget {tokens!r} must be in 1..2**32-1")
        with _native(f"BUDGET_UPDATE of operation {op.operation_id} failed"):
            self.connection.update_runtime_budget(self.session, operation_id=op.operation_id, token_budget=tokens)

    def _sequence(self, operation_id: int) -> int:
        """The next ``control_sequence`` of ``operation_id`` (from 1; forgotten at its terminal)."""
        sequence = self._sequences[operation_id] = self._sequences.get(operation_id, 0) + 1
        return sequence

    def trace_context(
        self,
        trace_id: int,
        span_id: int,
        *,
        parent_span_id: int = 0,
        stage_code: int = 0,
        flags: int = 1,
        attributes: bytes = b"",
        op: Any = None,
    ) -> None:
        """Send a TRACE_CONTEXT: session scope (default for operations dispatched later), or ``op``'s scope
        (only while ``op`` is active). ``flags`` bit 0 = sampled; ``attributes`` is the opaque body."""
        metadata = TraceContextMetadata(trace_id, span_id, parent_span_id, stage_code, flags, len(attributes))
        with _native("TRACE_CONTEXT not sent"):
            self.session.send_trace_context(metadata, attributes, operation_id=None if op is None else op.operation_id)

    def capabilities(self, *, timeout_s: float = 30.0) -> dict[str, Any]:
        """The server's runtime capability document. Raises :class:`ClientTimeout`,
        :class:`ClientTransportError`, or :class:`ClientResponseError` when the server answers with anything
        but ``response.completed``."""
        operation = self.submit({"schema_version": SCHEMA_VERSION, "operation": CAPABILITIES_OPERATION, "body": {}})
        terminal = list(self.events(operation, timeout_s=timeout_s))[-1]
        if terminal.event is None or terminal.event.get("type") != "response.completed":
            raise ClientResponseError(f"capability fetch failed: {terminal.event}")
        return terminal.event["body"]

    def cancel(self, op: Any) -> None:
        """FRAME_CANCEL for ``op``; its terminal is then a PEER_CANCELLED drop. Raises
        :class:`ClientTransportError` (e.g. ``op`` already finished)."""
        with _native(f"cancel of operation {op.operation_id} failed"):
            self.connection.cancel_operation(op)

    def events(self, op: Any, *, timeout_s: float) -> Iterator[ClientEvent]:
        """Yield ``op``'s events in order, ending with its terminal. Raises :class:`ClientTimeout`,
        :class:`ClientTransportError`."""
        deadline = time.monotonic() + timeout_s
        queue = self._pending[op.operation_id]
        while True:
            while queue:
                event = queue.popleft()
                yield event
                if event.terminal:
                    self._pending.pop(op.operation_id, None)
                    return
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise ClientTimeout(f"no terminal for operation {op.operation_id} within {timeout_s} s")
            self._poll(min(remaining_ms, 100))

    def close(self) -> None:
        """Close the session cleanly (the server sees SESSION_CLOSE), then the connection. A server that is
        already gone makes both fail with 3/4/0/105; there is nothing left to close then."""
        with contextlib.suppress(NativeRuntimeError):
            self.session.close()
        with contextlib.suppress(NativeRuntimeError):
            self._stack.close()

    def poll(self, timeout_ms: int) -> list[tuple[int, ClientEvent]]:
        """Wait up to ``timeout_ms`` ms for the next frame of any operation of this session; returns
        ``[(operation_id, event)]`` (empty on timeout). For callers that multiplex operations themselves;
        don't mix it with :meth:`events` on the same client."""
        try:
            polled = self.session.poll_events(max_events=1, timeout_ms=timeout_ms)
        except NativeInvalidStateError:
            # nnrp-py refuses a partial result still in flight after our own FRAME_CANCEL (it reports an
            # invalid state); the drop follows
            return []
        except NativeRuntimeError as exc:  # not _native(): a plain try costs nothing on this hot path
            raise ClientTransportError(f"poll failed: {exc}", exc.status) from exc
        out = []
        for raw in polled:
            header = getattr(raw, "header", None)
            if header is None:
                continue  # lifecycle notifications; the runtime frames carry the results
            event = _decode(header.message_type, raw)
            if event is not None:
                # frame_id == operation_id for every operation this client submits
                out.append((header.frame_id, event))
                if event.terminal:
                    self._sequences.pop(header.frame_id, None)
        return out

    def _poll(self, timeout_ms: int) -> None:
        for operation_id, event in self.poll(timeout_ms):
            self._pending[operation_id].append(event)


def _decode(kind: MessageType, raw: Any) -> ClientEvent | None:
    metadata = raw.metadata.value
    if kind is MessageType.PARTIAL_RESULT:
        return ClientEvent("partial_result", orjson.loads(raw.tail.body))
    if kind is MessageType.RESULT_PUSH:
        kinds, count = int(metadata.payload_kind_bitmap), metadata.payload_frame_count
        body = wire_mapping.unwrap_typed_body(kinds, count, raw.tail.body)
        return ClientEvent("result_push", orjson.loads(body), status=metadata.status_code)
    if kind is MessageType.RESULT_DROP_REASON:
        diagnostic = raw.tail.diagnostic
        event = orjson.loads(diagnostic) if diagnostic else None
        return ClientEvent("result_drop", event, drop_reason=int(metadata.drop_reason_code))
    return None
