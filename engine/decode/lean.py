"""The CPU forward of the standard decoder without transformers' per-call machinery around its layers.

Contract: `LeanDecode.of(hf_model)` is a `LeanDecode` when the model is the standard pre-norm
decoder this module reproduces, else None (the reason logged at debug level):

    embed → rotary → each layer [input norm → attention → +residual, post-attention norm → mlp →
    +residual] → final norm → lm_head

with every layer's attention full (no sliding window, sinks, soft-capping or position bias),
made of `q_proj`/`k_proj`/`v_proj`/`o_proj` and optional `q_norm`/`k_norm` (per head or over the
whole projection, as the norm's width says), attending through the engine's CPU attention
(engine.decode.cpu_attention), and no multiplier, scaling or extra norm in the decoder or around
it. `step(tokens, kv_cache, logits_to_keep)` is the logits of the last `logits_to_keep` of
`tokens` (a prefill, a decode step, a speculative verification) appended to `kv_cache`, computed
by calling the model's own submodules in the order its forward calls them (so the projections'
kernels, the offloaded experts, the routers' hooks and the family's own rotary function all run as
they do there), and its attention function with the mask transformers' sdpa mask gives: the same
operations on the same tensors, so the logits equal the model's forward bit for bit — except that
the last layer's MLP runs on the kept positions only, as llama.cpp's output rows do (nothing reads
the others; a prompt's last layer then routes one token, not all), which changes those rows'
products by their batch's rounding. tests/engine/model/test_all_families.py checks both on every
family this accepts. A layer given `ends` (engine.decode.layer_graph) has them do its work before
and after the attention in decode and verification steps (its MLP too, where they take it), and a
`head` the final norm and lm_head of those steps' kept rows, or `whole` all of a step's layers
and head at once (engine.decode.whole_step), from the token ids where it embeds them too.
`takes(kv_cache)` says whether a step may go this way now: no hook on the decoder or the model
(an MTP drafter records the decoder's output) and a cache of attention layers only. Hooks on a
layer's modules run where the step calls those modules (the routers' trace, hooked at load); a norm
found unhooked at load runs as torch's operator, and `ends` replace the modules they cover, so a
hook put on those later is not seen (but one on the MoE block, router or experts: `finish` leaves
it the block; on the lm_head: the head leaves it the module; on the embedding: its module looks
the tokens up).

Why: on a CPU, transformers' wrappers (decorators, output records, mask and position bookkeeping)
cost a decode step a noticeable share of its time on top of the same operators; and a prefill
computed the last layer's experts for every prompt token.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer

from engine.decode.cpu_attention import ATTENTION, MAX_FOLDED_QUERIES, cpu_attention_forward
from engine.decode.row_views import Row
from engine.model.hf_calls import decoder_of

log = logging.getLogger(__name__)
_FLOAT32 = torch.empty(0)  # what the rotary module reads of its input: float32 on the CPU

_LAYER_PARTS = {"self_attn", "input_layernorm", "post_attention_layernorm", "mlp"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
_DECODER_PARTS = {"embed_tokens", "layers", "norm", "rotary_emb"}
# config fields that change the standard computation when set (Granite's multipliers, Gemma's caps)
_CHANGES = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "scale_embeddings",
)


class LeanDecode:
    def __init__(self, hf_model: nn.Module, decoder: nn.Module, rotary: Callable):
        self.hf_model = hf_model
        self.decoder = decoder
        self.layers = [_Layer(layer) for layer in decoder.layers]
        self.apply_rotary = rotary
        self.rotary = RotaryTable(decoder.rotary_emb)
        self.norm = _fused(decoder.norm)
        # the final norm and lm_head on float32 rows in a ggml graph (engine.decode.whole_step):
        # their logits `[n, V]`, or None where it does not take them
        self.head: Callable[[torch.Tensor], torch.Tensor | None] | None = None
        # the token lookup in a ggml graph (engine.decode.whole_step's `Embedding`), or None
        self.embedding = None

    @classmethod
    def of(cls, hf_model: nn.Module) -> LeanDecode | None:
        reason = _refusal(hf_model)
        if reason:
            log.debug("Decode steps through transformers' forward: %s", reason)
            return None
        decoder = decoder_of(hf_model)
        attention = decoder.layers[0].self_attn
        return cls(hf_model, decoder, sys.modules[type(attention).__module__].apply_rotary_pos_emb)

    def refusal(self, kv_cache) -> str:
        """Why a step with `kv_cache` may not go this way ('' when it may): something hooked on
        the decoder or the model (their hooks would not see it), or a layer cache that is not an
        attention cache."""
        model, decoder = self.hf_model, self.decoder  # written out: asked every decode step
        if model._forward_hooks or model._forward_pre_hooks:
            return "a hook on the model"
        if decoder._forward_hooks or decoder._forward_pre_hooks:
            return "a hook on the decoder (an MTP drafter records its output)"
        layers = getattr(kv_cache, "layers", ())
        if len(layers) != len(self.layers) or not all(_attention_cache(type(layer)) for layer in layers):
            return "a layer cache that is not an attention cache"
        return ""

    def takes(self, kv_cache) -> bool:
        """Whether a step with `kv_cache` may go this way now (`refusal` says why not)."""
        return not self.refusal(kv_cache)

    def step(self, tokens: torch.Tensor, kv_cache, logits_to_keep: int = 1, embedded=None) -> torch.Tensor:
        """Logits `[n, V]` of the last `logits_to_keep` (0: all) of `tokens` (`[1, T]` ids) after
        `kv_cache`'s positions; `embedded`: their rows and angles where a caller has them
        (`embed`'s). The last layer's MLP runs on those positions only (llama.cpp's output
        rows): nothing else reads the others' outputs."""
        past, count = kv_cache.get_seq_length(), tokens.shape[1]
        keep = count if logits_to_keep == 0 else min(logits_to_keep, count)
        hidden, cos, sin = embedded if embedded is not None else self.embed(tokens, past)
        # transformers' sdpa mask: none where every query may see every key before it (one query,
        # or no cache: the attention is causal), else a query sees the cache and the new positions
        # up to its own
        mask = None
        if count > 1 and past:
            positions = torch.arange(past, past + count, device=tokens.device)
            mask = (torch.arange(past + count, device=tokens.device) <= positions[:, None])[None, None]
        for index, layer in enumerate(self.layers):
            rows = keep if index == len(self.layers) - 1 else count
            hidden = layer(hidden, cos, sin, kv_cache, self.apply_rotary, mask, rows)
        last = hidden[:, -keep:]
        logits = None
        if self.head is not None and last.dtype == torch.float32 and keep <= MAX_FOLDED_QUERIES:
            logits = self.head(last)
        return self.hf_model.lm_head(self.norm(last))[0] if logits is None else logits

    def embed(self, tokens: torch.Tensor, past: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows `[1, T, H]` of `tokens` and their angles after `past` positions: looked up in
        a ggml graph where the model has one for its table (`embedding`: the module's rows bit
        for bit) and nothing hooks it, for as many tokens as a graph is kept for; else the
        module's."""
        count, embedding = tokens.shape[1], self.embedding
        if embedding is not None and count <= MAX_FOLDED_QUERIES and not embedding.hooked():
            ids = embedding.ids(tokens)
            if ids is not None:
                return embedding(ids), *self.rotary(_FLOAT32, past, count)
        hidden = self.decoder.embed_tokens(tokens)  # [1, T, H]
        return hidden, *self.rotary(hidden, past, count)


class _Layer:
    """One decoder layer's step: its modules as its forward calls them."""

    def __init__(self, layer: nn.Module):
        attention = self.attention = layer.self_attn
        self.input_norm, self.post_norm = (
            _fused(layer.input_layernorm),
            _fused(layer.post_attention_layernorm),
        )
        self.mlp = layer.mlp
        self.q_proj, self.k_proj = attention.q_proj, attention.k_proj
        self.v_proj, self.o_proj = attention.v_proj, attention.o_proj
        self.head_dim, self.scaling, self.index = attention.head_dim, attention.scaling, attention.layer_idx
        self.q_norm = QkNorm.of(getattr(attention, "q_norm", None), self.head_dim)
        self.k_norm = QkNorm.of(getattr(attention, "k_norm", None), self.head_dim)
        self.ends: AttentionEnds | None = None  # set by engine.decode.layer_graph where it applies

    def __call__(
        self, hidden: torch.Tensor, cos, sin, kv_cache, apply_rotary, mask, rows: int
    ) -> torch.Tensor:
        """The layer's output for the last `rows` of `hidden`'s positions (its attention for all)."""
        count = hidden.shape[1]
        # the ends' graphs are kept per token count: decode and verification steps only
        ends = self.ends if hidden.dtype == torch.float32 and count <= MAX_FOLDED_QUERIES else None
        if ends is not None and not getattr(kv_cache, "offloading", False):  # the layer in one graph
            whole = ends.whole(hidden, cos, sin, kv_cache.layers[self.index], rows)
            if whole is not None:
                return whole
        if ends is not None:
            query, key, value = ends.inputs(hidden, cos, sin)
        else:
            x = self.input_norm(hidden)
            heads = (1, count, -1, self.head_dim)  # [B, T, heads, D], as the attention views its projections
            query = self.q_norm(self.q_proj(x), heads).transpose(1, 2)
            key = self.k_norm(self.k_proj(x), heads).transpose(1, 2)
            value = self.v_proj(x).view(heads).transpose(1, 2)
            query, key = apply_rotary(query, key, cos, sin)
        key, value = kv_cache.update(key, value, self.index)
        # what transformers' attention calls, with its arguments: `[1, T, heads, D]`
        out, _ = cpu_attention_forward(self.attention, query, key, value, mask, scaling=self.scaling)
        out = out.reshape(1, count, -1)
        if ends is not None:
            done = ends.finish(out, hidden, rows)
            if done is not None:
                return done
            hidden, x = ends.outputs(out, hidden)
            return hidden[:, -rows:] + self.mlp(x[:, -rows:])
        hidden = (hidden + self.o_proj(out))[:, -rows:]
        return hidden + self.mlp(self.post_norm(hidden))


class AttentionEnds(Protocol):
    """A layer's work before its attention (input norm, q/k/v, q/k norms, rotation) and after it
    (o_proj, residual, post-attention norm) done elsewhere: engine.decode.layer_graph."""

    def inputs(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple: ...

    def outputs(self, attended: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    # the layer's output for its last `rows` positions, its attention over `cache` (the layer's own)
    # and MLP included, or None (`inputs`, the attention, then `finish`)
    def whole(self, hidden: torch.Tensor, cos, sin, cache, rows: int) -> torch.Tensor | None: ...

    # the layer's output for its last `rows` positions, its MLP included, or None (`outputs`, then the MLP)
    def finish(self, attended: torch.Tensor, hidden: torch.Tensor, rows: int) -> torch.Tensor | None: ...


class RotaryTable:
    """The rotary module's cos and sin for a run of positions: slices of a table it filled (for as
    many positions as the longest step so far, doubling, up to `TABLE_POSITIONS`), where its
    frequencies are static and a probe shows the slices equal its own outputs bit for bit; else its
    own call. ~5 operators less a step; the table costs 2 × positions × head width values (8 MB
    for 8192 positions of 128 in float32, 32 MB at most)."""

    TABLE_POSITIONS = 32768

    def __init__(self, module: nn.Module):
        self.module = module
        rope_type = getattr(module, "rope_type", None)  # dynamic and longrope change their frequencies
        self.static = isinstance(rope_type, str) and rope_type not in ("dynamic", "longrope")
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, hidden: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[1, count, D]` of positions `first`… for `hidden`'s dtype."""
        module = self.module
        hooked = module._forward_hooks or module._forward_pre_hooks
        if self.static and not hooked and first + count <= self.TABLE_POSITIONS:
            table = self.table(hidden, first + count)
            if table is not None:
                return table[0][:, first : first + count], table[1][:, first : first + count]
        return module(hidden, torch.arange(first, first + count, device=hidden.device)[None])

    def tabled(self) -> bool:
        """Whether `at` gives one position's angles as rows of the table (of its length)."""
        module = self.module
        return self.static and not (module._forward_hooks or module._forward_pre_hooks)

    def at(self, first: int, count: int) -> tuple:
        """cos and sin of positions `first`… in float32 on the CPU as a graph reads them by address:
        `Row`s of the table for one position, else tensors as `__call__` gives them."""
        if count == 1 and first < self.TABLE_POSITIONS and self.tabled():
            table = self.table(_FLOAT32, first + 1)
            if table is not None:
                dim = table[0].shape[-1]
                return tuple(Row.of(t, first * dim, (1, 1, dim)) for t in table)
        return self(_FLOAT32, first, count)

    def table(self, hidden: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin `[1, size, D]` of positions 0… (size ≥ `length`) in `hidden`'s dtype and on
        its device, where a probe shows the table's rows equal the module's own; else None."""
        key = (hidden.dtype, hidden.device)
        table = self._tables.get(key)
        if table is not None and table[0].shape[1] >= length:
            return table
        size = min(max(length, 2 * (0 if table is None else table[0].shape[1]), 1024), self.TABLE_POSITIONS)
        made = self.module(hidden, torch.arange(size, device=hidden.device)[None])
        table = tuple(t.contiguous() for t in made)  # a graph reads its rows by address (`at`)
        for position in (0, length - 1, size - 1):
            alone = self.module(hidden, torch.tensor([[position]], device=hidden.device))
            if not all(torch.equal(a[0, 0], t[0, position]) for a, t in zip(alone, table, strict=True)):
                self.static = False
                return None
        self._tables[key] = table
        return table


class QkNorm:
    """A q/k norm where the family puts it: on each head (`[.., D]` weights, Qwen3) or on the whole
    projection before its heads are split (OLMoE); none: the heads as they are."""

    def __init__(self, norm: Callable | None, per_head: bool):
        self.norm, self.per_head = norm, per_head

    @classmethod
    def of(cls, norm: nn.Module | None, head_dim: int, fuse: bool = True) -> QkNorm:
        """`fuse`: as torch's one-operator norm where a CPU probe shows the same values."""
        weight = getattr(norm, "weight", None)
        fused = norm if norm is None or not fuse else _fused(norm)
        return cls(fused, weight is not None and weight.numel() == head_dim)

    def __call__(self, projected: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
        if self.norm is None:
            return projected.view(heads)
        if self.per_head:
            return self.norm(projected.view(heads))
        return self.norm(projected).view(heads)


def _fused(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`norm` as torch's one-operator RMS norm where that gives its outputs bit for bit on a probe
    (and nothing hooks it), else the module itself: one operator costs less than the seven of
    transformers' RMSNorm."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(eps, float) or weight.dim() != 1:
        return norm
    if norm._forward_hooks or norm._forward_pre_hooks:
        return norm
    width = (weight.numel(),)
    generator = torch.Generator().manual_seed(0)
    probe = (torch.randn((4, *width), generator=generator) * 3).to(weight.dtype)
    with torch.inference_mode():
        if not torch.equal(norm(probe), F.rms_norm(probe, width, weight, eps)):
            return norm
    return functools.partial(F.rms_norm, normalized_shape=width, weight=weight, eps=eps)


@functools.cache
def _attention_cache(kind: type) -> bool:
    """Whether a layer cache of this type is an attention cache (`DynamicLayer`'s isinstance goes
    through its ABC's check, slow enough to matter on every layer of every step)."""
    return issubclass(kind, DynamicLayer)


def _refusal(hf_model: nn.Module) -> str:
    """Why `hf_model` is not the standard decoder this step reproduces ('' when it is)."""
    if getattr(hf_model.config, "_attn_implementation", None) != ATTENTION:
        return "its attention is not the engine's CPU attention"
    return standard_refusal(hf_model)


def standard_refusal(hf_model: nn.Module) -> str:
    """Why `hf_model` is not the standard pre-norm decoder of the module doc, whatever function
    its attention calls ('' when it is): engine.decode.captured_step builds on it too."""
    config = hf_model.config
    if any(getattr(config, name, None) not in (None, 1, 1.0, False) for name in _CHANGES):
        return "its config scales or caps what the standard decoder computes"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "not every layer attends fully"
    decoder = decoder_of(hf_model)
    if {name for name, _ in decoder.named_children()} != _DECODER_PARTS or not isinstance(
        getattr(hf_model, "lm_head", None), nn.Module
    ):
        return f"its decoder {type(decoder).__name__} is not embed/layers/norm/rotary with an lm_head"
    parameters = inspect.signature(decoder.rotary_emb.forward).parameters
    needs = [name for name, p in parameters.items() if p.default is p.empty]
    if list(parameters)[:2] != ["x", "position_ids"] or not set(needs) <= {"x", "position_ids"}:
        return f"its rotary embedding takes {list(parameters)}, not (x, position_ids)"
    for layer in decoder.layers:
        reason = _layer_refusal(layer)
        if reason:
            return reason
    return ""


def _layer_refusal(layer: nn.Module) -> str:
    if {name for name, _ in layer.named_children()} != _LAYER_PARTS:
        return f"{type(layer).__name__} is not a norm/attention/norm/mlp layer"
    attention = layer.self_attn
    if not {name for name, _ in attention.named_children()} <= _ATTENTION_PARTS:
        return f"{type(attention).__name__} has parts beyond q/k/v/o projections and q/k norms"
    if any(getattr(attention, name, None) is not None for name in ("sliding_window", "sinks", "softcap")):
        return f"{type(attention).__name__} has a sliding window, sinks or a soft cap"
    if getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None) is None:
        return f"{type(attention).__name__}'s module has no apply_rotary_pos_emb"
    if not isinstance(getattr(attention, "layer_idx", None), int) or not hasattr(attention, "scaling"):
        return f"{type(attention).__name__} has no layer index or scaling"
    return ""
