"""render_markdown: highlighted code that Qt's rich text really colours, escaped HTML, streaming fences."""

import pytest
from PySide6.QtGui import QTextDocument

from app.markdown_render import render_markdown

pytestmark = pytest.mark.gui


def _fragments(html: str) -> list[tuple[str, str]]:
    """(text, foreground colour) of every text fragment Qt lays out from this HTML."""
    document = QTextDocument()
    document.setHtml(html)
    found = []
    block = document.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.text().strip():
                found.append((fragment.text(), fragment.charFormat().foreground().color().name()))
            it += 1
        block = block.next()
    return found


def test_fenced_code_is_highlighted_with_colours_qt_renders(qapp):
    html = render_markdown("Look:\n\n```python\ndef add(a, b):\n    return a + b  # sum\n```\n")
    assert "<pre" in html and 'style="color' in html and "class=" not in html
    colours = dict(_fragments(html))
    assert colours["def"] not in ("#000000", colours["Look:"]), "the keyword is coloured in Qt"
    assert colours["# sum"] not in ("#000000", colours["def"]), "comments get their own colour"
    assert colours["Look:"] == "#000000"


def test_dark_mode_uses_another_palette_for_code(qapp):
    light = dict(_fragments(render_markdown("```python\ndef f(): pass\n```", dark=False)))
    dark = dict(_fragments(render_markdown("```python\ndef f(): pass\n```", dark=True)))
    assert light["def"] != dark["def"]


def test_raw_html_is_escaped_not_passed_through(qapp):
    html = render_markdown('Hi <script>alert("x")</script> <b>bold?</b>\n\n<div onclick="x">block</div>')
    assert "<script" not in html and "<b>" not in html and "<div onclick" not in html
    assert "&lt;script&gt;" in html and "&lt;b&gt;bold?&lt;/b&gt;" in html
    texts = " ".join(text for text, _ in _fragments(html))
    assert '<script>alert("x")</script>' in texts, "the user sees the tags as text"


def test_code_inside_a_fence_is_escaped(qapp):
    html = render_markdown("```html\n<img src=x onerror=alert(1)>\n```")
    assert "<img" not in html and "&lt;" in html


def test_an_unterminated_fence_mid_stream_renders_as_code(qapp):
    html = render_markdown("Here you go:\n\n```python\nfor i in range(3):\n    print(i")
    assert html.count("<pre") == 1 and "```" not in html
    colours = dict(_fragments(html))
    assert colours["for"] != "#000000", "the partial code is highlighted too"
    assert any("print" in text for text, _ in _fragments(html))


def test_an_unknown_language_is_plain_code_not_an_error(qapp):
    html = render_markdown("```no-such-language\nx = 1\n```")
    assert "<pre" in html and "x = 1" in html


def test_tables_strikethrough_and_inline_code(qapp):
    html = render_markdown("| a | b |\n|---|---|\n| 1 | 2 |\n\n~~old~~ and `x = 1`")
    assert "<table" in html and "<td>1</td>" in html
    assert "<s>old</s>" in html and "<code" in html and "x = 1" in html
    texts = [text for text, _ in _fragments(html)]
    assert "a" in texts and "old" in texts


def test_links_with_script_urls_are_not_made_clickable(qapp):
    html = render_markdown("[click](javascript:alert(1)) and [site](https://example.org)")
    assert 'href="javascript' not in html and 'href="https://example.org"' in html
