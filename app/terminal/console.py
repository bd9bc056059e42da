"""The terminal around the chat: how messages are read and replies shown.

On a terminal (stdin and stdout both TTYs) the chat reads with prompt_toolkit
(line editing, history kept in the app's data folder, Alt+Enter for a new line,
a `\"\"\"` block for several lines) and renders each reply as markdown with rich
while it streams. Anywhere else (pipes, files, tests) it reads plain lines and
writes the reply's text as it comes, so scripts see exactly what the model said;
a `\"\"\"` block spans lines there too.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

FENCE = '"""'
PROMPT = "you> "
CONTINUATION = "...  "
HISTORY_FILE = "cli-history"


def history_path() -> Path:
    """`<the app's data folder>/cli-history` ($MOE_CHAT_DATA_DIR overrides the folder)."""
    from app.storage import default_path

    return default_path().parent / HISTORY_FILE


def opens_block(text: str) -> bool:
    """Whether `text` starts a `\"\"\"` block that is not closed yet."""
    stripped = text.strip()
    if not stripped.startswith(FENCE):
        return False
    return len(stripped) < 2 * len(FENCE) or not stripped.endswith(FENCE)


def unfence(text: str) -> str:
    """The message inside a `\"\"\"` block (the text itself when it is not one)."""
    stripped = text.strip()
    if stripped.startswith(FENCE) and stripped.endswith(FENCE) and len(stripped) >= 2 * len(FENCE):
        return stripped[len(FENCE) : -len(FENCE)].strip("\n")
    return text


class PlainReader:
    """Lines from a pipe or file; a `\"\"\"` block is read up to its closing line."""

    def __init__(self, stdin: TextIO):
        self.stdin = stdin

    def read(self) -> str:
        text = self._line()
        while opens_block(text):
            text += "\n" + self._line().rstrip("\n")
        return unfence(text.strip())

    def _line(self) -> str:
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")


class PromptReader:
    """prompt_toolkit's line editor: history on disk, Enter sends, Alt+Enter (or a `\"\"\"` block)
    goes on to a new line. Ctrl-D raises EOFError and Ctrl-C KeyboardInterrupt, as input() does."""

    def __init__(self, history: Path):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory
        from prompt_toolkit.key_binding import KeyBindings

        bindings = KeyBindings()

        @bindings.add("enter")
        def _send(event) -> None:
            buffer = event.current_buffer
            if opens_block(buffer.text):
                buffer.insert_text("\n")
            else:
                buffer.validate_and_handle()

        @bindings.add("escape", "enter")  # Alt+Enter
        def _new_line(event) -> None:
            event.current_buffer.insert_text("\n")

        history.parent.mkdir(parents=True, exist_ok=True)
        self.session = PromptSession(
            history=FileHistory(str(history)),
            multiline=True,
            key_bindings=bindings,
            prompt_continuation=CONTINUATION,
        )

    def read(self) -> str:
        return unfence(self.session.prompt(PROMPT).strip())


class PlainReply:
    """The reply's text as it streams, then a newline."""

    def __init__(self, stdout: TextIO):
        self.stdout = stdout
        self.open = False  # part of a reply is out, without its newline

    def add(self, text: str) -> None:
        if text:
            self.stdout.write(text)
            self.stdout.flush()
            self.open = True

    def finish(self, tail: str) -> None:
        self.stdout.write(tail + "\n")
        self.stdout.flush()
        self.open = False

    def cut(self) -> None:
        """End a reply cut short (cancelled, failed), if any of it was written."""
        if self.open:
            self.finish("")


class MarkdownReply:
    """The reply rendered as markdown (rich) as it streams. The rendered lines above the last
    `LIVE_LINES` are printed once, for good; only those last lines are a live display, redrawn at
    most `REDRAW_S` apart. (A live display of the whole reply redraws what has scrolled off the top
    of the terminal, so a reply taller than the terminal came out twice: Textualize/rich#3263.)"""

    LIVE_LINES = 6
    REDRAW_S = 0.125

    def __init__(self, stdout: TextIO, console=None):
        from rich.console import Console

        self.console = console or Console(file=stdout)
        self.text = ""
        self.live = None
        self.printed = 0  # rendered lines printed for good
        self.drawn_at = 0.0

    def add(self, text: str) -> None:
        from rich.live import Live

        self.text += text
        if self.live is None:
            self.live = Live(console=self.console, auto_refresh=False)
            self.live.start()
        if time.monotonic() - self.drawn_at >= self.REDRAW_S:
            self._draw(keep_live=self.LIVE_LINES)

    def finish(self, tail: str) -> None:
        from rich.markdown import Markdown

        self.text += tail
        if self.live is None:
            self.console.print(Markdown(self.text))
        else:
            self._draw(keep_live=0)
            self.live.stop()
        self.text, self.live, self.printed = "", None, 0

    def cut(self) -> None:
        if self.live is not None:
            self.finish("")

    def _draw(self, keep_live: int) -> None:
        from rich.text import Text

        lines = self._rendered()
        settled = max(len(lines) - keep_live, self.printed)
        if settled > self.printed:  # printed above the live display, never redrawn
            self.live.console.print(Text.from_ansi("\n".join(lines[self.printed : settled])))
            self.printed = settled
        self.live.update(Text.from_ansi("\n".join(lines[settled:])), refresh=True)
        self.drawn_at = time.monotonic()

    def _rendered(self) -> list[str]:
        """The whole reply's markdown as the terminal's lines (with their colour codes)."""
        from rich.console import Console
        from rich.markdown import Markdown

        out = io.StringIO()
        console = self.console
        Console(
            file=out,
            width=console.width,
            force_terminal=console.is_terminal,
            color_system=console.color_system,
            legacy_windows=False,
        ).print(Markdown(self.text))
        return out.getvalue().splitlines()


class RichLoadProgress:
    """A rich progress bar per loading stage on stderr (`LoadProgress` events)."""

    def __init__(self, stream: TextIO):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (
            TextColumn("{task.description:<8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        self.progress = Progress(*columns, console=Console(file=stream), transient=False)
        self.tasks: dict[str, int] = {}
        self.progress.start()

    def __call__(self, event) -> None:
        if event.stage not in self.tasks:
            self.tasks[event.stage] = self.progress.add_task(event.stage, total=event.total or None)
        self.progress.update(self.tasks[event.stage], completed=event.done, total=event.total or None)

    def close(self) -> None:
        self.progress.stop()


def make_console(stdin: TextIO, stdout: TextIO, interactive: bool) -> tuple[Callable[[], str], object]:
    """(read a message, the reply renderer) for a terminal or for plain streams."""
    if interactive:
        return PromptReader(history_path()).read, MarkdownReply(stdout)
    return PlainReader(stdin).read, PlainReply(stdout)
