"""What NNRP's runtime controls ask of one operation's backend request, and what the engine reported back.

One :class:`RuntimeControls` per operation, made at submit with its session's priority class and owned by vLLM's
event loop: the session policy writes the controls that came off the wire, the adapter decides the dispatch with
them, and the backend binding reads them while the request runs and writes what the engine reported.

* **Priority class** (NNRP/1 ``priority_class``: 0 interactive, 1 balanced, 2 background; nnrp-rs
  ``crates/nnrp-core/src/enums.rs`` ``PriorityClass``): the operation's own — the envelope's
  ``nnrp.priority_class``, then a PRIORITY_UPDATE, the later one winning — else its session's (SESSION_OPEN).
  It is fixed when the operation is dispatched: the backend cannot change a request's priority once it has it
  (:func:`vllm_nnrp_plugin.vllm_binding.serving.with_controls` says why for vLLM), so a PRIORITY_UPDATE after
  dispatch is only counted (:attr:`late_priority_updates`).
* **Token budget** (BUDGET_UPDATE ``token_budget``, tokens; 0 carries no token budget): the lowest one wins, as
  the earliest deadline does; a higher one changes nothing (the body's ``max_tokens`` is never raised, nor can a
  running request's be). Before dispatch it caps the request's ``max_tokens``; after, the backend ends the
  request's stream at it (finish ``length``).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

#: NNRP priority class names, by class value
PRIORITY_CLASSES = ("interactive", "balanced", "background")
BALANCED = 1


def priority_class_of(name: str) -> int:
    """The class value of ``name`` (``interactive``, ``balanced``, ``background``); raises ``ValueError``."""
    try:
        return PRIORITY_CLASSES.index(name)
    except (ValueError, TypeError):
        raise ValueError(f"unknown priority class {name!r}; one of {', '.join(PRIORITY_CLASSES)}") from None


@attrs.define(slots=True)
class RuntimeControls:
    """One operation's runtime controls (module docstring). ``session_class``: the session's priority class."""

    session_class: int = BALANCED
    own_class: int | None = None
    #: tokens; None: none set
    token_budget: int | None = None
    #: PRIORITY_UPDATEs that came once the operation had left ADMITTED (dispatched, or ended before): vLLM
    #: cannot apply them
    late_priority_updates: int = 0
    # -- what the backend binding reports -------------------------------------------------------------------
    #: the ``priority`` vLLM's request ran with (None: the server does not schedule by priority)
    vllm_priority: int | None = None
    #: the engine produced the request's first output
    engine_started: bool = False
    #: prompt tokens served from vLLM's prefix cache (``RequestOutput.num_cached_tokens``)
    cached_tokens: int | None = None
    #: the binding ended the stream at :attr:`token_budget`
    budget_ended: bool = False
    #: what the operation's lifecycle decides when the budget ends the stream (True: abort the backend request
    #: now); ``None``: no operation owns these controls, the request is aborted
    on_budget_end: Callable[[], bool] | None = None

    def end_at_budget(self) -> bool:
        """The binding ends the stream at :attr:`token_budget`: recorded, and True when the backend request must
        be aborted at once (:attr:`on_budget_end`, the operation's ``BUDGET`` input)."""
        self.budget_ended = True
        return self.on_budget_end is None or self.on_budget_end()

    @property
    def priority_class(self) -> int:
        """The class the operation runs in: its own, else its session's."""
        return self.own_class if self.own_class is not None else self.session_class

    def update_priority(self, priority_class: int, *, dispatched: bool = False) -> bool:
        """A PRIORITY_UPDATE (or the envelope's class): True when it applies, i.e. before dispatch
        (``dispatched``: what the operation's lifecycle says, :attr:`.operation.Operation.dispatched`)."""
        if dispatched:
            self.late_priority_updates += 1
            return False
        self.own_class = priority_class
        return True

    def lower_budget(self, token_budget: int) -> bool:
        """A BUDGET_UPDATE's ``token_budget`` (tokens; 0: none): True when it lowered the budget."""
        if token_budget <= 0 or (self.token_budget is not None and token_budget >= self.token_budget):
            return False
        self.token_budget = token_budget
        return True
