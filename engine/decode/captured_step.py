"""A one-token decode step as one CUDA graph, when every expert is on the device.

Contract: `CapturedStep.of(model)` is the whole-step graph of an `OffloadedModel`, or None where
its steps cannot be held (why: logged); `refusal(kv_cache)` says why a step may not go this way
now ('' when it may); `step(token, kv_cache)` is the logits `[V]` of `token` after the cache's
positions, or None where the step could not be captured (why in `off_because`; the next path
computes it and the graph is not tried again); `needs_every_position`: the model's caches must
keep every position of their sliding-window layers for the graph to take their steps.

The body: `StepBody` (below) where the decoder is the standard one
(`engine.decode.lean.standard_refusal`), its pieces in the fused decoder kernels where they apply;
else `ModuleBody` (engine.decode.module_step): transformers' own forward over a cache that writes
at the device position, every module of the family inside the graph (MLA, sinks, soft caps,
multipliers, sliding windows), where every layer's cache is attention positions.

What the standard body holds: the token's row from a device id, the rotary angles gathered
at a device position from a table of the capacity's positions, and each layer as the standard
decoder computes it — input norm, q/k/v, q/k norms, rotation, the new key and value written into the
layer's KV buffers at the device position (`index_copy_`), attention over the buffers' whole
capacity with the positions past the device length masked out (one graph a capacity: the
engine's `GrowingLayer` buffers grow by a quarter, so a conversation captures a few times), o_proj,
the residual, the post-attention norm and the family's own MoE block (its router, and its
experts through the layer's slot table: `batched_experts.forward_resident` or the fused kernels,
which read nothing on the host) — then the final norm and the lm_head. Where the fused decoder
takes a piece (`engine.decode.fused_decoder`: each probed on the device once a dtype), its kernels
compute it instead: the norms with the residual adds, rotary + KV write, the attention, the
routers. Its inputs are written by
two fills (the token id and the position, host ints: no copy from the host, no synchronisation);
sampling reads the logits on the device, so a token costs one host synchronisation (the sampled id).

Outside the graph, after each replay (the epilogue): each layer cache counts its new position
(`GrowingLayer.written`), the device cache counts the step's hits (as many as the eager step
that preceded the capture counted), and the routers' latest logits are the graph's own buffers in
the routing trace. The first step of a capacity runs eagerly once (CUDA's lazy initialisations;
its KV write is the same the replay does again), then is captured and replayed.

Without the fused attention, attention is `scaled_dot_product_attention` over every buffered
position with a mask (the positions past the length zeroed at the capture: 0 · NaN would not be 0): the
same softmax over the same keys as the model's attention over its cache (the masked positions add
exact zeros), summed in another order. tests/engine/decode/test_captured_step.py runs the body
eagerly on the CPU against the model's own steps (greedy tokens identical, fp32 logits to 1e-5)
and under FakeTensorMode, where any host read raises; tests/engine/cuda captures it for real.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.decode.fused_decoder import FusedDecoder, epsilon, qk_norm_weights
from engine.decode.lean import QkNorm, RotaryTable, standard_refusal
from engine.decode.module_step import ModuleBody, module_refusal, windowed_layers
from engine.model.hf_calls import decoder_of
from engine.model.kv_cache import GrowingLayer
from engine.moe.cuda_graphs import Capture, cuda_capture

log = logging.getLogger(__name__)

# (keys, values) `[1, kv heads, capacity, D]` of each layer: the buffers a graph writes and reads
Buffers = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class StepBody:
    """What the graph captures: one token through the standard decoder over static buffers, its
    pieces in the fused kernels where `fused` (a `FusedDecoder`) takes them."""

    needs_every_position = False  # no layer attends over a window

    def __init__(self, hf_model: nn.Module):
        decoder = decoder_of(hf_model)
        self.embed, self.norm, self.head = decoder.embed_tokens, decoder.norm, hf_model.lm_head
        self.layers = [_Layer(layer) for layer in decoder.layers]
        self.rotary = RotaryTable(decoder.rotary_emb)
        self.apply_rotary = sys.modules[type(decoder.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.fused: FusedDecoder | None = None

    def __call__(
        self,
        token: torch.Tensor,
        position: torch.Tensor,
        buffers: Buffers,
        positions: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> torch.Tensor:
        """Logits `[V]` of `token [1, 1]` at `position [1]` (int64, on the device), its keys and
        values written into `buffers` there; `positions` is `arange(capacity)`, the tables the
        rotary angles `[1, ≥ capacity, D]`. No value is read on the host."""
        fused = self.fused
        at = _At(position, (cos_table[0], sin_table[0]), self.apply_rotary)
        if fused is None or not fused.rotary:
            at.cos, at.sin = cos_table.index_select(1, position), sin_table.index_select(1, position)
        if fused is None or not fused.attention:
            at.mask = (positions <= position)[None, None, None, :]  # the positions written so far
        residual = self.embed(token).reshape(1, -1)
        if fused is not None and fused.norms:
            residual = residual.clone()  # the kernels add to it in place
            x = fused.rms_norm(residual, self.layers[0].input_norm.weight, epsilon(self.layers[0].input_norm))
        else:
            x = self.layers[0].input_norm(residual)
        with _routers(fused):
            norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]  # what follows each
            for layer, (keys, values), following in zip(self.layers, buffers, norms, strict=True):
                attended = layer.attend(x, at, keys, values, fused)
                residual, x = self._add_norm(attended, residual, layer.post_norm)
                residual, x = self._add_norm(layer.mlp(x.view(1, 1, -1)).view(1, -1), residual, following)
        return self.head(x)[0]

    def choose_fused(self, device: torch.device, dtype: torch.dtype, wanted) -> None:
        """The fused kernels for `dtype` (`wanted`: the model's `control.fused`), probed on the
        device; why none: logged."""
        fused = FusedDecoder.of(self, device, dtype, wanted)
        if isinstance(fused, str):
            log.info("The captured step computes its decoder in torch: %s", fused)
            fused = None
        self.fused = fused

    def extras(self, buffers: Buffers, device: torch.device) -> tuple:
        """The inputs besides the token, the position and the buffers: `arange(capacity)` and the
        rotary tables of the capacity's positions."""
        capacity, dtype = buffers[0][0].shape[-2], buffers[0][0].dtype
        tables = self.rotary.table(torch.empty(0, dtype=dtype, device=device), capacity)
        if tables is None or tables[0].shape[1] < capacity:
            raise ValueError(f"no rotary table of {capacity} positions (dynamic frequencies, or too long)")
        return (torch.arange(capacity, device=device), *tables)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple:
        """`residual + x` and its norm: one kernel where the norms are fused (the sum in place)."""
        if self.fused is not None and self.fused.norms:
            return residual, self.fused.rms_norm(x, norm.weight, epsilon(norm), residual=residual)
        residual = residual + x
        return residual, norm(residual)


class _At:
    """Where a step writes and reads: the device position, the rotary tables `[positions, D]` and
    the family's rotation; the position's angles and the mask where the modules need them."""

    def __init__(self, position: torch.Tensor, tables: tuple, apply_rotary: Callable):
        self.position, self.tables, self.apply_rotary = position, tables, apply_rotary
        self.cos = self.sin = self.mask = None


class _Layer:
    """One standard decoder layer's one-token attention over its KV buffers."""

    def __init__(self, layer: nn.Module):
        attention = layer.self_attn
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.mlp = layer.mlp
        self.q_proj, self.k_proj = attention.q_proj, attention.k_proj
        self.v_proj, self.o_proj = attention.v_proj, attention.o_proj
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        # the modules as the model's forward calls them (the loader fused the norms it could on CUDA)
        self.q_norm = QkNorm.of(getattr(attention, "q_norm", None), self.head_dim, fuse=False)
        self.k_norm = QkNorm.of(getattr(attention, "k_norm", None), self.head_dim, fuse=False)

    def attend(self, x: torch.Tensor, at: _At, keys, values, fused: FusedDecoder | None) -> torch.Tensor:
        """o_proj's output `[1, H]` of the normed `x [1, H]`, its key and value written at the position."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if fused is not None and fused.rotary:
            weights, eps = qk_norm_weights(self)
            q, k, v = (t.view(-1, self.head_dim) for t in (q, k, v))
            query = fused.rope_kv_write(q, k, v, at.tables, at.position, keys, values, weights, eps)
        else:
            heads = (1, 1, -1, self.head_dim)  # [B, T, heads, D], as the attention views its projections
            query, key = self.q_norm(q, heads).transpose(1, 2), self.k_norm(k, heads).transpose(1, 2)
            query, key = at.apply_rotary(query, key, at.cos, at.sin)
            keys.index_copy_(2, at.position, key.to(keys.dtype))
            values.index_copy_(2, at.position, v.view(heads).transpose(1, 2).to(values.dtype))
            query = query[0, :, 0]
        if fused is not None and fused.attention:
            out = fused.attend(query.contiguous(), keys, values, at.position, self.scaling)
        else:
            grouped = query.shape[0] != keys.shape[1]
            out = F.scaled_dot_product_attention(
                query[None, :, None], keys, values, attn_mask=at.mask, scale=self.scaling, enable_gqa=grouped
            )
        return self.o_proj(out.reshape(1, -1))


@contextmanager
def _routers(fused: FusedDecoder | None) -> Iterator[None]:
    """The routers the fused decoder takes computed by `router_top_k` while the body runs (it runs
    Python only while it is captured)."""
    routers = {} if fused is None else fused.routers
    for router, forward in routers.items():
        router.forward = forward
    try:
        yield
    finally:
        for router in routers:
            del router.forward  # the class's forward again


@dataclass
class _Graph:
    """One captured step: what it reads (the KV buffers, the slot tables: kept alive by it), its
    inputs and output."""

    buffers: Buffers
    tables: tuple[torch.Tensor, ...]
    graph: object  # .replay()
    token: torch.Tensor  # [1, 1] int64
    position: torch.Tensor  # [1] int64
    logits: torch.Tensor  # [V]
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
        self._capture = capture
        self._pool = None
        self._graph: _Graph | None = None
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

    def refusal(self, kv_cache, budgeted: bool = False) -> str:
        """Why a one-token step over `kv_cache` may not be a replay now ('' when it may);
        `budgeted`: the experts may be missing (engine.decode.piecewise_step brings them in)."""
        if self.off_because is not None:
            return f"turned off after a failed capture ({self.off_because})"
        control = self.control
        if any(m._forward_hooks or m._forward_pre_hooks for m in (self.hf_model, self.decoder)):
            return "a hook on the model or its decoder"
        if control.observers or control.draft is not None:
            return "a prefetch predictor or a draft watches the layers"
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

    def step(self, token: int, kv_cache) -> torch.Tensor | None:
        """The logits `[V]` of `token` after `kv_cache`'s positions (a buffer the next step
        rewrites), or None where the step cannot be captured."""
        past = kv_cache.get_seq_length()
        buffers = tuple(layer.room(1) for layer in kv_cache.layers)
        tables = self._tables()
        if any(pair is None for pair in buffers) or any(table is None for table in tables):
            return None  # several sequences, or an expert not landed: the next path's step
        graph = self._graph
        if graph is None or not graph.reads(buffers, tables):
            graph = self._captured(buffers, tables, token, past)
            if graph is None:
                return None
        graph.token.fill_(token)
        graph.position.fill_(past)
        with self.control.installed(counts_hits=False):  # the epilogue counts (a stand-in runs Python)
            graph.graph.replay()
        for layer in kv_cache.layers:
            layer.written(1)
        if graph.hits:
            self.cache.count_hits(graph.hits)
        self.trace.logits.update(graph.routes)
        return graph.logits

    def _tables(self) -> tuple[torch.Tensor | None, ...]:
        """What the experts read their slots from: each MoE layer's slot table (None: not landed)."""
        return tuple(self.cache.slot_table(layer) for layer in self.moe_layers)

    def _captured(self, buffers: Buffers, tables: tuple, token: int, past: int) -> _Graph | None:
        self._graph = None  # its memory back to the pool before the next capture
        device = buffers[0][0].device
        try:
            self._fuse(device, buffers[0][0].dtype)
            inputs = self._inputs(buffers, token, past, device)
            hits = self._hits_of(inputs)
            with torch.inference_mode(), self.control.installed(counts_hits=False):
                if self._pool is None and device.type == "cuda":
                    self._pool = torch.cuda.graph_pool_handle()
                graph, logits = self._capture(self._run, inputs, self._pool)
        except Exception as err:  # any failure: the step goes the eager way, from now on
            self.off_because = f"{type(err).__name__}: {err}"
            log.warning("The decode step is no longer captured as a CUDA graph: %s", self.off_because)
            return None
        self.captures += 1
        routes = {layer: self.trace.logits[layer] for layer in self.moe_layers if layer in self.trace.logits}
        self._graph = _Graph(buffers, tables, graph, inputs[0], inputs[1], logits, hits, routes)
        return self._graph

    def _fuse(self, device: torch.device, dtype: torch.dtype) -> None:
        """The body's fused kernels for `dtype`, chosen once a dtype."""
        if self._fused_for != (device, dtype):
            self.body.choose_fused(device, dtype, self.control.fused)
            self._fused_for = (device, dtype)

    def _inputs(self, buffers: Buffers, token: int, past: int, device: torch.device) -> tuple:
        with torch.inference_mode():  # the buffers are inference tensors (the steps' own)
            for buffer in (buffer for pair in buffers for buffer in pair):
                # the attention weighs the positions past the length by exact zeros: they must
                # hold finite values (a new buffer's memory may hold NaN, and 0 · NaN is NaN)
                buffer[..., past:, :].zero_()
        token_ = torch.full((1, 1), token, dtype=torch.int64, device=device)
        position = torch.full((1,), past, dtype=torch.int64, device=device)
        return (token_, position, buffers, *self.body.extras(buffers, device))

    def _run(self, *inputs) -> torch.Tensor:
        with torch.inference_mode():
            return self.body(*inputs)

    def _hits_of(self, inputs: tuple) -> int:
        """The hits the device cache counts in one step: the step run eagerly once (before its
        capture: CUDA's lazy initialisations happen outside it), its count taken back (the replay
        that follows counts the step)."""
        counters = self.cache.stats.phases[self.cache.phase]
        before = counters.hits
        self._run(*inputs)
        hits, counters.hits = counters.hits - before, before
        return hits


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
