"""A second start of the app finds the first and asks it to come to the front."""

import os

import pytest

from app.gui.single_instance import SingleInstance

pytestmark = pytest.mark.gui


def test_a_second_instance_activates_the_first(qtbot):
    name = f"moe-chat-test-{os.getpid()}"
    first = SingleInstance(name)
    assert not first.ask_running_instance()  # nobody is running yet
    assert first.listen()
    try:
        with qtbot.waitSignal(first.sig_activate, timeout=3000):
            assert SingleInstance(name).ask_running_instance()
    finally:
        first.close()
    assert not SingleInstance(name).ask_running_instance()  # gone with the first
