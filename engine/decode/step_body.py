"""The standard decoder's one-token step over static KV buffers: what the whole-step CUDA graph
(engine.decode.captured_step) holds for a family whose decoder is the standard one.

Contract: `StepBody(hf_model)`; `choose_fused(device, dtype, wanted)` picks the fused decoder
kernels once a dtype; `extras(buffers, device)` the inputs besides the token, the position and
the buffers; `body(token, position, buffers, *extras)` the logits `[V]` of `token [1, 1]` at the
device position `position [1]`, its keys and values written into `buffers` there.

What it holds: the token's row from a device id, the rotary angles gathered
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
routers.

Without the fused attention, attention is `scaled_dot_product_attention` over every buffered
position with a mask (the positions past the length zeroed at the capture: 0 · NaN would not be 0): the
same softmax over the same keys as the model's attention over its cache (the masked positions add
exact zeros), summed in another order.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from engine.decode.fused_decoder import FusedDecoder, epsilon, qk_norm_weights
from engine.decode.lean import QkNorm, RotaryTable
from engine.model.hf_calls import decoder_of

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
