"""Repeated hypothesis runs for the coverage checks of the fuzz tests.

A fuzz test proves its generator reached what it is there for by counting over its examples, and runs again
(fresh examples, every invariant still checked) while something is missing. Under a derandomized settings
profile — hypothesis loads its ``ci`` profile, ``derandomize=True``, whenever the ``CI`` environment variable is
set (hypothesis documentation, "Settings profiles") — every run of a test draws the same examples, so a repeat
would add nothing: there each round runs with its own fixed seed (the round number), and a failure in CI
reproduces locally with ``CI=true``. Otherwise hypothesis draws at random as usual.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import seed, settings


def run_until(fuzz: Callable[[], None], rounds: int, covered: Callable[[], bool]) -> int:
    """Run the ``@given`` test ``fuzz`` (a failing example raises) until ``covered()`` holds, at most ``rounds``
    times; return how many runs were made."""
    for run in range(1, rounds + 1):
        if settings.default.derandomize:
            seed(run)(fuzz)
        fuzz()
        if covered():
            return run
    return rounds
