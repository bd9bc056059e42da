"""The one place that chooses a decode step's path.

Contract: `StepPaths.of(hf_model, lean, whole, captured, pieces)` is the model's ordered list of
step paths; each `StepPath` has a `name`, `takes(step)` (whether it may run this `Step` now;
where it may not, it says why on the step) and `run(step)` (the logits, or None where it finds at
run time that it cannot: why said on the step too). `StepPaths.run(step)` runs the first path
that takes the step and does not decline it, and counts the path each step took in `log` (a
`StepLog`), with the latest reason each faster path gave for leaving a step to the next one.
Fastest first:

    cuda-graph    a step of one token or a few (a draft's verification) over a device cache
                  holding every expert, replayed as one CUDA graph (engine.decode.captured_step)
    cuda-pieces   such a step over a device cache that can miss, replayed as CUDA graph pieces
                  cut at each MoE layer's experts, the host bringing them in between
                  (engine.decode.piecewise_step)
    ggml-replay   a one-token step's one ggml graph, prepared on the last token, run again
                  (engine.decode.one_token)
    ggml-whole    a step's layers and head in one ggml graph (engine.decode.whole_step)
    lean          the standard decoder layer by layer without transformers' wrappers
                  (engine.decode.lean); `lean+ggml` where layers do their ends in ggml graphs
    transformers  the model's own forward: takes every step

A path is in the list only where it applies to the model at all (CUDA and caches that hold
only attention positions for the first, `--kernels ggml` and a standard decoder for the ggml
ones, a standard decoder for `lean`); what it checks per step is what can change between steps:
hooks (an MTP drafter's, a prefetch predictor's), a draft's routing, the cache's kind and length.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from engine.decode.cpu_attention import MAX_FOLDED_QUERIES
from engine.decode.layer_graph import attends_in_graph
from engine.model.hf_calls import with_cache

GRAPH_PATHS = ("ggml-replay", "ggml-whole")  # the paths that run a step as one ggml graph


@dataclass(eq=False)
class Step:
    """One forward of the model over `kv_cache`: a decode step's token id as it is (`token`), or
    ids `[1, T]` on the model's device (`tokens`); the logits of the last `keep` positions."""

    kv_cache: Any
    keep: int = 1
    token: int | None = None
    tokens: torch.Tensor | None = None
    device: torch.device | None = None
    declined: list[tuple[str, str]] = field(default_factory=list)  # (path, why), in the list's order
    # what a path that declined computed and the next may reuse: the token rows and their angles
    embedded: tuple | None = None
    _lean_refusal: str | None = None

    def __post_init__(self) -> None:
        count = 1 if self.tokens is None else self.tokens.shape[1]
        self.count = count
        self.keep = count if self.keep == 0 else min(self.keep, count)

    def ids(self) -> torch.Tensor:
        """The step's token ids `[1, T]` as a tensor (a decode step's made once)."""
        if self.tokens is None:
            self.tokens = torch.tensor([[self.token]], device=self.device)
        return self.tokens

    def decline(self, path: str, why: str) -> bool:
        self.declined.append((path, why))
        return False


class StepPath(Protocol):
    name: str

    def takes(self, step: Step) -> bool: ...

    def run(self, step: Step) -> torch.Tensor | None: ...


class StepLog:
    """Which path each step took, and why the faster ones left steps to it."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()  # steps a path ran
        self.declines: Counter[str] = Counter()  # steps a path left to a slower one
        self.reasons: dict[str, str] = {}  # path -> the latest reason it gave

    def took(self, path: str, step: Step) -> None:
        self.counts[path] += 1
        for name, why in step.declined:
            self.declines[name] += 1
            self.reasons[name] = why

    def snapshot(self) -> tuple[Counter[str], Counter[str]]:
        return Counter(dict(self.counts)), Counter(dict(self.declines))

    def since(self, before: tuple[Counter[str], Counter[str]] | None) -> dict:
        """Since `before` (a `snapshot`): `step_path` (the path most steps took), `step_paths`
        (steps per path) and `step_path_declined` (the latest reason of each path that left
        steps to a slower one)."""
        counts, declines = before or (Counter(), Counter())
        # copied first (one C-level copy each): a telemetry thread asks while the run counts on
        ran, left = Counter(dict(self.counts)) - counts, Counter(dict(self.declines)) - declines
        return {
            "step_path": ran.most_common(1)[0][0] if ran else None,
            "step_paths": dict(ran),
            "step_path_declined": {name: self.reasons.get(name, "") for name in left},
        }


class StepPaths:
    def __init__(self, paths: list[StepPath]):
        self.paths = paths
        self.log = StepLog()

    @classmethod
    def of(cls, hf_model: nn.Module, lean, whole, captured=None, pieces=None) -> StepPaths:
        paths: list[StepPath] = [CapturedPath(step) for step in (captured, pieces) if step is not None]
        if lean is not None and whole is not None:
            paths += [ReplayPath(lean, whole), WholeGraphPath(lean, whole)]
        if lean is not None:
            paths.append(LeanPath(lean))
        paths.append(TransformersPath(hf_model))
        return cls(paths)

    @property
    def whole(self):
        """The model's `WholeStep` where its graph paths are in the list, else None."""
        return next((path.whole for path in self.paths if isinstance(path, WholeGraphPath)), None)

    @property
    def names(self) -> list[str]:
        return [path.name for path in self.paths]

    def without(self, *names: str) -> StepPaths:
        """The same list less the paths named (tests and the bench force slower paths with it)."""
        return StepPaths([path for path in self.paths if path.name not in names])

    def run(self, step: Step) -> torch.Tensor:
        """The logits of the first path that takes `step` and runs it: `[V]` for a decode step
        given by its `token` on the graph paths, else `[keep, V]`."""
        for path in self.paths:
            if not path.takes(step):
                continue
            logits = path.run(step)
            if logits is not None:
                self.log.took(path.name, step)
                return logits
        raise AssertionError("the transformers path takes every step")  # pragma: no cover


def _lean_refusal(lean, step: Step) -> str:
    """Why the standard decoder may not run `step` now ('' when it may), asked once a step."""
    if step._lean_refusal is None:
        step._lean_refusal = lean.refusal(step.kv_cache)
    return step._lean_refusal


class CapturedPath:
    """A step of one token, or of a few (a draft's verification), as one CUDA graph
    (engine.decode.captured_step) or as graph pieces with the experts brought in between them
    (engine.decode.piecewise_step): named by the step."""

    def __init__(self, captured):
        self.captured, self.name = captured, captured.path

    def takes(self, step: Step) -> bool:
        why = self.captured.refusal(step.kv_cache, step.count)
        return step.decline(self.name, why) if why else True

    def run(self, step: Step) -> torch.Tensor | None:
        token = step.token if step.token is not None else step.ids()
        logits = self.captured.step(token, step.kv_cache)
        if logits is None:
            why = self.captured.off_because or "an expert has not landed, or several sequences"
            step.decline(self.name, why)
            return None
        return logits if step.token is not None else logits[-step.keep :]


class ReplayPath:
    """A one-token step through the graph `WholeGraphPath` prepared on the last one."""

    name = "ggml-replay"

    def __init__(self, lean, whole):
        self.lean, self.whole = lean, whole

    def takes(self, step: Step) -> bool:
        if step.token is None:
            return step.decline(self.name, "a step of several tokens")
        if not self.whole.embeds():
            return step.decline(self.name, "the embedding is hooked or not a table ggml reads")
        if self.whole.prepared() is None:
            return step.decline(self.name, "no one-token graph prepared yet")
        why = _lean_refusal(self.lean, step) or _graph_refusal(self.whole, step)
        return step.decline(self.name, why) if why else True

    def run(self, step: Step) -> torch.Tensor | None:
        logits = self.whole.prepared().step(step.token, self.lean.rotary, step.kv_cache)
        if logits is None:
            step.decline(self.name, "the prepared graph does not fit this step's cache buffers")
        return logits


class WholeGraphPath:
    """A step's layers and head in one ggml graph, from the token ids where it looks them up."""

    name = "ggml-whole"

    def __init__(self, lean, whole):
        self.lean, self.whole = lean, whole

    def takes(self, step: Step) -> bool:
        if step.count > MAX_FOLDED_QUERIES:
            return step.decline(self.name, f"a step of more than {MAX_FOLDED_QUERIES} tokens")
        why = _lean_refusal(self.lean, step) or _graph_refusal(self.whole, step)
        return step.decline(self.name, why) if why else True

    def run(self, step: Step) -> torch.Tensor | None:
        whole, rotary, kv_cache = self.whole, self.lean.rotary, step.kv_cache
        past = kv_cache.get_seq_length()
        if whole.embeds():
            if step.token is not None:
                logits = whole.decode(step.token, rotary, kv_cache)  # prepares the next token's replay
            else:
                ids = whole.embedding.ids(step.tokens)
                logits = (
                    None
                    if ids is None
                    else whole.of_ids(ids, *rotary.at(past, step.count), kv_cache, step.keep)
                )
        else:  # the embedding's module looks the tokens up (hooked, or not a table ggml reads)
            step.embedded = self.lean.embed(step.ids(), past)
            hidden, cos, sin = step.embedded
            logits = whole(hidden, cos, sin, kv_cache, step.keep) if hidden.dtype == torch.float32 else None
            if logits is not None and step.token is not None:
                logits = logits[-1]
        if logits is None:
            step.decline(
                self.name, _layers_refusal(whole, kv_cache, step.count) or "a token outside the table"
            )
        return logits


class LeanPath:
    """The standard decoder layer by layer, its layers' ggml ends where they have them."""

    def __init__(self, lean):
        self.lean = lean
        self.name = "lean+ggml" if any(layer.ends is not None for layer in lean.layers) else "lean"

    def takes(self, step: Step) -> bool:
        why = _lean_refusal(self.lean, step)
        return step.decline(self.name, why) if why else True

    def run(self, step: Step) -> torch.Tensor:
        with torch.inference_mode():
            logits = self.lean.step(step.ids(), step.kv_cache, step.keep, step.embedded)
        return logits[-1] if step.token is not None else logits


class TransformersPath:
    """The model's own forward."""

    name = "transformers"

    def __init__(self, hf_model: nn.Module):
        self.hf_model = hf_model

    def takes(self, step: Step) -> bool:
        return True

    def run(self, step: Step) -> torch.Tensor:
        with torch.inference_mode():
            kwargs = with_cache(self.hf_model, step.kv_cache, use_cache=True, logits_to_keep=step.keep)
            logits = self.hf_model(input_ids=step.ids(), **kwargs).logits[0]
        return logits[-1] if step.token is not None else logits


def _graph_refusal(whole, step: Step) -> str:
    """Why the step's one graph may not run `step` before it is tried ('' when it may)."""
    kv_cache = step.kv_cache
    if getattr(kv_cache, "offloading", False):
        return "the KV cache is offloaded"
    if whole.head.hooked():
        return "a hook on the lm_head"
    if not attends_in_graph(kv_cache.get_seq_length(), step.count):
        return "past the graph's attention limit (torch's attention is faster there)"
    return ""


def _layers_refusal(whole, kv_cache, tokens: int) -> str:
    """Why a layer's part of the one graph declined a step (asked only once it has)."""
    for index, (end, cache) in enumerate(zip(whole.ends, kv_cache.layers, strict=False)):
        why = end.moe.refusal() if end.moe is not None else "no MoE block in ggml"
        if why:
            return f"layer {index}: {why}"
        if end.room(cache, tokens) is None:
            if not cache.get_seq_length():
                return f"layer {index}: its KV cache holds no prompt yet (a prefill)"
            return f"layer {index}: its KV cache has no float32 room the graph can hold"
    return ""
