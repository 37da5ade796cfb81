from __future__ import annotations

import sys

import pytest

from meshyard.runtime.gil_turns import BACKGROUND_SWITCH_INTERVAL_S, ShortTurns


@pytest.fixture
def interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_turns_are_short_while_any_holder_is_in_and_restored_after_the_last(interval):
    sys.setswitchinterval(0.005)
    turns = ShortTurns()
    turns.enter()
    assert sys.getswitchinterval() == pytest.approx(BACKGROUND_SWITCH_INTERVAL_S)
    turns.enter()
    turns.leave()
    assert sys.getswitchinterval() == pytest.approx(BACKGROUND_SWITCH_INTERVAL_S)  # one holder is still in
    turns.leave()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    turns.leave()  # one leave too many changes nothing
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_interval_already_shorter_is_kept(interval):
    sys.setswitchinterval(0.0001)
    turns = ShortTurns()
    turns.enter()
    assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
    turns.leave()
    assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)


def test_an_interval_someone_else_set_meanwhile_is_left_as_they_set_it(interval):
    sys.setswitchinterval(0.005)
    turns = ShortTurns()
    turns.enter()
    sys.setswitchinterval(0.002)
    turns.leave()
    assert sys.getswitchinterval() == pytest.approx(0.002)
