"""``vllm-nnrp`` over a fleet: ``--endpoint`` naming several addresses (comma-separated) runs the command's one
operation through :class:`vllm_nnrp_plugin.client.fleet.pool.FleetPool` (the replica with the most free capacity;
once more on another replica when the first went away before any event), with the exit statuses of
:mod:`vllm_nnrp_plugin.client.cli`: 0 success, 1 ``response.error``, 2 a drop or transport failure (no replica
reachable included), 3 a timeout."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from vllm_nnrp_plugin.client.cli.operation import show_operation
from vllm_nnrp_plugin.client.cli.say import reason, say
from vllm_nnrp_plugin.client.errors import AuthenticationFailed, ClientError

__all__ = ["is_fleet_endpoint", "run_on_fleet"]


def is_fleet_endpoint(endpoint: str) -> bool:
    """``--endpoint`` names several addresses (comma-separated)."""
    return "," in endpoint


async def run_on_fleet(args: argparse.Namespace, envelope: dict[str, Any], printer: Any, api_key: str | None) -> int:
    """Submit ``envelope`` over the fleet of ``args.endpoint`` with ``api_key`` (None: none) and show its events
    with ``printer`` (:func:`.operation.show_operation`, as the single-address path does); the exit status.
    ``args.timeout`` (s) bounds the wait for a replica's session and each wait for the next event."""
    from vllm_nnrp_plugin.client.fleet.pool import FleetPool

    try:
        pool = FleetPool(
            args.endpoint,
            api_key=api_key,
            tls_ca_file=args.tls_ca,  # every certificate of the PEM file, as the single-address path trusts
            priority_class=args.priority or "balanced",
        )
    except ValueError as exc:
        say(f"vllm-nnrp: {args.endpoint}: {exc}")
        return 2
    try:
        try:
            op = await asyncio.wait_for(
                pool.submit(envelope, timeout_s=args.timeout, read_timeout_s=args.timeout), args.timeout
            )
        except AuthenticationFailed:
            say(f"vllm-nnrp: {args.endpoint} requires an API key and refused this one (or none was given)")
            return 2
        except (ClientError, TimeoutError) as exc:
            say(f"vllm-nnrp: cannot reach the fleet {args.endpoint}: {reason(exc)}")
            return 2
        return await show_operation(args, printer, lambda: op)
    finally:
        await pool.aclose()
