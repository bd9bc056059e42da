"""Terminal chat: `moe-chat-cli [--model DIR] [options]`; `moe-chat-cli serve …` runs the local server;
`moe-chat-cli --remote URL|NAME [--api-key-env VAR] [--model ID]` chats with a remote engine
(`app.remote_setup`).

A REPL over an `EngineSession`: each line is a user message (a block between
two `\"\"\"` lines spans several), the reply streams to stdout as it arrives,
and the conversation is kept (with `--system` first). On a terminal the line editor keeps a history and
Alt+Enter starts a new line, replies render as markdown and loading shows
progress bars (`app.terminal.console`). Commands: /stats, /reset, /help, /quit
(or Ctrl-D). Progress, notices and errors go to stderr, so stdout holds only
replies and what commands print. With no options it speculates with the
model's drafter and prefetches with SP-MoE; /stats says which were used.

Ctrl-C while a reply streams cancels it and returns to the prompt; the question
and its partial reply are left out of the history, so the conversation stays as
it was before (chat templates that require alternating roles keep working).
Ctrl-C at the prompt leaves with status 0. An error from the engine is shown and
the chat goes on; a dead engine ends it with status 1. A reply a remote engine could not give
(a cut connection, a timeout, a busy server) is shown as far as it came, left out of the history,
and /retry asks again.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import signal
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import TextIO

from app.remote_setup import add_remote_arguments, open_remote_session
from app.session_setup import add_session_arguments, open_session, report_start_failure
from app.terminal.console import RichLoadProgress, make_console
from engine.config import format_bytes
from engine.errors import EngineError
from engine.generation_config import GenerationConfig
from engine.remote.errors import RETRYABLE
from engine.remote.stats import RemoteStats, remote_stats
from engine.worker.client import EngineSession, RequestFailed, WorkerDied
from engine.worker.protocol import ChatMessage, Finished, Stats, Token

log = logging.getLogger(__name__)

COMMANDS = {
    "/stats": "show the engine's latest telemetry",
    "/reset": "start a new conversation",
    "/think": "on or off: let a thinking model think before it answers",
    "/retry": "ask again after a reply a remote engine could not finish",
    "/help": "list the commands",
    "/quit": "leave (also /bye, or Ctrl-D)",
}


class TerminalChat:
    """The REPL: reads lines from `stdin`, streams replies to `stdout`, talks to the user on `stderr`."""

    def __init__(
        self,
        session: EngineSession,
        config: GenerationConfig,
        system: str | None = None,
        stdin: TextIO = sys.stdin,
        stdout: TextIO = sys.stdout,
        stderr: TextIO = sys.stderr,
    ):
        self.session, self.config, self.system = session, config, system
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.interactive = stdin.isatty() and stdout.isatty()
        self._read_message, self.render = make_console(stdin, stdout, self.interactive)
        self.history: list[ChatMessage] = []
        self.last_reply: Finished | None = None
        self.retry_text: str | None = None  # the question of a reply that failed in a way worth retrying
        self.reset()

    def reset(self) -> None:
        self.history = [ChatMessage("system", self.system)] if self.system else []

    def run(self) -> int:
        """Chat until /quit (/bye) or EOF (0), or until the engine dies (1); a Ctrl-C at the prompt
        says how to leave instead (one meant for a reply that just ended must not end the chat)."""
        if self.interactive:
            self._say(
                'Type a message, or /help. Alt+Enter or a """ block for several lines; '
                "Ctrl-C stops a reply; Ctrl-D or /bye leaves."
            )
        while True:
            try:
                line = self._read_message().strip()
            except KeyboardInterrupt:  # at the prompt: a Ctrl-C meant for a reply that just ended
                if not self.interactive:
                    return 0
                self._say("\nUse Ctrl + d or /bye to exit.")
                continue
            except EOFError:
                if self.interactive:
                    self._say("")  # end the prompt's line
                return 0
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        return 0
                elif line:
                    self.reply(line)
            except WorkerDied as err:
                self._say(f"error: {err}")
                return 1
            except KeyboardInterrupt:  # during a command: back to the prompt
                self._say("[interrupted]")

    def command(self, line: str) -> bool:
        """Run one /command; False when it asks to leave."""
        name, *args = line.split()
        match name.lower():
            case "/quit" | "/exit" | "/bye":
                return False
            case "/reset":
                self.reset()
                self.last_reply = None
                self._say("[new conversation]")
            case "/stats":
                self._print(format_stats(self.session.stats(), self.last_reply))
            case "/think":
                self.think(args)
            case "/retry":
                if self.retry_text is None:
                    self._say("Nothing to retry.")
                else:
                    self.reply(self.retry_text)
            case "/help":
                self._print("\n".join(f"{cmd:<8} {what}" for cmd, what in COMMANDS.items()))
            case _:
                self._say(f"Unknown command {name}; /help lists the commands.")
        return True

    def think(self, args: list[str]) -> None:
        """`/think on|off`: thinking models' `enable_thinking` (off: the template skips the thinking)."""
        if args not in (["on"], ["off"]):
            self._say("Use /think on or /think off.")
            return
        if (self.session.model or {}).get("thinks") is False:
            self._say("This model does not think before it answers: /think changes nothing for it.")
            return
        kwargs = {} if args == ["on"] else {"enable_thinking": False}
        self.config = replace(self.config, template_kwargs=kwargs)
        self._say(f"[thinking {args[0]}]")

    def reply(self, text: str) -> None:
        """Stream the reply to `text`; keep both in the history only when the reply finished."""
        question = ChatMessage("user", text)
        self.retry_text = None
        stream = self.session.generate([*self.history, question], self.config)
        try:
            finished = self._stream(stream)
        except KeyboardInterrupt:
            _cancel(stream)
            self.render.cut()
            self._say("[reply cancelled; it is left out of the conversation]")
            return
        except RequestFailed as err:
            self.render.cut()
            self._say(f"error: {err}")
            if err.kind in RETRYABLE:
                self.retry_text = text
                self._say("[/retry asks again]")
            return
        self.render.finish(finished.tail)
        if finished.reason == "interrupted":  # a remote's stream was cut: the part shown is all there is
            self.retry_text = text
            why = finished.stats.get("error", {}).get("message", "the reply did not finish")
            self._say(f"[reply interrupted: {why} It is left out of the conversation; /retry asks again]")
            return
        self.history += [question, ChatMessage("assistant", finished.text)]
        self.last_reply = finished
        if finished.reason == "length":
            self._say(f"[the reply reached the limit of {self.config.max_new_tokens} tokens]")

    def _stream(self, stream: Iterator[Token | Finished]) -> Finished:
        """The answer to stdout as it streams; a thinking model's thinking to stderr, dimmed."""
        thinking = False
        for event in stream:
            reasoning = event.reasoning_tail if isinstance(event, Finished) else event.reasoning
            if reasoning:
                self.stderr.write(("[thinking] " if not thinking else "") + reasoning)
                self.stderr.flush()
                thinking = True
            if thinking and (event.text or isinstance(event, Finished)):
                self._say("")  # the thinking's last line ends before the answer
                thinking = False
            if isinstance(event, Finished):
                return event
            self.render.add(event.text)
        raise AssertionError("unreachable: a generation ends with Finished or an exception")

    def _print(self, text: str) -> None:
        self.stdout.write(text + "\n")
        self.stdout.flush()

    def _say(self, text: str) -> None:
        self.stderr.write(text + "\n")
        self.stderr.flush()


def _cancel(stream: Iterator) -> None:
    """Close a reply's stream, which cancels the generation and drains its events.

    A second Ctrl-C while it drains must not end the chat: the generator is closed by
    then, and the session skips any late events of the cancelled request."""
    while True:
        try:
            stream.close()
            return
        except KeyboardInterrupt:
            continue


def format_stats(stats: Stats, reply: Finished | None) -> str:
    """Telemetry in two readable lines: the last reply's speed, then the engine's state."""
    remote = remote_stats(stats)
    if remote is not None:
        return format_remote_stats(remote, reply)
    if reply is None:
        last = "none yet"
    else:
        s = reply.stats
        last = (
            f"{reply.completion_tokens} tokens, {_fmt(s.get('tokens_per_s'), '.1f')} tok/s, "
            f"tpot {_fmt(s.get('tpot_ms'), '.1f')} ms, hit rate {_pct(s.get('hit_rate'))}, "
            f"accept_len {_fmt(s.get('accept_len'), '.2f')}, h2d {_fmt(s.get('h2d_gbps'), '.2f')} GB/s; "
            f"speculation {s.get('spec', 'n/a')}, prefetch {s.get('prefetch', 'n/a')}"
        )
    link = {True: "simulated link", False: "PCIe", None: "no model"}[stats.simulated_link]
    if stats.simulated_link is False and stats.vram_total_bytes is None:
        link = "CPU, no link"  # experts computed where they are kept: nothing is copied
    if stats.vram_used_bytes is not None and stats.vram_total_bytes is not None:
        vram = f"{format_bytes(stats.vram_used_bytes)} / {format_bytes(stats.vram_total_bytes)}"
    elif stats.torch_allocated_bytes is not None:
        vram = f"{format_bytes(stats.torch_allocated_bytes)} allocated"
    else:
        vram = "n/a"
    slots = (
        f"{stats.cache_slots_used}/{stats.cache_slots_total}"
        if stats.cache_slots_total is not None
        else "n/a"
    )
    engine = (
        f"{link}; cache slots {slots}; hit rate {_pct(stats.hit_rate_total)} since load; "
        f"VRAM {vram}; RAM {format_bytes(stats.process_rss_bytes)} (engine), "
        f"{format_bytes(stats.host_ram_used_bytes)} / {format_bytes(stats.host_ram_total_bytes)} (host)"
    )
    return f"last reply: {last}\nengine: {engine}"


def format_remote_stats(remote: RemoteStats, reply: Finished | None) -> str:
    """A remote engine's telemetry: the last reply as measured here, then what its /metrics say."""
    last = "none yet"
    if reply is not None:
        s = reply.stats
        last = (
            f"{reply.completion_tokens} tokens, {_fmt(s.get('tokens_per_s'), '.1f')} tok/s, "
            f"time to first token {_fmt(s.get('ttft_ms'), '.0f')} ms, tpot {_fmt(s.get('tpot_ms'), '.1f')} ms"
        )
    m = remote.metrics
    served = f"{remote.model or 'no model'} on {remote.base_url}"
    if m.error is not None:
        return f"last reply: {last}\nremote: {served}; no server metrics ({m.error})"
    return (
        f"last reply: {last}\nremote: {served} ({m.engine or 'unknown engine'}); "
        f"KV cache {_pct(m.kv_cache_usage)}, requests running {_fmt(m.requests_running, '.0f')}, "
        f"waiting {_fmt(m.requests_waiting, '.0f')}, prefix cache hits {_pct(m.prefix_cache_hit_rate)}, "
        f"accept_len {_fmt(m.accept_len, '.2f')}, expert balance {_fmt(m.ep_balancedness, '.2f')}"
    )


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-chat-cli",
        description="Chat with a Mixture-of-Experts model in the terminal.",
        epilog="`moe-chat-cli serve --help`: a local OpenAI-compatible server instead.",
    )
    parser.add_argument("--system", default=None, help="system prompt at the start of every conversation")
    add_session_arguments(parser, max_new_tokens=512)
    add_remote_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    multiprocessing.freeze_support()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from app.server.openai_server import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    # A shell starts background jobs with SIGINT ignored; in this REPL Ctrl-C has a meaning.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        progress = RichLoadProgress(sys.stderr) if sys.stderr.isatty() else None
        if args.remote:
            session, config = open_remote_session(args)
        else:
            session, _, config = open_session(args, progress=progress)
    except (EngineError, KeyboardInterrupt) as err:
        return report_start_failure(err)
    try:
        return TerminalChat(session, config, system=args.system).run()
    finally:
        session.close()


if __name__ == "__main__":
    sys.exit(main())
