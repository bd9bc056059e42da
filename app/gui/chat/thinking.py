"""A reply's thinking: how long and how many tokens it took, and the collapsed panel that shows it.

Models that think in a `<think>` block (Qwen3, QwQ, DeepSeek-R1, GLM-4.5) stream their reasoning
before the answer; the engine sends it apart (`ReplyText.reasoning`). `Thinking` times it on the
GUI's clock from its first streamed piece to the answer's first, counts the tokens that carried it,
and gives the panel's one-line header. `ThinkingPanel` sits at the top of a reply bubble: a header
button with an arrow, the text under it collapsed until clicked (live while it streams).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QLabel, QToolButton, QVBoxLayout, QWidget


@dataclass
class Thinking:
    """The thinking of one reply so far, on the GUI's monotonic clock."""

    tokens: int = 0
    started: float | None = None
    ended: float | None = None  # the answer's first text

    def saw(self, event) -> None:
        """A `ReplyText` arrived."""
        now = time.monotonic()
        if event.reasoning and self.started is None:
            self.started = now
        self.tokens += event.reasoning_tokens
        if event.text and self.started is not None and self.ended is None:
            self.ended = now

    def seconds(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended if self.ended is not None else time.monotonic()) - self.started

    def label(self) -> str:
        """The panel's header: "" before any thinking."""
        if self.started is None:
            return ""
        if self.ended is None:
            return f"Thinking… {self.tokens} tokens"
        return thought_label(self.seconds(), self.tokens)

    def stats(self) -> dict[str, float | int]:
        """What the stored reply keeps of it (none when the model did not think)."""
        if self.started is None:
            return {}
        return {"thinking_tokens": self.tokens, "thinking_s": round(self.seconds(), 2)}


def thought_label(seconds: float | None, tokens: int | None) -> str:
    """ "Thought for 3.2 s · 41 tokens", from what is known."""
    parts = [f"Thought for {seconds:.1f} s" if seconds is not None else "Thought"]
    if tokens:
        parts.append(f"{tokens} tokens")
    return " · ".join(parts)


def stored_label(stats: dict | None) -> str:
    stats = stats or {}
    return thought_label(stats.get("thinking_s"), stats.get("thinking_tokens"))


class ThinkingPanel(QWidget):
    """A header button ("▸ Thought for 3.2 s · 41 tokens") over the thinking text, collapsed."""

    def __init__(self, width: int):
        super().__init__(objectName="thinkingPanel")
        self.header = QToolButton(objectName="thinkingHeader", checkable=True, autoRaise=True)
        self.header.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.header.setArrowType(Qt.ArrowType.RightArrow)
        self.header.toggled.connect(self._expand)
        self.text = QLabel(objectName="thinkingText", wordWrap=True)
        self.text.setTextFormat(Qt.TextFormat.PlainText)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.text.setForegroundRole(QPalette.ColorRole.PlaceholderText)  # greyed: not the answer
        self.text.setMaximumWidth(width)
        self.text.hide()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 4)
        layout.setSpacing(2)
        layout.addWidget(self.header, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(self.text)

    def show_thinking(self, text: str, label: str) -> None:
        self.text.setText(text.strip())
        self.header.setText(label)
        self.setVisible(bool(text.strip()))

    @property
    def expanded(self) -> bool:
        return self.header.isChecked()

    def _expand(self, expanded: bool) -> None:
        self.header.setArrowType(Qt.ArrowType.DownArrow if expanded else Qt.ArrowType.RightArrow)
        self.text.setVisible(expanded)
