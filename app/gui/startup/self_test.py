"""`moe-chat --self-test`: is this installation (or frozen bundle) able to chat?

The engine test starts the worker the way the app does (from this executable, spawn),
loads the bundled demo model, generates a few greedy tokens and prints one line:
`self-test passed: …` with exit status 0, or `self-test FAILED: <reason>` with 1.

With `--window` it runs the whole app instead: the main window opens (offscreen when
QT_QPA_PLATFORM says so), its own engine client loads the demo model, a question is
sent through the chat view as if typed, and the reply must arrive; `--screenshot PNG`
saves the window with the reply in it. The window test uses a throwaway data and
config folder, so it never touches the user's conversations or settings.

Nothing here imports torch: the worker does.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from engine.config import OffloadConfig
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.worker.client import EngineSession
from engine.worker.protocol import ChatMessage, Finished

QUESTION = "What sound does a cow make?"
TOKENS = 8
WINDOW_TIMEOUT_S = 180.0  # the worker imports torch first: tens of seconds on a cold disk


def report(line: str) -> None:
    """Print the result line; a windowed build on Windows has no stdout, and the exit status says it."""
    if sys.stdout is not None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def engine_self_test(device: str = "auto", tokens: int = TOKENS) -> int:
    started = time.perf_counter()
    session = EngineSession()
    try:
        ready = session.start()
        loaded = session.load(None, OffloadConfig(device=device))
        config = GenerationConfig(max_new_tokens=tokens, sampling=SamplingConfig(greedy=True))
        events = session.generate([ChatMessage("user", QUESTION)], config)
        finished = [event for event in events if isinstance(event, Finished)]
    except Exception as err:  # every failure is the result, said in one line
        report(f"self-test FAILED: {type(err).__name__}: {err}")
        return 1
    finally:
        session.close()
    problem = _reply_problem(finished[0] if finished else None)
    if problem:
        report(f"self-test FAILED: {problem}")
        return 1
    reply = finished[0]
    report(
        f"self-test passed: worker {ready.pid} on {ready.device.name} ({ready.device.kind}, torch "
        f"{ready.device.torch_version}), demo model with {loaded.model.get('cache_slots')} cache slots, "
        f"{reply.completion_tokens} tokens {reply.text!r} in {time.perf_counter() - started:.1f} s"
    )
    return 0


def window_self_test(device: str = "auto", screenshot: Path | None = None) -> int:
    if not _qt_can_start():
        return 1
    from PySide6.QtCore import QTimer

    with _throwaway_profile():
        from app.gui.chat.chat_session import Reply
        from app.gui.startup.application import application
        from app.gui.window.main_window import MainWindow
        from app.settings import AppSettings

        app = application([])
        started = time.perf_counter()
        window = MainWindow()
        window.settings = AppSettings(device=device)
        outcome: dict[str, object] = {}

        def finish(status: int, line: str) -> None:
            if "status" in outcome:
                return
            outcome.update(status=status, line=line)
            if screenshot is not None and not window.grab().save(str(screenshot)):
                outcome.update(status=1, line=f"self-test FAILED: could not save {screenshot}")
            app.exit()

        def on_loaded(request_id: str, model: dict) -> None:
            window.new_conversation()
            greedy = {"temperature": 0.0, "max_new_tokens": 4 * TOKENS}
            window.store.set_settings(window.session.conversation_id, greedy)
            window.chat_view.sig_send.emit(QUESTION)

        def on_reply_ended(reply: Reply) -> None:
            if reply.finished is None:
                finish(1, f"self-test FAILED: the reply ended {reply.reason.value}: {reply.error}")
                return
            problem = _reply_problem(reply.finished)
            took = time.perf_counter() - started
            line = (
                f"self-test FAILED: {problem}"
                if problem
                else f"self-test passed: the window's engine answered {reply.text!r} in {took:.1f} s"
            )
            QTimer.singleShot(300, lambda: finish(1 if problem else 0, line))  # let the reply render

        window.client.sig_loaded.connect(on_loaded)
        window.session.sig_reply_ended.connect(on_reply_ended)
        window.client.sig_error.connect(lambda _, kind, text: finish(1, f"self-test FAILED: {kind}: {text}"))
        window.client.sig_worker_died.connect(lambda message: finish(1, f"self-test FAILED: {message}"))
        QTimer.singleShot(
            int(WINDOW_TIMEOUT_S * 1000),
            lambda: finish(1, f"self-test FAILED: no reply within {WINDOW_TIMEOUT_S:.0f} s"),
        )
        window.show()
        window.start_engine()
        app.exec()
        window.close()
        report(str(outcome["line"]))
        return int(outcome["status"])


def _qt_can_start() -> bool:
    """False (and the one line saying which packages to install) when Qt's X11 plugin cannot load."""
    from app.gui.startup.system_libs import qt_platform_problem

    problem = qt_platform_problem()
    if problem:
        report(f"self-test FAILED: {problem}")
    return problem is None


def _reply_problem(reply: Finished | None) -> str | None:
    if reply is None:
        return "the engine ended the reply without a Finished event"
    if reply.reason == "cancelled":
        return "the reply was cancelled"
    if reply.completion_tokens < 1 or not reply.text.strip():
        return f"the reply was empty ({reply.completion_tokens} tokens, reason {reply.reason})"
    return None


@contextlib.contextmanager
def _throwaway_profile() -> Iterator[None]:
    keys = ("MOE_CHAT_DATA_DIR", "MOE_CHAT_CONFIG_DIR")
    saved = {key: os.environ.get(key) for key in keys}
    with tempfile.TemporaryDirectory(prefix="moe-chat-self-test-") as folder:
        for key in keys:
            os.environ[key] = str(Path(folder) / key.lower())
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
