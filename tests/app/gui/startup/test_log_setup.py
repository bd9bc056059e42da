"""The desktop app's logging: one line per warning on the console, never a traceback; the
details (tracebacks, debug records) in the log file."""

import logging

import pytest

from app.gui.startup.log_setup import setup_logging


@pytest.fixture
def root_handlers():
    root = logging.getLogger()
    kept, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in kept:
        root.addHandler(handler)
    root.setLevel(level)


def test_an_expected_failure_is_one_console_line_and_its_traceback_goes_to_the_file(
    tmp_path, capfd, root_handlers
):
    path = setup_logging(verbose=False, folder=tmp_path)
    log = logging.getLogger("app.gui.models.downloads")
    log.info("not on the console")
    log.debug("Details of the failed download of o/m:\nTraceback (most recent call last):\n  ...")
    try:
        raise ConnectionRefusedError(111, "Connection refused")
    except ConnectionRefusedError:
        log.warning("Download of o/m failed: the Hub refused the connection.", exc_info=True)
    logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
    err = capfd.readouterr().err
    line = "moe-chat: Download of o/m failed: the Hub refused the connection."
    assert err == f"{line} (details in the log file {path})\n"
    written = path.read_text()
    assert "Traceback" in written and "ConnectionRefusedError" in written
    assert "Details of the failed download of o/m" in written and "not on the console" in written
    assert "Retrying in 1s" in written  # a library's warning: in the file, not on the console
