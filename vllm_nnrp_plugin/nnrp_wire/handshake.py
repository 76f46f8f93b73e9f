"""How one server connection starts and how its sessions open and close (:class:`Handshake`): TRANSPORT_PROBE,
CLIENT_HELLO → SERVER_HELLO_ACK with the authentication verdict, SESSION_OPEN → the core's own rejections or
:class:`~.events.SessionOpenRequested`, the application's answer → SESSION_OPEN_ACK, and SESSION_CLOSE → the
session's operations ended or drained, then SESSION_CLOSE_ACK.

Sources: nnrp-rs ``crates/nnrp-runtime/src/server.rs`` (``accept``, hello, probe and session-open handling, the
acks' values), ``crates/nnrp-core/src/control.rs`` (``ClientHello::validate``, ``TransportProbe``),
``crates/nnrp-core/src/session.rs`` (``SessionOpen::parse``, ``SessionClose``), ``crates/nnrp-core/src/recovery.rs``
(resume);
the authentication block: :mod:`vllm_nnrp_plugin.contract.auth_block`. Byte for byte the native server of nnrp-py
1.0.0rc4.post20 where a native client can tell, with these deliberate differences:

* resume is never granted and every resume attempt is rejected (``token_ttl_ms`` and ``resume_window_ms`` 0,
  ``session_flags_ack`` 0, ``resume_token_bytes`` 0; a SESSION_OPEN carrying a token gets status rejected,
  code ``resume_rejected``, session 0 in header and metadata, a UTF-8 diagnostic body);
* ``max_concurrent_frames`` (hello), ``granted_operation_credit`` and ``max_in_flight_operations`` (open ack)
  are the connection's ``max_in_flight_per_session`` (the native server sends its 4 / 2 / 4);
* authentication (the block's encoding and ``auth_status`` values are this deployment's,
  :mod:`vllm_nnrp_plugin.contract.auth_block`): the native server neither reads ``auth_bytes`` nor sets ``auth_status``;
  here, with ``authenticate`` set, a session opens only with an accepted key (``auth_failed`` otherwise);
* session ids are unique per connection (the native registry is server-wide), never reused on it.

A malformed packet here raises :class:`~.errors.FatalError` (the connection ends without a reply, as the native
server's does); an open the server refuses gets a rejected SESSION_OPEN_ACK and the connection goes on. Plain
data: what it sends goes through the ``queue`` callable it is given; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable

from nnrp.core.enums import MessageType
from nnrp.core.messages.control import (
    ClientHelloMetadata,
    ServerHelloAckMetadata,
    SessionOpenMetadata,
    TransportProbeAckMetadata,
    TransportProbeMetadata,
)
from nnrp.runtime.types import ResultDropReasonMetadata

from ..contract.auth_block import (
    AUTH_STATUS_ACCEPTED,
    AUTH_STATUS_MISSING,
    AUTH_STATUS_NOT_REQUIRED,
    AUTH_STATUS_REJECTED,
    MAX_AUTH_BYTES,
)
from . import layouts
from .codecs import (
    CLOSE_STATUS_CLOSED,
    SESSION_ERROR_AUTH_FAILED,
    SESSION_ERROR_PROFILE_UNSUPPORTED,
    SESSION_ERROR_RESUME_REJECTED,
    SESSION_ERROR_SCHEMA_UNSUPPORTED,
    SESSION_ERROR_SESSION_LIMIT_REACHED,
    SESSION_STATUS_OPENED,
    SESSION_STATUS_REJECTED,
    SessionCloseAckMetadata,
    SessionOpenAckMetadata,
)
from .errors import FatalError, LocalProtocolError, PacketError
from .events import AuthenticationFailed, SessionClosed, SessionDraining, SessionOpenRequested
from .framing import Packet
from .layouts import ERR_STATE, ROLE_SERVER
from .operations import OperationRegistry, Session
from .session_ids import SessionIds

__all__ = ["LEASE_TTL_MS", "Handshake", "PendingOpen", "Queue"]

#: ``lease_ttl_ms`` of every SESSION_OPEN_ACK: the native server echoes its configured 30000 and enforces nothing
#: (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` session ack; cache/schema leases are not offered here)
LEASE_TTL_MS = 30_000

_T = MessageType
_IN_FLIGHT_DRAIN = 0  # SESSION_CLOSE in_flight_policy drain (nnrp-rs crates/nnrp-core/src/enums.rs InFlightPolicy)
_DROP_PEER_CANCELLED = 3  # drop_reason_code peer_cancelled (nnrp-doc runtime-control value-registries)
_DROP_REASON_STRUCT = ResultDropReasonMetadata.STRUCT
#: ``queue(msg_type, session_id, frame_id, meta, body=b"")``: append one packet to the connection's output
Queue = Callable[..., None]


class PendingOpen:
    """A SESSION_OPEN the application has not answered yet: its metadata and the requested id it reserved
    (0: none)."""

    __slots__ = ("metadata", "reserved_id")

    def __init__(self, metadata: SessionOpenMetadata, reserved_id: int) -> None:
        self.metadata = metadata
        self.reserved_id = reserved_id


class Handshake:
    """The connection start and the session opens and closes of one server connection: ``queue`` appends a
    packet to its output, ``registry`` holds its open sessions (an accepted open registers one, a close removes
    it); the other parameters are :class:`~.server.ServerConnection`'s. ``done``: the SERVER_HELLO_ACK was
    queued; ``session_ids``: the ids used on the connection (:class:`~.session_ids.SessionIds`)."""

    def __init__(
        self,
        queue: Queue,
        registry: OperationRegistry,
        *,
        credit: int,
        max_packet_bytes: int,
        profiles: tuple[int, ...],
        schemas: tuple[tuple[int, int], ...],
        authenticate: Callable[[bytes], bool] | None,
    ) -> None:
        self._queue = queue
        self._registry = registry
        self._credit = credit
        self._max_packet_bytes = max_packet_bytes
        self._profiles = frozenset(profiles)
        self._profile_bitmap = 0
        for profile in profiles:
            if 1 <= profile <= 32:
                self._profile_bitmap |= 1 << (profile - 1)
        self._schemas = frozenset(schemas)
        self._authenticate = authenticate
        #: the hello's verdict: True once a key was accepted (or none is required)
        self._authenticated = authenticate is None
        self._hello_auth_status = AUTH_STATUS_NOT_REQUIRED
        self.done = False
        self.session_ids = SessionIds()  # opened on this connection (open or closed) or reserved by a pending open
        self._pending: dict[int, PendingOpen] = {}
        self._next_request = 1
        self._ended = False

    def end(self) -> None:
        """The connection ended: pending opens are dropped, and their answers become no-ops."""
        self._ended = True
        self._pending.clear()

    def probe(self, packet: Packet) -> None:
        """TRANSPORT_PROBE → TRANSPORT_PROBE_ACK echoing ``probe_id``, ``reserved0`` 0 and ``server_recv_ts_us``
        0 (no clock in the core); ``meta_len`` 16 and ``body_len == probe_payload_bytes`` or the connection ends
        (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` probe handling, ``crates/nnrp-core/src/control.rs``
        ``TransportProbe``/``TransportProbeAck``)."""
        if packet.session_id != 0:
            raise FatalError("TRANSPORT_PROBE with a session id")
        if len(packet.meta) != TransportProbeMetadata.STRUCT.size:
            raise FatalError(f"TRANSPORT_PROBE meta_len {len(packet.meta)} (must be 16)")
        probe = TransportProbeMetadata.unpack(packet.meta)
        if len(packet.body) != probe.probe_payload_bytes:
            raise FatalError(
                f"TRANSPORT_PROBE body_len {len(packet.body)} != probe_payload_bytes {probe.probe_payload_bytes}"
            )
        self._queue(_T.TRANSPORT_PROBE_ACK, 0, 0, TransportProbeAckMetadata(probe.probe_id, 0, 0).pack())

    def hello(self, packet: Packet) -> None:
        """CLIENT_HELLO → SERVER_HELLO_ACK with the native server's values (nnrp-rs
        ``crates/nnrp-runtime/src/server.rs`` hello ack; checks of ``crates/nnrp-core/src/control.rs``
        ``ClientHello`` validation): ``meta_len`` 64 exactly, version window containing 1, wire-format bit 0,
        non-zero profile and payload-kind bitmaps, a profile in common, a body of exactly ``auth_bytes``
        (no control extension block: none is negotiated here). Any failure ends the connection with nothing
        sent, as the native server.

        The body is the authentication block (NNRP/1-preview1 §6.2.1: ``auth_block`` belongs to the body,
        after the control extension block; layout and ``auth_status`` values:
        :mod:`vllm_nnrp_plugin.contract.auth_block`).
        Without ``authenticate`` it is ignored and ``auth_status`` is 0; with it, the verdict is ``auth_status``
        (accepted, rejected, or missing), and after a failure the connection's sessions need a block of their
        own (:meth:`session_open`); a block over ``MAX_AUTH_BYTES`` or one ``authenticate`` calls malformed
        ends the connection."""
        if packet.session_id != 0:
            raise FatalError("CLIENT_HELLO with a session id")
        if len(packet.meta) != ClientHelloMetadata.STRUCT.size:
            raise FatalError(f"CLIENT_HELLO meta_len {len(packet.meta)} (must be 64)")
        hello = ClientHelloMetadata.unpack(packet.meta)
        if not hello.min_version_major <= 1 <= hello.max_version_major:
            raise FatalError(
                f"CLIENT_HELLO version window {hello.min_version_major}..{hello.max_version_major} excludes 1"
            )
        if not hello.supported_wire_format_bitmap & 1:
            raise FatalError("CLIENT_HELLO does not offer wire format 0")
        if not hello.supported_profile_bitmap or not hello.supported_payload_kind_bitmap:
            raise FatalError("CLIENT_HELLO offers no profile or no payload kind")
        if hello.control_extension_bytes:
            raise FatalError("CLIENT_HELLO declares a control extension block (none is negotiated)")
        if len(packet.body) != hello.auth_bytes:
            raise FatalError(f"CLIENT_HELLO body_len {len(packet.body)} != auth_bytes {hello.auth_bytes}")
        auth_status = self._check_auth(packet.body, "CLIENT_HELLO")
        self._hello_auth_status = auth_status
        self._authenticated = auth_status in (AUTH_STATUS_NOT_REQUIRED, AUTH_STATUS_ACCEPTED)
        accepted_profiles = hello.supported_profile_bitmap & self._profile_bitmap
        if not accepted_profiles:
            raise FatalError(
                f"CLIENT_HELLO profile bitmap {hello.supported_profile_bitmap:#x} has no profile in common"
            )
        ack = ServerHelloAckMetadata(
            selected_version_major=1,
            selected_wire_format=0,
            auth_status=auth_status,
            session_id=0,
            accepted_profile_bitmap=accepted_profiles,
            accepted_payload_kind_bitmap=hello.supported_payload_kind_bitmap,
            accepted_codec_bitmap=hello.supported_codec_bitmap,
            accepted_compression_bitmap=hello.supported_compression_bitmap,
            accepted_dtype_bitmap=hello.supported_dtype_bitmap,
            accepted_layout_bitmap=hello.supported_layout_bitmap,
            cache_digest_bitmap=hello.cache_digest_bitmap,
            cache_object_bitmap=0,  # client's AND the server's cache kinds (none)
            max_cache_entries=0,
            max_cache_bytes=0,
            max_lane_count=max(1, hello.max_lane_count),
            max_concurrent_frames=self._credit,
            target_cadence_x100=hello.target_cadence_x100,
            latency_budget_ms=hello.latency_budget_ms,
            quality_tier=hello.quality_tier,
            degrade_policy=hello.degrade_policy,
            max_body_bytes=self._max_packet_bytes,
            token_ttl_ms=0,  # resume is never granted
            retry_after_ms=0,
            control_extension_bytes=0,
            server_flags=0,
        )
        self._queue(_T.SERVER_HELLO_ACK, 0, 0, ack.pack())
        self.done = True

    def session_open(self, packet: Packet, events: list[object]) -> None:
        """SESSION_OPEN (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` session open handling,
        ``crates/nnrp-core/src/session.rs`` ``SessionOpen::parse``, ``crates/nnrp-core/src/recovery.rs``).
        Malformed (``meta_len`` ≠ 48, reserved0, unknown ``session_flags`` bits or priority, ``body_len`` ≠
        token + auth + extension lengths, session extension bytes at all, auth bytes when the server requires
        none, a malformed or oversized auth block, a token without flag 0x01 or without a requested id) → the
        connection ends. Then, answered by the core: no accepted key when one is required (neither the hello's
        nor the block after the resume token: :mod:`vllm_nnrp_plugin.contract.auth_block`) → rejected ``auth_failed``
        with :class:`~.events.AuthenticationFailed`, before anything else about the session is decided; a
        resume → rejected ``resume_rejected``;
        a profile not offered → ``profile_unsupported``; a schema not offered → ``schema_unsupported``; a
        requested id already used on this connection (or asked by a pending open) →
        ``session_limit_reached`` (the native server's code for an id in use). Otherwise
        :class:`~.events.SessionOpenRequested` for the application to accept or reject."""
        if len(packet.meta) != SessionOpenMetadata.STRUCT.size:
            raise FatalError(f"SESSION_OPEN meta_len {len(packet.meta)} (must be 48)")
        try:
            request = SessionOpenMetadata.unpack(packet.meta)
        except (ValueError, TypeError) as exc:
            raise FatalError(f"malformed SESSION_OPEN: {exc}") from None
        declared = request.resume_token_bytes + request.auth_bytes + request.session_extension_bytes
        if len(packet.body) != declared:
            raise FatalError(f"SESSION_OPEN body_len {len(packet.body)} != declared {declared}")
        if request.session_extension_bytes:
            raise FatalError("SESSION_OPEN with session extension bytes (not negotiated)")
        if request.auth_bytes and self._authenticate is None:
            raise FatalError("SESSION_OPEN with auth bytes, but this server requires no authentication (auth_status 0)")
        if self._authenticate is not None:
            block = packet.body[request.resume_token_bytes : request.resume_token_bytes + request.auth_bytes]
            if block:
                status = self._check_auth(block, "SESSION_OPEN")
            else:
                status = AUTH_STATUS_ACCEPTED if self._authenticated else self._hello_auth_status
            if status != AUTH_STATUS_ACCEPTED:
                presented = bool(block) or self._hello_auth_status == AUTH_STATUS_REJECTED
                events.append(AuthenticationFailed(presented))
                reason = "the API key is not valid" if presented else "this server requires an API key"
                self._queue_rejection(request, SESSION_ERROR_AUTH_FAILED, f"authentication failed: {reason}")
                return
        if request.resume_token_bytes:
            if not request.session_flags & 0x01 or not request.requested_session_id:
                raise FatalError("SESSION_OPEN resume token without allow_resume or without a requested session id")
            self._queue_rejection(request, SESSION_ERROR_RESUME_REJECTED, "session resume is not supported")
            return
        if request.profile_id not in self._profiles:
            self._queue_rejection(request, SESSION_ERROR_PROFILE_UNSUPPORTED, "requested profile is unsupported")
            return
        if (request.schema_id, request.schema_version) not in self._schemas:
            self._queue_rejection(request, SESSION_ERROR_SCHEMA_UNSUPPORTED, "requested schema is unsupported")
            return
        wanted = request.requested_session_id
        if wanted:
            if wanted in self.session_ids:
                self._queue_rejection(
                    request, SESSION_ERROR_SESSION_LIMIT_REACHED, "requested session id is already in use"
                )
                return
            self.session_ids.add(wanted)
        token = self._next_request
        self._next_request += 1
        self._pending[token] = PendingOpen(request, wanted)
        events.append(
            SessionOpenRequested(
                request=token,
                requested_session_id=wanted,
                profile_id=request.profile_id,
                priority_class=int(request.priority_class),
                session_flags=request.session_flags,
                schema_id=request.schema_id,
                schema_version=request.schema_version,
                default_deadline_ms=request.default_deadline_ms,
                max_in_flight_operations=request.max_in_flight_operations,
            )
        )

    def _check_auth(self, block: bytes, where: str) -> int:
        """The ``auth_status`` of ``block`` (:mod:`vllm_nnrp_plugin.contract.auth_block`); raises
        :class:`~.errors.FatalError` for a block that is oversized or that ``authenticate`` calls malformed."""
        if self._authenticate is None:
            return AUTH_STATUS_NOT_REQUIRED
        if not block:
            return AUTH_STATUS_MISSING
        if len(block) > MAX_AUTH_BYTES:
            raise FatalError(f"{where} auth block of {len(block)} bytes (at most {MAX_AUTH_BYTES})")
        try:
            accepted = self._authenticate(block)
        except ValueError as exc:
            raise FatalError(f"{where} auth block is malformed: {exc}") from None
        return AUTH_STATUS_ACCEPTED if accepted else AUTH_STATUS_REJECTED

    def _ack(self, request: SessionOpenMetadata, session_id: int, status: int, error_code: int, ext: int) -> bytes:
        return SessionOpenAckMetadata(
            session_id=session_id,
            accepted_profile_id=request.profile_id,
            accepted_priority_class=int(request.priority_class),
            session_status=status,
            schema_id=request.schema_id,
            schema_version=request.schema_version,
            granted_operation_credit=self._credit,
            max_in_flight_operations=self._credit,
            lease_ttl_ms=LEASE_TTL_MS,
            resume_window_ms=0,
            resume_token_bytes=0,
            session_extension_bytes=ext,
            server_session_tag=session_id,
            route_scope_id=0,
            session_error_code=error_code,
            session_flags_ack=0,
        ).pack()

    def _queue_rejection(self, request: SessionOpenMetadata, error_code: int, diagnostic: str) -> None:
        """A rejected SESSION_OPEN_ACK as the native server sends it: header and metadata session 0, status
        rejected, the code, the UTF-8 diagnostic as body (``session_extension_bytes``) — nnrp-rs
        ``crates/nnrp-runtime/src/server.rs`` rejection ack; the native client turns it into an open error with
        that code and keeps the connection."""
        body = diagnostic.encode("utf-8")
        self._queue(
            _T.SESSION_OPEN_ACK, 0, 0, self._ack(request, 0, SESSION_STATUS_REJECTED, error_code, len(body)), body
        )

    # -- the application's answers to SessionOpenRequested --------------------------------------------------

    def _take_pending(self, request: int) -> PendingOpen | None:
        pending = self._pending.pop(request, None)
        if pending is None:
            if self._ended and 1 <= request < self._next_request:
                return None
            raise LocalProtocolError(f"session-open request {request!r} is unknown or already answered")
        return pending

    def accept(self, request: int) -> int:
        """Queue the accepted SESSION_OPEN_ACK for ``request``, its header carrying the new session id, and return
        that id (:meth:`.server.ServerConnection.accept_session` says which); 0 when the connection ended first
        or no id is left (then a rejected ack ``session_limit_reached`` is queued)."""
        pending = self._take_pending(request)
        if pending is None:
            return 0
        session_id = pending.reserved_id or self.session_ids.allocate()
        if not session_id:
            self._queue_rejection(
                pending.metadata, SESSION_ERROR_SESSION_LIMIT_REACHED, "no session id is left on this connection"
            )
            return 0
        self._registry.open(session_id)
        self._queue(
            _T.SESSION_OPEN_ACK, session_id, 0, self._ack(pending.metadata, session_id, SESSION_STATUS_OPENED, 0, 0)
        )
        return session_id

    def reject(self, request: int, session_error_code: int, diagnostic: str) -> None:
        """Queue a rejected SESSION_OPEN_ACK for ``request``
        (:meth:`.server.ServerConnection.reject_session`)."""
        if not 0 < session_error_code <= 0xFFFFFFFF:
            raise LocalProtocolError(f"session_error_code {session_error_code!r} must be a non-zero u32")
        pending = self._take_pending(request)
        if pending is None:
            return
        if pending.reserved_id:
            # never opened: the id may still be asked for later (unless ids handed out since passed it)
            self.session_ids.discard(pending.reserved_id)
        self._queue_rejection(pending.metadata, session_error_code, diagnostic)

    # -- the client's SESSION_CLOSE ------------------------------------------------------------------------

    def close(self, session: Session, packet: Packet, events: list[object], *, drain_sessions: bool) -> None:
        """SESSION_CLOSE (the layout: :func:`.layouts.session_close`). The one SESSION_CLOSE_ACK has header
        session = the session, frame 0, close_status closed, ``last_operation_id`` echoed (nnrp-rs
        ``crates/nnrp-runtime/src/server.rs`` close ack).

        The rule, whatever the application does and in whatever order its sends come: every operation of the
        session gets its terminal **before** the ack, and nothing is ever queued for the session after it. The
        native client unregisters the session at the ack, and a later packet for it ends the whole connection,
        its other sessions included (nnrp-rs ``crates/nnrp-runtime/src/multiplex.rs`` unknown-session packets);
        the native server also sends no ack before its application has finished with the session. So no ack
        with close_status draining is ever sent (NagareWorks/nnrp-doc ``docs/en/design/v1-preview3.md`` §7.1C
        allows it; a client that already counts the session as closed could not take the terminals behind it).

        ``in_flight_policy`` says what happens to the operations still running (§7.1C):

        * nothing in flight: :class:`~.events.SessionClosed` and the ack, at once;
        * abort (1), or drain while ``drain_sessions`` is False: the core ends each operation itself, in
          submit order, with a RESULT_DROP_REASON ``peer_cancelled`` (source_role server, ``result_sequence``
          one past its last PARTIAL_RESULT, no diagnostic), then queues the ack; :class:`~.events.SessionClosed`
          follows, and every later send of the application for those operations returns False;
        * drain (0): :class:`~.events.SessionDraining`, nothing queued. The operations run on and each still
          gets its terminal from the application (partial results and controls as before; a new FRAME_SUBMIT is
          refused); right behind the last terminal the core queues the ack (the native client waits for it:
          nnrp-rs ``crates/nnrp-runtime/src/client.rs`` close handling, 30 s). A second SESSION_CLOSE while
          draining: with abort it ends the drain as above, with drain it is refused.

        Once closed, the id is never used again on this connection (a later packet for it ends the connection,
        every later send for it returns False)."""
        metadata = layouts.session_close(packet)
        sid = session.session_id
        drain = int(metadata.in_flight_policy) == _IN_FLIGHT_DRAIN
        if session.draining is not None and drain:
            raise PacketError("SESSION_CLOSE for a session that is already draining", ERR_STATE)
        if drain and session.ops and drain_sessions:
            session.draining = metadata.last_operation_id
            events.append(
                SessionDraining(sid, int(metadata.close_reason), metadata.drain_timeout_ms, tuple(session.ops))
            )
            return
        for op in self._registry.close(session):  # submit order
            self._queue(
                _T.RESULT_DROP_REASON,
                sid,
                op.frame_id,
                _DROP_REASON_STRUCT.pack(op.operation_id, op.sequence + 1, _DROP_PEER_CANCELLED, ROLE_SERVER, 0, 0, 0),
            )
        events.append(SessionClosed(sid, int(metadata.close_reason)))
        ack = SessionCloseAckMetadata(CLOSE_STATUS_CLOSED, metadata.last_operation_id).pack()
        self._queue(_T.SESSION_CLOSE_ACK, sid, 0, ack)

    def drained(self, session: Session) -> None:
        """The last operation of ``session``, draining after the client's SESSION_CLOSE, got its terminal (the
        registry closed the session): queue the closing ack right behind it, ``last_operation_id`` as the client's
        SESSION_CLOSE said."""
        assert session.draining is not None  # the registry closes only a draining session
        self._queue(
            _T.SESSION_CLOSE_ACK,
            session.session_id,
            0,
            SessionCloseAckMetadata(CLOSE_STATUS_CLOSED, session.draining).pack(),
        )
