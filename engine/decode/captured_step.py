"""A decode step as one CUDA graph, when every expert is on the device: a token's step, and the
steps of a few tokens (a draft's verification; one graph a token count).

Contract: `CapturedStep.of(model)` is the whole-step graph of an `OffloadedModel`, or None where
its steps cannot be held (why: logged); `refusal(kv_cache, count)` says why a step of `count`
tokens may not go this way now ('' when it may); `step(token, kv_cache)` is the logits `[V]` of
an id `token` after the cache's positions — or `[T, V]` of ids `[1, T]` (T ≤ `MAX_TOKENS`) —
or None where the step could not be captured (why in `off_because`; the next path computes it
and the graph is not tried again); `needs_every_position`: the model's caches must keep every
position of their sliding-window layers for the graph to take their steps.

The body: `StepBody` (engine.decode.step_body) where the decoder is the standard one
(`engine.decode.lean.standard_refusal`), its pieces in the fused decoder kernels where they apply;
else `ModuleBody` (engine.decode.module_step): transformers' own forward over a cache that writes
at the device position, every module of the family inside the graph (MLA, sinks, soft caps,
multipliers, sliding windows), where every layer's cache is attention positions. Steps of
several tokens always go through the model's own modules (`ModuleBody` with offsets: each token
at the first's device position plus its offset, attending to the positions before it and itself).
A graph is kept for each kind of step (`_kind`: an id or ids, how many, the draft routing it runs
under), so drafting, verifying and plain steps alternate without capturing again; they share one
memory pool (they never run at once, and a step's logits are read before the next step, which
may rewrite them: the contract of one graph already), so a new kind costs little device memory.
SS-MoE's self-draft steps run in graphs too: their top-r cut is computed on the device
(`DraftRouting.in_graph`); cached-only drafts and substitutes are the host's and go eagerly.

Outside the graph, after each replay (the epilogue): each layer cache counts its new position
(`GrowingLayer.written`), the device cache counts the step's hits (as many as the eager step
that preceded the capture counted), and the routers' latest logits are the graph's own buffers in
the routing trace. The first step of a capacity runs eagerly once (CUDA's lazy initialisations;
its KV write is the same the replay does again), then is captured and replayed. Its inputs are
written by two fills (the token id and the position, host ints: no copy from the host, no
synchronisation); sampling reads the logits on the device, so a token costs one host
synchronisation (the sampled id).

tests/engine/decode/test_captured_step.py runs the bodies eagerly on the CPU through a stand-in
capture (`eager_capture`) against the model's own steps (greedy tokens identical, fp32 logits to
1e-5) and under FakeTensorMode, where any host read raises; tests/engine/cuda captures them for real.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.decode.lean import standard_refusal
from engine.decode.module_step import ModuleBody, module_refusal, windowed_layers
from engine.decode.step_body import Buffers, StepBody
from engine.model.hf_calls import decoder_of
from engine.model.kv_cache import GrowingLayer
from engine.moe.cuda_graphs import Capture, cuda_capture

log = logging.getLogger(__name__)

MAX_TOKENS = 16  # the most tokens a captured step takes: a draft's verification (one graph a count)


@dataclass
class _Graph:
    """One captured step: what it reads (the KV buffers, the slot tables: kept alive by it), its
    inputs and output."""

    buffers: Buffers
    tables: tuple[torch.Tensor, ...]
    graph: object  # .replay()
    token: torch.Tensor  # [1, T] int64
    position: torch.Tensor  # [1] int64: the first token's
    logits: torch.Tensor  # [V], or [T, V] for several tokens
    hits: int  # the device cache's hits of one step
    routes: dict[int, torch.Tensor]  # the routers' logits the trace's hooks recorded in the capture

    def reads(self, buffers: Buffers, tables: tuple[torch.Tensor, ...]) -> bool:
        """Whether this graph computes a step over `buffers` and `tables`."""
        return all(a is b for a, b in zip(self.tables, tables, strict=True)) and all(
            mine.data_ptr() == theirs.data_ptr() and mine.shape == theirs.shape
            for pair, other in zip(self.buffers, buffers, strict=True)
            for mine, theirs in zip(pair, other, strict=True)
        )


class CapturedStep:
    """The whole-step graph of one model (see the module doc)."""

    path = "cuda-graph"  # the step path's name (engine.decode.paths)

    def __init__(self, model, body: StepBody | ModuleBody, capture: Capture = cuda_capture):
        self.body = body
        self.hf_model, self.decoder = model.hf_model, decoder_of(model.hf_model)
        self.cache, self.control, self.trace = model.cache, model.control, model.trace
        self.moe_layers = sorted(model.experts)
        # a step of several tokens (a draft's verification) through the model's own modules
        self.rows = body if isinstance(body, ModuleBody) else _rows_body(model)
        self._capture = capture
        self._pool = None  # the memory pool every graph of the model shares
        self._graphs: dict[tuple, _Graph] = {}  # a graph for each kind of step (`_kind`)
        self.captures = 0
        self.off_because: str | None = None  # why the graph was turned off, once it was
        self._fused_for: tuple | None = None  # the device and dtype the body's kernels were chosen for

    @classmethod
    def of(cls, model, capture: Capture | None = None) -> CapturedStep | None:
        """The graph of `model` (an `OffloadedModel`) on CUDA (elsewhere only given a `capture`:
        tests), where it has MoE layers and its steps can be held: through the standard decoder's
        body, else through its own modules (engine.decode.module_step); else None."""
        if capture is None and model.device.type != "cuda":
            return None
        if not model.experts:
            log.info("Decode steps are not captured as one CUDA graph: no MoE layer")
            return None
        nonstandard = standard_refusal(model.hf_model)
        if not nonstandard:
            return cls(model, StepBody(model.hf_model), capture or cuda_capture)
        why = module_refusal(model.hf_config)
        if why:
            log.info("Decode steps are not captured as one CUDA graph: %s", why)
            return None
        log.info("Decode steps are captured through the model's own modules: %s", nonstandard)
        body = ModuleBody(model.hf_model, windowed_layers(model.hf_config))
        return cls(model, body, capture or cuda_capture)

    @property
    def needs_every_position(self) -> bool:
        return self.body.needs_every_position

    def refusal(self, kv_cache, count: int = 1, budgeted: bool = False) -> str:
        """Why a step of `count` tokens over `kv_cache` may not be a replay now ('' when it may);
        `budgeted`: the experts may be missing (engine.decode.piecewise_step brings them in)."""
        if self.off_because is not None:
            return f"turned off after a failed capture ({self.off_because})"
        if count > MAX_TOKENS:
            return f"a step of {count} tokens (graphs take up to {MAX_TOKENS})"
        if count > 1 and self.rows is None:
            return "no body for several tokens (the family's caches are not all attention positions)"
        control = self.control
        if any(m._forward_hooks or m._forward_pre_hooks for m in (self.hf_model, self.decoder)):
            return "a hook on the model or its decoder"
        if control.draft is not None and not control.draft.in_graph:
            return "a draft whose routing the host decides (cached experts only, or substitutes)"
        if control.observers and not budgeted:
            return "a prefetch predictor watches the layers"
        if control.graphs is not None:
            return "per-layer expert graphs are asked for"
        if not budgeted and not self.cache.holds_all:
            return "the device cache does not hold every expert"
        layers = getattr(kv_cache, "layers", ())
        if len(layers) != len(self.decoder.layers) or any(type(x) is not GrowingLayer for x in layers):
            return "a layer cache that is not the engine's attention buffers (or keeps another dtype)"
        if not kv_cache.get_seq_length():
            return "the KV cache holds no prompt yet (a prefill)"
        return ""

    def step(self, token: int | torch.Tensor, kv_cache) -> torch.Tensor | None:
        """The logits `[V]` of `token` after `kv_cache`'s positions — or `[T, V]` of ids `[1, T]`
        on the device (a draft's verification) — in a buffer the next step rewrites; None where
        the step cannot be captured."""
        one = isinstance(token, int)
        count = 1 if one else token.shape[1]
        past = kv_cache.get_seq_length()
        buffers = tuple(layer.room(count) for layer in kv_cache.layers)
        tables = self._tables()
        if any(pair is None for pair in buffers) or any(table is None for table in tables):
            return None  # several sequences, or an expert not landed: the next path's step
        graph = self._graphs.get(self._kind(token))
        if graph is None or not graph.reads(buffers, tables):
            graph = self._captured(buffers, tables, token, past)
            if graph is None:
                return None
        if one:
            graph.token.fill_(token)
        else:
            graph.token.copy_(token)
        graph.position.fill_(past)
        with self.control.installed(counts_hits=False, graphed=True):  # the epilogue counts
            graph.graph.replay()
        for layer in kv_cache.layers:
            layer.written(count)
        if graph.hits:
            self.cache.count_hits(graph.hits)
        self.trace.logits.update(graph.routes)
        return graph.logits

    def _tables(self) -> tuple[torch.Tensor | None, ...]:
        """What the experts read their slots from: each MoE layer's slot table (None: not landed)."""
        return tuple(self.cache.slot_table(layer) for layer in self.moe_layers)

    def _kind(self, token) -> tuple:
        """What tells a step's graph from another's: an id (the body's) or ids `[1, T]` (the body
        of several tokens'), how many, and the draft routing it runs under."""
        one = isinstance(token, int)
        return one, 1 if one else token.shape[1], self.control.draft

    def _captured(self, buffers: Buffers, tables: tuple, token, past: int) -> _Graph | None:
        """The graph of a step of `token` (an id, or ids `[1, T]`), captured over `buffers` and
        `tables`: one graph a `_kind` of step, replacing that kind's last."""
        kind = self._kind(token)
        self._graphs.pop(kind, None)  # its memory back to the pool before the next capture
        device = buffers[0][0].device
        run = functools.partial(self._run, self.body if kind[0] else self.rows)
        try:
            self._fuse(device, buffers[0][0].dtype)
            inputs = self._inputs(buffers, token, past, device)
            with self.control.installed(graphed=True):
                hits = self._hits_of(run, inputs)
                with torch.inference_mode(), self.control.installed(counts_hits=False):
                    if self._pool is None and device.type == "cuda":
                        self._pool = torch.cuda.graph_pool_handle()
                    graph, logits = self._capture(run, inputs, self._pool)
        except Exception as err:  # any failure: the step goes the eager way, from now on
            self.off_because = f"{type(err).__name__}: {err}"
            log.warning("The decode step is no longer captured as a CUDA graph: %s", self.off_because)
            return None
        self.captures += 1
        routes = {layer: self.trace.logits[layer] for layer in self.moe_layers if layer in self.trace.logits}
        self._graphs[kind] = _Graph(buffers, tables, graph, inputs[0], inputs[1], logits, hits, routes)
        return self._graphs[kind]

    def _fuse(self, device: torch.device, dtype: torch.dtype) -> None:
        """The body's fused kernels for `dtype`, chosen once a dtype."""
        if self._fused_for != (device, dtype):
            self.body.choose_fused(device, dtype, self.control.fused)
            self._fused_for = (device, dtype)

    def _inputs(self, buffers: Buffers, token, past: int, device: torch.device) -> tuple:
        """The graph's inputs: the token ids `[1, T]` and the first's position `[1]` (written before
        each replay), the buffers, and the body's own (one token: `body.extras`; several: the
        offsets `arange(T)` of the tokens from the first)."""
        with torch.inference_mode():  # the buffers are inference tensors (the steps' own)
            for buffer in (buffer for pair in buffers for buffer in pair):
                # the attention weighs the positions past the length by exact zeros: they must
                # hold finite values (a new buffer's memory may hold NaN, and 0 · NaN is NaN)
                buffer[..., past:, :].zero_()
        position = torch.full((1,), past, dtype=torch.int64, device=device)
        if isinstance(token, int):
            token_ = torch.full((1, 1), token, dtype=torch.int64, device=device)
            return (token_, position, buffers, *self.body.extras(buffers, device))
        offsets = torch.arange(token.shape[1], device=device)
        return (token.to(device, torch.int64, copy=True), position, buffers, offsets)

    @staticmethod
    def _run(body, *inputs) -> torch.Tensor:
        with torch.inference_mode():
            return body(*inputs)

    def _hits_of(self, run: Callable, inputs: tuple) -> int:
        """The hits the device cache counts in one step: the step run eagerly once (before its
        capture: CUDA's lazy initialisations happen outside it), its count taken back (the replay
        that follows counts the step)."""
        counters = self.cache.stats.phases[self.cache.phase]
        before = counters.hits
        run(*inputs)
        hits, counters.hits = counters.hits - before, before
        return hits


def _rows_body(model) -> ModuleBody | None:
    """The body of the standard decoder's steps of several tokens: its own modules (the fused
    decoder kernels take one token), where every layer's cache is attention positions."""
    if module_refusal(model.hf_config):
        return None
    return ModuleBody(model.hf_model, windowed_layers(model.hf_config))


class EagerGraph:
    """A stand-in for a CUDA graph off CUDA (`eager_capture`): `replay` runs the body again over the
    captured inputs and writes its logits into the captured output, as a replay rewrites the
    graph's buffers. For the bench's CUDA emulation and the tests: what a replay launches, counted."""

    def __init__(self, fn: Callable, inputs: tuple, out: torch.Tensor):
        self.fn, self.inputs, self.out = fn, inputs, out

    def replay(self) -> None:
        with torch.inference_mode():
            self.out.copy_(self.fn(*self.inputs))


def eager_capture(fn: Callable, inputs: tuple, pool) -> tuple[EagerGraph, torch.Tensor]:
    """`Capture`'s contract without CUDA: the body run once, then again at each replay."""
    out = fn(*inputs).clone()
    return EagerGraph(fn, inputs, out), out
