"""What every ``vllm-nnrp`` command that runs one operation does with it, on one address
(:mod:`vllm_nnrp_plugin.client.cli`) or over a fleet (:mod:`.fleet`): show its events until the terminal and
give the exit status."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from vllm_nnrp_plugin.client.cli.say import say

__all__ = ["show_operation"]


async def show_operation(args: argparse.Namespace, printer: Any, submit: Callable[[], Any]) -> int:
    """The operation ``submit()`` gives (called here, so a connection lost as it is sent fails it as one lost
    while it runs), its events shown with ``printer`` until the terminal; the exit status: the printer's, 3 when
    no event came for ``args.timeout`` s (the operation is cancelled), 2 when the connection failed or the events
    ended without a terminal. Says why on stderr."""
    from vllm_nnrp_plugin.client.errors import ClientError
    from vllm_nnrp_plugin.client.events import operation_event

    try:
        op = submit()
        while events := await op.batch():
            last = len(events) - 1 if op.finished else -1
            for n, event in enumerate(events):
                status = printer.show(operation_event(op, event, terminal=n == last))
                if status is not None:
                    return status
    except TimeoutError:  # ClientTimeout: silent for --timeout, cancelled
        say(f"vllm-nnrp: no event for {args.timeout:g} s (--timeout); the operation was cancelled")
        return 3
    except ClientError as exc:  # the connection failed mid-operation
        say(f"vllm-nnrp: {exc}")
        return 2
    return 2
