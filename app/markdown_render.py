"""Chat replies as HTML for Qt's rich text (QLabel / QTextBrowser).

`render_markdown(text)` parses CommonMark plus tables and strikethrough with
markdown-it-py. Raw HTML in the input is never passed through: it comes out
escaped, as text. Fenced code blocks are highlighted by pygments with inline
styles (`noclasses=True`), because Qt's rich text understands `<span
style="color: …">` but no class-based stylesheet from pygments. Each code block
sits in a one-cell table, the only block Qt paints a background and padding for.

A reply that is still streaming may end inside a code fence; CommonMark closes
an unterminated fence at the end of the document, so the partial code renders
as code, highlighted, and not as a paragraph full of backticks.
`split_blocks(text)` cuts a reply into its top-level blocks so that a streaming
view can render (and lay out) only the blocks that changed.
"""

from __future__ import annotations

import functools
import html

from markdown_it import MarkdownIt
from markdown_it.renderer import RendererHTML
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.lexers.special import TextLexer
from pygments.util import ClassNotFound

_THEMES = {
    # pygments style, code background, inline-code background, table border
    False: ("default", "#f3f4f6", "#eceef1", "#b4b9c1"),
    True: ("monokai", "#272822", "#3a3d41", "#5a5f66"),
}


@functools.cache
def _formatter(style: str) -> HtmlFormatter:
    # nowrap: only the <span>s; the <pre> and its box are ours (see _code_block).
    return HtmlFormatter(style=style, noclasses=True, nowrap=True)


def _lexer(language: str):
    if language:
        try:
            return get_lexer_by_name(language, stripnl=False, ensurenl=False)
        except ClassNotFound:
            pass
    return TextLexer(stripnl=False, ensurenl=False)


def _code_block(code: str, language: str, dark: bool) -> str:
    style, background, _, _ = _THEMES[dark]
    spans = highlight(code, _lexer(language), _formatter(style)).rstrip("\n")
    label = (
        f'<div style="color: #8a8f98; font-size: small;">{html.escape(language)}</div>' if language else ""
    )
    # pre-wrap: a long code line wraps inside the bubble instead of widening it.
    return (
        f'<table width="100%" cellspacing="0" cellpadding="8" bgcolor="{background}"'
        f' style="margin-top: 4px; margin-bottom: 4px;"><tr><td>{label}'
        f'<pre style="white-space: pre-wrap; margin: 0;">{spans}</pre></td></tr></table>\n'
    )


@functools.cache
def _parser(dark: bool) -> MarkdownIt:
    _, _, inline_background, border = _THEMES[dark]
    md = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])

    def fence(renderer: RendererHTML, tokens, idx, options, env) -> str:
        token = tokens[idx]
        language = token.info.strip().split(maxsplit=1)[0] if token.info.strip() else ""
        return _code_block(token.content, language, dark)

    def code_block(renderer: RendererHTML, tokens, idx, options, env) -> str:
        return _code_block(tokens[idx].content, "", dark)

    def code_inline(renderer: RendererHTML, tokens, idx, options, env) -> str:
        content = html.escape(tokens[idx].content)
        return f'<code style="background-color: {inline_background};">&nbsp;{content}&nbsp;</code>'

    def table_open(renderer: RendererHTML, tokens, idx, options, env) -> str:
        return (
            f'<table border="1" cellspacing="0" cellpadding="5"'
            f' style="border-collapse: collapse; border-style: solid; border-color: {border};">\n'
        )

    md.add_render_rule("fence", fence)
    md.add_render_rule("code_block", code_block)
    md.add_render_rule("code_inline", code_inline)
    md.add_render_rule("table_open", table_open)
    return md


@functools.lru_cache(maxsize=512)
def render_markdown(text: str, dark: bool = False) -> str:
    """Markdown → HTML for Qt rich text; `dark` picks colours for a dark palette."""
    return _parser(dark).render(text)


def split_blocks(text: str) -> list[str]:
    """The source of each top-level block (paragraph, list, table, code fence …), in order."""
    lines = text.split("\n")
    return [
        "\n".join(lines[token.map[0] : token.map[1]])
        for token in _parser(False).parse(text)
        if token.level == 0 and token.nesting >= 0 and token.map
    ]
