"""`moe-chat --self-test`: the engine check and the whole-window check, from source."""

import os
import subprocess
import sys

import pytest

from tests.screenshots import screenshot_path

pytestmark = pytest.mark.slow


def run_app(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )


def result_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"one result line, not stdout={done.stdout!r} stderr={done.stderr[-800:]!r}"
    return lines[0]


def test_self_test_loads_the_demo_and_generates(tmp_path):
    done = run_app("--self-test", "--device", "cpu")
    line = result_line(done)
    assert done.returncode == 0, line
    assert line.startswith("self-test passed: worker ")
    assert "(cpu, torch " in line and "'A cow says moo.'" in line


def test_self_test_fails_with_the_reason_when_the_demo_is_missing(tmp_path):
    done = run_app("--self-test", "--device", "cpu", env={"MOE_CHAT_RESOURCES": str(tmp_path)})
    line = result_line(done)
    assert done.returncode == 1
    assert line.startswith("self-test FAILED: ")
    assert str(tmp_path / "demo-moe" / "target") in line


@pytest.mark.gui
def test_window_self_test_answers_in_the_window_without_touching_user_data(tmp_path):
    user_data, user_config = tmp_path / "data", tmp_path / "config"
    shot = screenshot_path("self_test_window.png", tmp_path)
    shot.unlink(missing_ok=True)
    env = {"MOE_CHAT_DATA_DIR": str(user_data), "MOE_CHAT_CONFIG_DIR": str(user_config)}
    done = run_app("--self-test", "--window", "--device", "cpu", "--screenshot", str(shot), env=env)
    line = result_line(done)
    assert done.returncode == 0, line
    assert line.startswith("self-test passed: the window's engine answered 'A cow says moo.'")
    assert shot.stat().st_size > 10_000  # a real 1280×800 window, not an empty image
    assert not user_data.exists() and not user_config.exists()


def test_window_options_need_self_test():
    done = run_app("--window")
    assert done.returncode == 2
    assert "--window and --screenshot go with --self-test" in done.stderr
