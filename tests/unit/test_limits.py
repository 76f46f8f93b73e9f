"""In-flight slots (vllm_nnrp_plugin/limits.py): a hard cap, refused instead of queued."""

from __future__ import annotations

import threading

import pytest

from vllm_nnrp_plugin.limits import Slots


def test_slots_refuse_over_capacity_and_come_back():
    slots = Slots(2)
    assert slots.try_take() and slots.try_take()
    assert not slots.try_take() and slots.used == 2
    slots.give_back()
    assert slots.try_take() and slots.used == 2


def test_concurrent_takers_never_exceed_capacity():
    slots, taken = Slots(10), []

    def take():
        for _ in range(100):
            taken.append(slots.try_take())

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert taken.count(True) == 10 and slots.used == 10


def test_giving_back_more_than_taken_is_a_bug():
    with pytest.raises(RuntimeError):
        Slots(1).give_back()
