"""Where tests put screenshots: $MOE_CHAT_SCREENSHOT_DIR when set (to look at them), else tmp_path."""

import os
from pathlib import Path


def screenshot_path(name: str, tmp_path: Path) -> Path:
    folder = Path(os.environ.get("MOE_CHAT_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def save_screenshot(widget, name: str, tmp_path: Path) -> Path:
    """Grab `widget` into `name`; the file's path."""
    path = screenshot_path(name, tmp_path)
    assert widget.grab().save(str(path))
    return path
