"""`--multi-turn`: a 4-turn conversation with and without prefix reuse, side by side.

Each turn sends the whole conversation so far (the earlier questions and the model's own replies)
and a new question, as a chat app does. With reuse the KV cache kept from the previous turn holds
the conversation up to the last reply, so only the new question is prefilled; without it every
turn prefills everything (the prefix cache is emptied first). Both runs are greedy and must give
the same replies: the table says so per turn. Times are medians over `--repeats` runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from engine.prompts import PROMPTS, greedy

TURNS = 4


@dataclass(frozen=True)
class TurnRow:
    turn: int
    prompt_tokens: int
    cached_tokens: int  # with reuse
    prefill_ms_cold: float
    prefill_ms_reused: float
    same_reply: bool


def _conversation(model, new_tokens: int, reuse: bool) -> list[tuple[int, int, float, tuple[int, ...]]]:
    """(prompt tokens, cached tokens, prefill ms, reply ids) per turn."""
    from engine.generation import generate_text  # torch: only when a model is there

    messages, turns = [], []
    model.prefix_cache.clear()
    for question in PROMPTS[:TURNS]:
        messages.append({"role": "user", "content": question})
        if not reuse:
            model.prefix_cache.clear()
        finished = generate_text(model, messages, _chat(new_tokens))
        stats = finished.stats
        turns.append((stats.prompt_tokens, stats.cached_prompt_tokens, stats.prefill_ms, finished.token_ids))
        messages.append({"role": "assistant", "content": finished.text})
    return turns


def _chat(new_tokens: int):
    """Greedy, ending at the model's end of turn as a chat reply does (a reply cut short of it is
    re-encoded by the template with tokens the model did not produce)."""
    return replace(greedy(new_tokens), ignore_eos=False)


def bench_multi_turn(model, new_tokens: int, repeats: int = 3) -> list[TurnRow]:
    """The conversation cold and with reuse, `repeats` times each, interleaved (a busy machine
    slows both alike), after one untimed reply that warms the model up; the median prefill time
    per turn."""
    from engine.generation import generate_text

    generate_text(model, PROMPTS[0], _chat(new_tokens))
    runs = [
        (_conversation(model, new_tokens, False), _conversation(model, new_tokens, True))
        for _ in range(repeats)
    ]
    cold, warm = runs[0]
    return [
        TurnRow(
            n + 1,
            c[0],
            w[1],
            statistics.median(run[0][n][2] for run in runs),
            statistics.median(run[1][n][2] for run in runs),
            all(run[0][n][3] == run[1][n][3] == c[3] for run in runs),
        )
        for n, (c, w) in enumerate(zip(cold, warm, strict=True))
    ]


def format_turns(rows: list[TurnRow]) -> str:
    lines = ["turn  prompt  reused  prefill cold ms  prefill reused ms  speedup  same reply"]
    for r in rows:
        speedup = r.prefill_ms_cold / r.prefill_ms_reused if r.prefill_ms_reused > 0 else float("nan")
        lines.append(
            f"{r.turn:>4}  {r.prompt_tokens:>6}  {r.cached_tokens:>6}  {r.prefill_ms_cold:>15.1f}  "
            f"{r.prefill_ms_reused:>17.1f}  {speedup:>6.2f}x  {'yes' if r.same_reply else 'NO'}"
        )
    total_cold = sum(r.prefill_ms_cold for r in rows)
    total_warm = sum(r.prefill_ms_reused for r in rows)
    saved = sum(r.cached_tokens for r in rows)
    lines.append(
        f"all turns: prefill {total_cold:.1f} ms cold, {total_warm:.1f} ms with reuse; "
        f"{saved} of {sum(r.prompt_tokens for r in rows)} prompt tokens not prefilled again"
    )
    return "\n".join(lines)
