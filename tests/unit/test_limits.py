"""In-flight slots (vllm_nnrp_plugin/core/limits.py): a hard cap, refused instead of queued."""

from __future__ import annotations

import pytest

from vllm_nnrp_plugin.core.limits import Slots


def test_slots_refuse_over_capacity_and_come_back():
    slots = Slots(2)
    assert slots.try_take() and slots.try_take()
    assert not slots.try_take() and slots.used == 2
    slots.give_back()
    assert slots.try_take() and slots.used == 2


def test_giving_back_more_than_taken_is_a_bug():
    with pytest.raises(RuntimeError):
        Slots(1).give_back()
