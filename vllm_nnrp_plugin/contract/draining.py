"""How a draining replica says so on the wire, shared by the server (:meth:`vllm_nnrp_plugin.service.NNRPService.drain`)
and the fleet clients (:mod:`vllm_nnrp_plugin.client.fleet.policy`). Plain data.

A replica that drains (vLLM's shutdown on SIGTERM, ``nnrp.drain_timeout_ms``):

* refuses every new connection (its listening sockets are closed: a connect gets ``ECONNREFUSED``) and every new
  SESSION_OPEN on the connections it has (SESSION_OPEN_ACK status rejected, ``session_limit_reached``,
  diagnostic :data:`DRAINING_DIAGNOSTIC`);
* sends every open session one BACKPRESSURE with ``credit_window`` 0, ``pressure_level`` :data:`PRESSURE_LEVEL_PAUSED`
  (3, *paused*: NNRP/1 runtime-control value registry, ``pressure_level`` 0 none, 1 soft, 2 hard, 3 paused),
  ``pressure_reason`` :data:`PRESSURE_REASON_DRAINING` (this plugin's value: NNRP leaves the reason to the server)
  and ``retry_after_ms`` the grace time left;
* answers a FRAME_SUBMIT that still comes with one terminal ``response.error`` ``server_shutdown`` (status 503)
  before vLLM is asked anything, so that operation produced nothing and may be submitted elsewhere;
* lets the operations it runs finish, for at most the grace time; then the ones left end with ``server_shutdown``
  and the connections close.
"""

from __future__ import annotations

__all__ = ["DRAINING_DIAGNOSTIC", "PRESSURE_LEVEL_PAUSED", "PRESSURE_REASON_DRAINING", "is_drain_signal"]

#: BACKPRESSURE ``pressure_level`` "paused" (NNRP/1 runtime-control value registry)
PRESSURE_LEVEL_PAUSED = 3
#: BACKPRESSURE ``pressure_reason`` of a replica that drains (this plugin's value; 1 is "session credit used up")
PRESSURE_REASON_DRAINING = 2
#: the diagnostic of a SESSION_OPEN refused while the server drains or stops
DRAINING_DIAGNOSTIC = "the server is stopping"


def is_drain_signal(kind_is_backpressure: bool, credit_window: int, pressure_level: int, pressure_reason: int) -> bool:
    """True for the BACKPRESSURE a draining replica sends (module docstring): credit window 0, level paused,
    reason draining."""
    return (
        kind_is_backpressure
        and credit_window == 0
        and pressure_level == PRESSURE_LEVEL_PAUSED
        and pressure_reason == PRESSURE_REASON_DRAINING
    )
