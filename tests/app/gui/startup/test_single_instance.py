"""A second start of the app finds the first and asks it to come to the front; a start with
another data folder is another instance and runs on its own."""

import os

import pytest

from app.gui.startup.single_instance import SingleInstance, server_name

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


def test_another_data_folder_is_another_instance(qtbot, tmp_path):
    app_id = f"moe-chat-test-{os.getpid()}"
    mine, other = tmp_path / "mine", tmp_path / "other"
    assert server_name(app_id, mine) == server_name(app_id, tmp_path / "x" / ".." / "mine")  # one folder
    assert server_name(app_id, mine) != server_name(app_id, other)
    first = SingleInstance(server_name(app_id, mine))
    assert first.listen()
    try:
        with qtbot.assertNotEmitted(first.sig_activate, wait=200):
            assert not SingleInstance(server_name(app_id, other)).ask_running_instance()
        with qtbot.waitSignal(first.sig_activate, timeout=3000):
            assert SingleInstance(server_name(app_id, mine)).ask_running_instance()
    finally:
        first.close()
