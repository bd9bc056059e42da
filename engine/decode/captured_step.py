"""A one-token decode step as one CUDA graph, when every expert is on the device.

Contract: `CapturedStep.of(model)` is the whole-step graph of an `OffloadedModel` whose decoder is
the standard one (`engine.decode.lean.standard_refusal`), or None; `refusal(kv_cache)` says why a
step may not go this way now ('' when it may); `step(token, kv_cache)` is the logits `[V]` of
`token` after the cache's positions, or None where the step could not be captured (why in
`off_because`; the next path computes it and the graph is not tried again).

What the graph holds (`StepBody`): the token's row from a device id, the rotary angles gathered
at a device position from a table of the capacity's positions, and each layer as the standard
decoder computes it — input norm, q/k/v, q/k norms, rotation, the new key and value written into the
layer's KV buffers at the device position (`index_copy_`), attention over the buffers' whole
capacity with the positions past the device length masked out (one graph a capacity: the
engine's `GrowingLayer` buffers grow by a quarter, so a conversation captures a few times), o_proj,
the residual, the post-attention norm and the family's own MoE block (its router, and its
experts through the layer's slot table: `batched_experts.forward_resident` or the fused kernels,
which read nothing on the host) — then the final norm and the lm_head. Its inputs are written by
two fills (the token id and the position, host ints: no copy from the host, no synchronisation);
sampling reads the logits on the device, so a token costs one host synchronisation (the sampled id).

Outside the graph, after each replay (the epilogue): each layer cache counts its new position
(`GrowingLayer.written`), the device cache counts the step's hits (as many as the eager step
that preceded the capture counted), and the routers' latest logits are the graph's own buffers in
the routing trace. The first step of a capacity runs eagerly once (CUDA's lazy initialisations;
its KV write is the same the replay does again), then is captured and replayed.

Attention here is `scaled_dot_product_attention` over every buffered position with a mask: the
same softmax over the same keys as the model's attention over its cache (the masked positions add
exact zeros), summed in another order. tests/engine/decode/test_captured_step.py runs the body
eagerly on the CPU against the model's own steps (greedy tokens identical, fp32 logits to 1e-5)
and under FakeTensorMode, where any host read raises; tests/engine/cuda captures it for real.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.decode.lean import QkNorm, RotaryTable, standard_refusal
from engine.model.hf_calls import decoder_of
from engine.model.kv_cache import GrowingLayer
from engine.moe.cuda_graphs import Capture, cuda_capture

log = logging.getLogger(__name__)

# (keys, values) `[1, kv heads, capacity, D]` of each layer: the buffers a graph writes and reads
Buffers = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class StepBody:
    """What the graph captures: one token through the standard decoder over static buffers."""

    def __init__(self, hf_model: nn.Module):
        decoder = decoder_of(hf_model)
        self.embed, self.norm, self.head = decoder.embed_tokens, decoder.norm, hf_model.lm_head
        self.layers = [_Layer(layer) for layer in decoder.layers]
        self.rotary = RotaryTable(decoder.rotary_emb)
        self.apply_rotary = sys.modules[type(decoder.layers[0].self_attn).__module__].apply_rotary_pos_emb

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
        hidden = self.embed(token)
        cos, sin = cos_table.index_select(1, position), sin_table.index_select(1, position)
        mask = (positions <= position)[None, None, None, :]  # the positions written so far, this one's too
        for layer, (keys, values) in zip(self.layers, buffers, strict=True):
            hidden = layer(hidden, cos, sin, keys, values, position, mask, self.apply_rotary)
        return self.head(self.norm(hidden))[0, -1]


class _Layer:
    """One standard decoder layer's one-token step over its KV buffers."""

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

    def __call__(self, hidden, cos, sin, keys, values, position, mask, apply_rotary) -> torch.Tensor:
        x = self.input_norm(hidden)
        heads = (1, 1, -1, self.head_dim)
        query = self.q_norm(self.q_proj(x), heads).transpose(1, 2)
        key = self.k_norm(self.k_proj(x), heads).transpose(1, 2)
        value = self.v_proj(x).view(heads).transpose(1, 2)
        query, key = apply_rotary(query, key, cos, sin)
        keys.index_copy_(2, position, key.to(keys.dtype))
        values.index_copy_(2, position, value.to(values.dtype))
        grouped = query.shape[1] != keys.shape[1]
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=grouped
        )
        hidden = hidden + self.o_proj(out.transpose(1, 2).reshape(1, 1, -1))
        return hidden + self.mlp(self.post_norm(hidden))


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

    def __init__(self, model, capture: Capture = cuda_capture):
        self.body = StepBody(model.hf_model)
        self.hf_model, self.decoder = model.hf_model, decoder_of(model.hf_model)
        self.cache, self.control, self.trace = model.cache, model.control, model.trace
        self.moe_layers = sorted(model.experts)
        self._capture = capture
        self._pool = None
        self._graph: _Graph | None = None
        self.captures = 0
        self.off_because: str | None = None  # why the graph was turned off, once it was

    @classmethod
    def of(cls, model, capture: Capture | None = None) -> CapturedStep | None:
        """The graph of `model` (an `OffloadedModel`) on CUDA (elsewhere only given a `capture`:
        tests), where its decoder is the standard one and it has MoE layers; else None."""
        if capture is None and model.device.type != "cuda":
            return None
        reason = standard_refusal(model.hf_model) or ("" if model.experts else "no MoE layer")
        if reason:
            log.info("Decode steps are not captured as one CUDA graph: %s", reason)
            return None
        return cls(model, capture or cuda_capture)

    def refusal(self, kv_cache) -> str:
        """Why a one-token step over `kv_cache` may not be a replay now ('' when it may)."""
        if self.off_because is not None:
            return f"turned off after a failed capture ({self.off_because})"
        control = self.control
        if any(m._forward_hooks or m._forward_pre_hooks for m in (self.hf_model, self.decoder)):
            return "a hook on the model or its decoder"
        if control.observers or control.draft is not None:
            return "a prefetch predictor or a draft watches the layers"
        if control.graphs is not None:
            return "per-layer expert graphs are asked for"
        if not self.cache.holds_all:
            return "the device cache does not hold every expert"
        layers = getattr(kv_cache, "layers", ())
        if len(layers) != len(self.body.layers) or any(type(layer) is not GrowingLayer for layer in layers):
            return "a layer cache that is not the engine's attention buffers (or keeps another dtype)"
        if not kv_cache.get_seq_length():
            return "the KV cache holds no prompt yet (a prefill)"
        return ""

    def step(self, token: int, kv_cache) -> torch.Tensor | None:
        """The logits `[V]` of `token` after `kv_cache`'s positions (a buffer the next step
        rewrites), or None where the step cannot be captured."""
        past = kv_cache.get_seq_length()
        buffers = tuple(layer.room(1) for layer in kv_cache.layers)
        tables = tuple(self.cache.slot_table(layer) for layer in self.moe_layers)
        if any(pair is None for pair in buffers) or any(table is None for table in tables):
            return None  # several sequences, or an expert not landed: the next path's step
        graph = self._graph
        if graph is None or not graph.reads(buffers, tables):
            graph = self._captured(buffers, tables, token, past)
            if graph is None:
                return None
        graph.token.fill_(token)
        graph.position.fill_(past)
        graph.graph.replay()
        for layer in kv_cache.layers:
            layer.written(1)
        if graph.hits:
            self.cache.count_hits(graph.hits)
        self.trace.logits.update(graph.routes)
        return graph.logits

    def _captured(self, buffers: Buffers, tables: tuple, token: int, past: int) -> _Graph | None:
        self._graph = None  # its memory back to the pool before the next capture
        device = buffers[0][0].device
        try:
            inputs = self._inputs(buffers, token, past, device)
            hits = self._hits_of(inputs)
            with torch.inference_mode(), self.control.installed(counts_hits=False):
                if self._pool is None and self._capture is cuda_capture:
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

    def _inputs(self, buffers: Buffers, token: int, past: int, device: torch.device) -> tuple:
        capacity, dtype = buffers[0][0].shape[-2], buffers[0][0].dtype
        with torch.inference_mode():  # the buffers are inference tensors (the steps' own)
            for buffer in (buffer for pair in buffers for buffer in pair):
                # the attention weighs the positions past the length by exact zeros: they must
                # hold finite values (a new buffer's memory may hold NaN, and 0 · NaN is NaN)
                buffer[..., past:, :].zero_()
        tables = self.body.rotary.table(torch.empty(0, dtype=dtype, device=device), capacity)
        if tables is None or tables[0].shape[1] < capacity:
            raise ValueError(f"no rotary table of {capacity} positions (dynamic frequencies, or too long)")
        token_ = torch.full((1, 1), token, dtype=torch.int64, device=device)
        position = torch.full((1,), past, dtype=torch.int64, device=device)
        return (token_, position, buffers, torch.arange(capacity, device=device), *tables)

    def _run(self, token, position, buffers, positions, cos_table, sin_table) -> torch.Tensor:
        with torch.inference_mode():
            return self.body(token, position, buffers, positions, cos_table, sin_table)

    def _hits_of(self, inputs: tuple) -> int:
        """The hits the device cache counts in one step: the step run eagerly once (before its
        capture: CUDA's lazy initialisations happen outside it), its count taken back (the replay
        that follows counts the step)."""
        counters = self.cache.stats.phases[self.cache.phase]
        before = counters.hits
        self._run(*inputs)
        hits, counters.hits = counters.hits - before, before
        return hits
