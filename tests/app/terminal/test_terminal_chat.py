"""The terminal chat: its REPL over a stand-in session, then `python -m app.terminal.chat` for real."""

import codecs
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.terminal.chat import TerminalChat, format_stats
from engine.generation_config import GenerationConfig
from engine.worker.client import RequestFailed, WorkerDied
from engine.worker.protocol import ChatMessage, Error, Finished, Stats, Token

ROOT = Path(__file__).resolve().parents[3]
COW = "What sound does a cow make?"


class ScriptedSession:
    """Stands in for `EngineSession`: each `generate` plays the next script (events, or an exception)."""

    def __init__(self, *replies, model: dict | None = None):
        self.replies = list(replies)
        self.asked: list[list[ChatMessage]] = []
        self.closed_early = 0
        self.model = model  # as the engine's Loaded event says it ({"thinks": …}); None: not said

    def generate(self, messages, config):
        self.asked.append(list(messages))
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        finished = False
        try:
            for event in reply:
                finished = isinstance(event, Finished)
                yield event
        finally:
            self.closed_early += not finished

    def stats(self):
        return make_stats()


def answer(text: str, reason: str = "eos") -> list:
    return [Token("r", text, 1, 0, 1.0), Finished("r", reason, text, "", 3, 1, {"tokens_per_s": 50.0})]


def make_stats(**fields) -> Stats:
    values = dict.fromkeys(Stats.__dataclass_fields__)
    values.update(request_id="s", time_s=0.0, generating=False, simulated_link=True)
    values.update(host_ram_used_bytes=2 * 1024**3, host_ram_total_bytes=8 * 1024**3, process_rss_bytes=2**29)
    values.update(h2d_bytes=0, hits=0, misses=0, hit_rate_by_phase={}, generated_tokens=0, extra={})
    values.update(fields)
    return Stats(**values)


def chat(session, lines: str, system: str | None = None, stdout=None) -> tuple[int, str, str]:
    stdout = stdout or io.StringIO()
    stderr = io.StringIO()
    repl = TerminalChat(session, GenerationConfig(), system, io.StringIO(lines), stdout, stderr)
    code = repl.run()
    return code, stdout.getvalue(), stderr.getvalue()


def test_the_conversation_is_kept_until_reset():
    session = ScriptedSession(answer("Moo."), answer("Still moo."), answer("Hi."))
    code, out, _ = chat(session, f"{COW}\nAnd again?\n/reset\nHello\n", system="Be brief.")
    assert code == 0 and out == "Moo.\nStill moo.\nHi.\n"
    system = ChatMessage("system", "Be brief.")
    first_turn = [ChatMessage("user", COW), ChatMessage("assistant", "Moo.")]
    assert session.asked[1] == [system, *first_turn, ChatMessage("user", "And again?")]
    assert session.asked[2] == [system, ChatMessage("user", "Hello")]


class InterruptOnce(io.StringIO):
    """stdout on which the first write of `text` is interrupted, as Ctrl-C would."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def write(self, s: str) -> int:
        if s == self.text:
            self.text = None
            raise KeyboardInterrupt
        return super().write(s)


def test_ctrl_c_mid_reply_cancels_it_and_leaves_it_out():
    story = "Once upon"
    long_reply = [Token("r", "Once", 1, 0, 1.0), Token("r", " upon", 2, 1, 1.0)]
    long_reply.append(Finished("r", "eos", story, "", 1, 2, {}))
    session = ScriptedSession(long_reply, answer("Moo."))
    code, out, err = chat(session, f"Tell a story\n{COW}\n", stdout=InterruptOnce(" upon"))
    assert code == 0 and session.closed_early == 1
    assert "[reply cancelled" in err and out.endswith("Moo.\n")
    assert session.asked[1] == [ChatMessage("user", COW)]  # neither the question nor the partial reply


def test_an_engine_error_is_shown_and_the_chat_goes_on():
    failure = RequestFailed(Error("r", "invalid_request", "The prompt is too long."))
    code, out, err = chat(ScriptedSession(failure, answer("Moo.")), f"x\n{COW}\n")
    assert code == 0 and "error: The prompt is too long." in err and out.endswith("Moo.\n")


def test_a_dead_engine_ends_the_chat_with_status_1():
    died = WorkerDied("The engine process stopped unexpectedly (signal 9).")
    code, _, err = chat(ScriptedSession(died, answer("never")), f"{COW}\n{COW}\n")
    assert code == 1 and "stopped unexpectedly" in err


def test_commands():
    session = ScriptedSession(answer("Moo.", reason="length"))
    code, out, err = chat(session, f"{COW}\n/stats\n/help\n/nope\n/quit\nnever read\n")
    assert code == 0 and len(session.asked) == 1
    assert "50.0 tok/s" in out and "/reset" in out
    assert "limit of 256 tokens" in err and "Unknown command /nope" in err


def test_stats_say_what_is_not_known():
    text = format_stats(make_stats(), None)
    assert "last reply: none yet" in text and "simulated link" in text and "VRAM n/a" in text
    gpu = make_stats(simulated_link=False, vram_used_bytes=3 * 1024**3, vram_total_bytes=8 * 1024**3)
    gpu = format_stats(gpu, Finished("r", "eos", "x", "", 1, 1, {"accept_len": 2.5, "h2d_gbps": 12.0}))
    assert "PCIe" in gpu and "VRAM 3.0 GiB / 8.0 GiB" in gpu
    assert "accept_len 2.50" in gpu and "h2d 12.00 GB/s" in gpu and "n/a tok/s" in gpu


# -- the real thing: a subprocess with a worker on the demo model ---------------------------------


class ChatProcess:
    """`python -m app.terminal.chat` with pipes, its output collected as it comes."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.terminal.chat", "--device", "cpu", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        )
        self.out, self.err = [], []
        self.readers = [
            threading.Thread(target=_collect, args=(pipe, into), daemon=True)
            for pipe, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self.readers:
            reader.start()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for reader in self.readers:
            reader.join(30)  # EOF once the worker is gone too: it shares the pipes
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            pipe.close()

    def send(self, line: str) -> None:
        self.proc.stdin.write(f"{line}\n".encode())
        self.proc.stdin.flush()

    def wait_for(self, into: list[str], text: str, after: int = 0, timeout_s: float = 60) -> int:
        """Wait until `text` shows in the output past character `after`; its end position."""
        deadline = time.monotonic() + timeout_s
        while (at := "".join(into).find(text, after)) < 0:
            assert time.monotonic() < deadline, f"no {text!r} in {''.join(into)!r} / {''.join(self.err)!r}"
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}: {''.join(self.err)}"
            time.sleep(0.05)
        return at + len(text)


def _collect(pipe, into: list[str]) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    while data := os.read(pipe.fileno(), 4096):
        into.append(decoder.decode(data))


@pytest.mark.slow
def test_chat_stats_reset_quit():
    lines = f"{COW}\n/stats\n/reset\n/quit\n"
    proc = subprocess.run(
        [sys.executable, "-m", "app.terminal.chat", "--device", "cpu", "--greedy"],
        input=lines.encode(),
        capture_output=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        check=False,
    )
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, err
    assert out.startswith("A cow says moo.\n")
    assert "tok/s" in out and "cache slots" in out
    assert "engine: simulated link" in out or "engine: CPU, no link" in out
    # with no options the demo speculates with its bundled draft and prefetches with SP-MoE
    assert "speculation draft, prefetch spmoe" in out
    assert "Loaded moe-chat-demo" in err and "[new conversation]" in err


@pytest.mark.slow
def test_ctrl_c_cancels_the_reply_and_the_chat_goes_on():
    chat = ChatProcess("--greedy", "--ignore-eos", "--max-new-tokens", "600")
    try:
        chat.send("Tell me about cows.")
        chat.wait_for(chat.out, "cow")  # the reply streams
        chat.proc.send_signal(signal.SIGINT)
        chat.wait_for(chat.err, "[reply cancelled")
        streamed = len("".join(chat.out))
        chat.send(COW)
        chat.wait_for(chat.out, "moo", after=streamed)
        chat.wait_for(chat.err, "limit of 600 tokens")  # this reply runs to its end, back at the prompt
        time.sleep(0.3)
        chat.proc.send_signal(signal.SIGINT)  # at the prompt: leave
        assert chat.proc.wait(30) == 0, "".join(chat.err)
    finally:
        chat.close()


def test_moe_chat_cli_subcommand_is_the_terminal_chat(capsys):
    from app.main import main

    with pytest.raises(SystemExit) as exited:
        main(["cli", "serve", "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: moe-chat-cli serve")


def test_a_triple_quote_block_is_one_message():
    session = ScriptedSession(answer("Two lines."), answer("One."))
    code, out, _ = chat(session, '"""\nfirst line\nsecond line\n"""\n"""inline"""\n')
    assert code == 0 and out == "Two lines.\nOne.\n"
    assert session.asked[0][-1] == ChatMessage("user", "first line\nsecond line")
    assert session.asked[1][-1] == ChatMessage("user", "inline")


def test_replies_render_as_markdown_on_a_terminal():
    from app.terminal.console import MarkdownReply

    out = io.StringIO()
    reply = MarkdownReply(out)
    reply.add("# Cows\n\nA cow says **moo**")
    reply.finish(".")
    text = out.getvalue()
    assert "Cows" in text and "moo." in text and "**" not in text and "# " not in text


def test_the_load_shows_a_progress_bar_per_stage():
    from app.terminal.console import RichLoadProgress
    from engine.worker.protocol import LoadProgress

    err = io.StringIO()
    progress = RichLoadProgress(err)
    for done in range(4):
        progress(LoadProgress("l", "experts", done, 3))
    progress(LoadProgress("l", "weights", 1, 1))
    progress.close()
    assert "experts" in err.getvalue() and "3/3" in err.getvalue() and "weights" in err.getvalue()


def test_the_history_file_is_in_the_data_folder(tmp_path, monkeypatch):
    from app.terminal.console import history_path

    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path))
    assert history_path() == tmp_path / "cli-history"


class RecordingSession(ScriptedSession):
    """A scripted session that also keeps each request's config."""

    def __init__(self, *replies, model: dict | None = None):
        super().__init__(*replies, model=model)
        self.configs = []

    def generate(self, messages, config):
        self.configs.append(config)
        return super().generate(messages, config)


def test_thinking_goes_to_stderr_apart_from_the_answer_and_think_off_reaches_the_template():
    thought = [
        Token("r", "", 1, 0, 1.0, "Let me"),
        Token("r", "Moo.", 2, 1, 1.0, " see."),
        Finished("r", "eos", "Moo.", "", 3, 2, {}, "Let me see."),
    ]
    session = RecordingSession(thought, answer("Moo again."))
    code, out, err = chat(session, f"{COW}\n/think off\n{COW}\n/think maybe\n")
    assert code == 0 and out == "Moo.\nMoo again.\n"
    assert "[thinking] Let me see.\n" in err and "[thinking off]" in err
    assert "Use /think on or /think off." in err
    assert session.configs[0].template_kwargs == {}
    assert session.asked[1][1] == ChatMessage("assistant", "Moo.")  # the answer only goes back
    assert session.configs[1].template_kwargs == {"enable_thinking": False}


def test_ctrl_c_at_the_prompt_says_how_to_leave_and_think_on_a_model_that_cannot_says_so():
    """A Ctrl-C meant for a reply that had just ended lands at the prompt: the chat stays and says
    how to leave (as Ollama does); /bye leaves. /think on a model without thinking says it does
    nothing, and changes nothing."""
    session = RecordingSession(answer("Moo."), model={"thinks": False})
    stderr = io.StringIO()
    repl = TerminalChat(session, GenerationConfig(), None, io.StringIO(""), io.StringIO(), stderr)
    lines = iter([KeyboardInterrupt(), "/think off", COW, "/bye"])

    def typed() -> str:
        line = next(lines)
        if isinstance(line, BaseException):
            raise line
        return line

    repl.interactive, repl._read_message = True, typed
    assert repl.run() == 0
    said = stderr.getvalue()
    assert "Use Ctrl + d or /bye to exit." in said
    assert "does not think before it answers" in said and "[thinking off]" not in said
    assert session.configs[0].template_kwargs == {}


def terminal_lines(output: str, width: int, height: int) -> list[str]:
    """What a terminal (pyte's emulator) holds after `output`: its scrollback, then its screen."""
    import pyte

    screen = pyte.HistoryScreen(width, height, history=10_000)
    screen.set_mode(pyte.modes.LNM)  # a tty turns "\n" into a new line at column 0
    pyte.Stream(screen).feed(output)
    scrolled = ["".join(line[x].data for x in range(width)) for line in screen.history.top]
    return [line.rstrip() for line in scrolled + screen.display]


def test_a_reply_taller_than_the_terminal_is_on_it_once(monkeypatch):
    # rich's Live redraws what has scrolled off the top when its content is taller than the
    # terminal (Textualize/rich#3263): the reply's first lines came out twice in tmux
    from rich.console import Console

    from app.terminal.console import MarkdownReply

    out = io.StringIO()
    console = Console(
        file=out, width=60, height=12, force_terminal=True, color_system=None, legacy_windows=False
    )
    reply = MarkdownReply(out, console=console)
    paragraphs = [f"Paragraph {n} of the story." for n in range(30)]
    text = "\n\n".join(paragraphs)
    for start in range(0, len(text), 9):
        reply.add(text[start : start + 9])
        time.sleep(0.004)  # the live display redraws meanwhile, as it does while a model streams
    reply.finish("")
    shown = [line for line in terminal_lines(out.getvalue(), 60, 12) if line]
    assert shown == paragraphs
