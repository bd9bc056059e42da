"""A one-token step through the model's own modules over static KV buffers: what the whole-step
CUDA graph (engine.decode.captured_step) holds for a family whose decoder is not the standard one.

Contract: `module_refusal(config)` says why a model's steps cannot be held this way ('' when
they can); `ModuleBody(hf_model, windowed_layers(config))` is the body `CapturedStep` captures then:
`body(token, position, buffers)` is the logits `[V]` of `token [1, 1]` at the device position
`position [1]`, each layer's key and value written into its buffers there (`buffers`: each
layer's (keys, values) `[1, kv heads, capacity, D]`, as the engine's `GrowingLayer` holds them);
`body(tokens, position, buffers, offsets)` the logits `[T, V]` of ids `[1, T]` at `position +
offsets` (the graph of a draft's verification, for every family the graph holds).

How: transformers' own forward (`hf_model(input_ids, position_ids, cache)`, every module and
function of the family as the eager step runs them: MLA, sinks, soft caps, multipliers, chunked
or sliding masks, the family's MoE block with the engine's experts) over `GraphCache`, a cache
whose layers write at the device position (`index_copy_`) and give the attention the buffers'
whole capacity. Its layers say `is_compileable`, so transformers builds the attention mask over
the capacity from the position on the device (`get_query_offset`: a tensor) and never skips it
for a causal shortcut: the positions past the length are masked, a sliding layer's window is
applied by its mask. A sliding-window layer therefore keeps every position, as a rewindable cache
does (`needs_every_position`). No value is read on the host (tests run it under FakeTensorMode).

What it cannot hold: a layer cache that is not attention positions (linear-attention or Mamba
state, a sparse-attention indexer's keys): such a family's steps stay eager, the reason logged.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from engine.model.hf_calls import with_cache
from engine.model.kv_cache import GrowingLayer, new_kv_cache


def module_refusal(config: PretrainedConfig) -> str:
    """Why the steps of `config`'s model cannot run through `ModuleBody` ('' when they can): every
    layer's cache, sliding windows kept whole, must be attention positions in the engine's buffers."""
    for index, layer in enumerate(new_kv_cache(config, rewindable=True).layers):
        if type(layer) is not GrowingLayer:
            return f"layer {index} keeps a {type(layer).__name__}, not attention positions"
    return ""


def windowed_layers(config: PretrainedConfig) -> list[bool]:
    """Which layers of `config`'s model attend over a window (sliding or chunked) of the positions."""
    return list(new_kv_cache(config).is_sliding)


class GraphLayer(CacheLayerMixin):
    """One layer's static buffers, written at the device positions `position [T]` (the step's
    tokens'; the first is the mask's query offset)."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, sliding: bool):
        super().__init__()
        self.keys, self.values, self.position = keys, values, position
        self.is_sliding, self.is_initialized = sliding, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the buffers are the engine's."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.position, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.position, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0  # every buffered position, from the first

    def get_seq_length(self) -> torch.Tensor:
        return self.position[0]  # a tensor: the mask's query offset, read on the device

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class GraphCache(Cache):
    """The layers' buffers as transformers' forward reads and writes them in a graph."""

    def __init__(self, buffers, position: torch.Tensor, windowed: list[bool]):
        layers = [GraphLayer(k, v, position, w) for (k, v), w in zip(buffers, windowed, strict=True)]
        super().__init__(layers=layers)


class ModuleBody:
    """What the graph captures for a family outside the standard decoder (see the module doc)."""

    fused = None  # the fused decoder kernels are the standard body's

    def __init__(self, hf_model: nn.Module, windowed: list[bool]):
        self.hf_model, self.windowed = hf_model, windowed

    @property
    def needs_every_position(self) -> bool:
        """Whether a sliding-window layer's cache must keep every position for this body."""
        return any(self.windowed)

    def choose_fused(self, device: torch.device, dtype: torch.dtype, wanted) -> None:
        """The standard body's choice of fused kernels; the modules compute everything here."""

    def extras(self, buffers, device: torch.device) -> tuple:
        """The inputs besides the token, the position and the buffers: none."""
        return ()

    def __call__(
        self, token: torch.Tensor, position: torch.Tensor, buffers, offsets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits `[V]` of `token [1, 1]` at `position [1]`; given `offsets` (`arange(T)`), the
        logits `[T, V]` of ids `[1, T]` at `position + offsets` (a draft's verification), each
        attending to the positions before it and itself."""
        count = token.shape[1]
        positions = position if offsets is None else position + offsets
        cache = GraphCache(buffers, positions, self.windowed)
        kwargs = with_cache(self.hf_model, cache, use_cache=True, logits_to_keep=count)
        logits = self.hf_model(input_ids=token, position_ids=positions[None], **kwargs).logits[0]
        return logits[-1] if offsets is None else logits
