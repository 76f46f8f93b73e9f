"""The lifecycle of one operation's backend request, as a table (no I/O, no clock reads), the way
:mod:`vllm_nnrp_plugin.core.operation` drives the operation itself.

:class:`BackendRequest` moves only through :data:`TRANSITIONS`, ``(state, input) -> (abort, new state)``:
``abort`` True asks the adapter (:mod:`vllm_nnrp_plugin.core.adapter`) to start an abort of the request now. The
inputs come from the adapter: the backend streamed its first output (``STREAM``), the owner stops the operation
(``STOP``: the abort starts in that very callback, :func:`vllm_nnrp_plugin.core.eager.start_now`), an abort was not
accepted (``REFUSED``: the engine is gone, at shutdown), the backend's stream ended (``FINISH``), and the
adapter's way out (``RELEASE``: an unfinished request is always aborted).

An abort that came while vLLM was still preparing the request may precede the engine's knowing of it, and vLLM
ignores request ids it does not know (``AsyncLLM.abort`` in ``vllm/v1/engine/async_llm.py``): one started
before the backend streamed (``ABORTING_EARLY``) is issued again on the way out, unless it was refused; one
started after (``ABORTING``) is enough.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    """Where one backend request is (:data:`TRANSITIONS`)."""

    CALLED = "called"  # handed to the backend, nothing streamed yet
    STREAMING = "streaming"  # the backend streamed: the engine knows the request
    ABORTING_EARLY = "aborting_early"  # an abort started before the backend streamed
    ABORTING = "aborting"  # an abort started once the backend streamed
    GONE = "gone"  # an abort was refused: the engine is gone, nothing is left to stop
    FINISHED = "finished"  # the backend's stream ended (or its whole result came): nothing to abort
    RELEASED = "released"  # the adapter's way out is done


class Input(enum.Enum):
    """What happens to the backend request, as the adapter sees it."""

    STREAM = "stream"  # the backend's first output
    STOP = "stop"  # the owner stops the operation
    REFUSED = "refused"  # an abort was not accepted
    FINISH = "finish"  # the backend's stream ended
    RELEASE = "release"  # the adapter's way out


_C, _S, _E, _A, _G, _F, _R = State  # in the order listed

#: The lifecycle, ``(state, input) -> (abort now, new state)``; a pair not listed changes nothing and aborts
#: nothing (the module docstring gives the rules).
TRANSITIONS: dict[tuple[State, Input], tuple[bool, State]] = {
    (_C, Input.STREAM): (False, _S),
    (_C, Input.STOP): (True, _E),
    (_S, Input.STOP): (True, _A),
    (_E, Input.REFUSED): (False, _G),
    (_C, Input.FINISH): (False, _F),
    (_S, Input.FINISH): (False, _F),
    (_E, Input.FINISH): (False, _F),
    (_A, Input.FINISH): (False, _F),
    (_G, Input.FINISH): (False, _F),
    (_C, Input.RELEASE): (True, _R),
    (_S, Input.RELEASE): (True, _R),
    (_E, Input.RELEASE): (True, _R),
    (_A, Input.RELEASE): (False, _R),
    (_G, Input.RELEASE): (False, _R),
    (_F, Input.RELEASE): (False, _R),
}


class BackendRequest:
    """One backend request's :attr:`state`, moved only through :data:`TRANSITIONS` by :meth:`step`."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = State.CALLED

    def step(self, event: Input) -> bool:
        """Take ``event`` through :data:`TRANSITIONS`: True when an abort must start now (the state moved)."""
        move = TRANSITIONS.get((self.state, event))
        if move is None:
            return False
        abort, self.state = move
        return abort
