"""Where the desktop app's log records go: the console gets one line each, the log file everything.

`setup_logging(verbose, folder)`:
- the console (stderr) shows warnings (info with -v) of MoE Chat's own loggers, and errors of any
  library, as one line each: never a traceback. A record that carries one says where the log
  file is instead, so an expected failure (offline, HTTP 429 …) reads as a sentence, not a crash;
- the log file (`<data dir>/logs/moe-chat.log`, rotated at 2 MB, three kept) has MoE Chat's
  records down to debug with their tracebacks (the details behind the picker's "Details…"),
  and the libraries' from info up.

Qt-free; it lives with the GUI because only the window's process sets it up this way.
"""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

from app.model_library import data_dir

LOG_NAME = "moe-chat.log"
LOG_BYTES = 2 * 2**20
LOG_BACKUPS = 3
OWN_LOGGERS = ("app", "engine", "__main__")
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ConsoleFormatter(logging.Formatter):
    """`moe-chat: message`, one line; a traceback is replaced by where the log file is."""

    def __init__(self, log_file: Path | None):
        super().__init__()
        self.log_file = log_file

    def format(self, record: logging.LogRecord) -> str:
        lines = record.getMessage().splitlines()
        line = f"moe-chat: {lines[0] if lines else ''}"
        if record.exc_info or record.exc_text or len(lines) > 1:
            where = (
                f"the log file {self.log_file}" if self.log_file else "no log file: it could not be written"
            )
            line += f" (details in {where})"
        return line


def _for_the_console(record: logging.LogRecord) -> bool:
    own = record.name == "root" or record.name.split(".")[0] in OWN_LOGGERS
    return own or record.levelno >= logging.ERROR


def log_file_path(folder: Path | None = None) -> Path:
    return (folder or data_dir() / "logs") / LOG_NAME


def setup_logging(verbose: bool = False, folder: Path | None = None) -> Path | None:
    """Install the console and file handlers on the root logger; the log file's path (None if it
    cannot be written: then only the console logs)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    path: Path | None = log_file_path(folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.handlers.RotatingFileHandler(
            path, maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS, encoding="utf-8"
        )
    except OSError:
        path = None
    else:
        to_file.setLevel(logging.DEBUG)
        to_file.setFormatter(logging.Formatter(FILE_FORMAT))
        root.addHandler(to_file)
    console = logging.StreamHandler()
    console.setLevel(logging.INFO if verbose else logging.WARNING)
    console.setFormatter(ConsoleFormatter(path))
    console.addFilter(_for_the_console)
    root.addHandler(console)
    root.setLevel(logging.INFO)
    for name in OWN_LOGGERS[:2]:
        logging.getLogger(name).setLevel(logging.DEBUG)
    return path
