"""The engine's KV cache: the one the model's own class builds, able to go back to a prefix.

Contract: `new_kv_cache(config, rewindable)` is transformers' `DynamicCache(config=…)`, one layer
cache per decoder layer as the model expects it: attention keys and values, sliding windows, the
indexer keys of sparse attention, and the conv and recurrent state of linear-attention (Gated
DeltaNet) and Mamba layers. `rewindable` keeps every position of sliding-window layers (the window
is still applied by the attention mask) so speculative decoding can crop rejected drafts.

`kv_dtype` stores the attention layers' keys and values in another precision than the model
computes in (bf16 or fp16 halves a float32 cache; float8_e4m3fn quarters it, each head scaled so
its largest value at the first write sits well inside e4m3's range): `update` stores the new
positions in that dtype and gives the attention every position back in the compute dtype, as
transformers' QuantizedCache does (no fused low-precision attention here). Linear-attention and
Mamba state stays in the compute dtype: it is a running sum, not a list of positions.

A full-attention layer's keys and values live in buffers with room to spare (`GrowingLayer`): a
step writes its positions in place, where transformers' `DynamicLayer` copies the whole cache into
a new tensor (`torch.cat`) at every step of every layer, a cost that grows with the context.

`rewind_cache(cache, length, saved)` drops every position from `length` on. Attention layers are
cropped; a recurrent state sums every position it has seen and cannot be cropped, so it goes back
to a `RecurrentState` saved when the cache held exactly `length` positions. Keeping a longer prefix
of a recurrent cache means restoring the saved state and feeding the kept tokens again, which the
speculative decoder does (engine.speculative.decoder); a rewind the cache cannot do raises.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
)

# What a linear-attention layer cache holds between forwards: its states and the flags that say
# whether they are there (transformers' LinearAttentionCacheLayerMixin).
_STATE_FIELDS = (
    "conv_states",
    "recurrent_states",
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
    "conv_kernel_size",
)


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# the first write's largest value per head maps to 448 / FP8_HEADROOM: later positions up to that
# many times larger still fit (beyond it they saturate); e4m3 keeps its 3-bit mantissa down to 2**-6
FP8_HEADROOM = 8.0


def new_kv_cache(
    config: PretrainedConfig, rewindable: bool = False, kv_dtype: torch.dtype | None = None
) -> DynamicCache:
    """The model's own cache for `config`; `rewindable`: sliding layers keep every position;
    `kv_dtype`: keys and values stored in that dtype (None: as computed)."""
    cache = DynamicCache(config=config)
    if rewindable:
        cache.layers = [_unwindowed(layer) for layer in cache.layers]
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if kv_dtype is not None:
        cache.layers = [_stored_as(layer, kv_dtype) for layer in cache.layers]
    return cache


# A full buffer grows by a quarter of its positions, at least this many: at most 25% (or this many
# positions) allocated ahead, and each position copied ~5 times over a long run instead of at
# every step.
GROW_MIN_POSITIONS = 256


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys` and `values` (`[B, heads, positions, head_dim]`) are views of
    buffers with room for more positions: `update` writes the new ones in place. `crop` and the
    other `DynamicLayer` methods work on the views as they are; a step finding `keys` no longer a
    view of its buffer (replaced by such a method) moves them into a new one.

    While the cache lies in its buffers it is held as their first `_length` positions, and the
    views are made when `keys` or `values` is read: a step whose producer writes the buffers
    itself (`room`, `written`: engine.decode.layer_graph) makes no tensor at all, where slicing
    the two views would cost every layer of every decode step."""

    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    _length: int | None = None  # while set: keys and values are the buffers' first `_length` positions
    _views: tuple[torch.Tensor, torch.Tensor] | None = None  # those, once read
    _set: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # keys, values as assigned

    keys = property(lambda self: self._pair()[0], lambda self, tensor: self._assign(0, tensor))
    values = property(lambda self: self._pair()[1], lambda self, tensor: self._assign(1, tensor))

    def _pair(self) -> tuple:
        if self._length is None:
            return self._set
        if self._views is None:
            self._views = tuple(buffer[..., : self._length, :] for buffer in self._buffers)
        return self._views

    def _assign(self, which: int, tensor: torch.Tensor | None) -> None:
        pair = list(self._pair())
        pair[which] = tensor
        self._set, self._length, self._views = tuple(pair), None, None

    def _hold(self, length: int) -> None:
        """Keys and values are now the buffers' first `length` positions."""
        self._length, self._views, self._set = length, None, (None, None)

    def get_seq_length(self) -> int:
        return super().get_seq_length() if self._length is None else self._length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        keys, values = self._room_for(length + new, key_states, value_states)
        keys[..., length : length + new, :].copy_(key_states)
        values[..., length : length + new, :].copy_(value_states)
        self._hold(length + new)
        return self.keys, self.values

    def _room_for(self, positions: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Buffers holding the current positions with room for `positions` (held from then on)."""
        buffers, length = self._buffers, self.get_seq_length()
        if (
            buffers is not None
            and buffers[0].shape[-2] >= positions
            and buffers[0].shape[:-2] == key_states.shape[:-2]
            and buffers[0].dtype == key_states.dtype
            and (length == 0 or self._length is not None or self._in(buffers))
        ):
            self._hold(length)
            return buffers
        capacity = positions + max(GROW_MIN_POSITIONS, positions // 4)
        buffers = tuple(
            states.new_empty((*states.shape[:-2], capacity, states.shape[-1]))
            for states in (key_states, value_states)
        )
        if length:
            buffers[0][..., :length, :].copy_(self.keys)
            buffers[1][..., :length, :].copy_(self.values)
        self._buffers = buffers
        self._hold(length)
        return buffers

    def _in(self, buffers: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether the assigned keys and values start where `buffers` do (a crop's views)."""
        return all(a.data_ptr() == b.data_ptr() for a, b in zip(self._set, buffers, strict=True))

    def room(self, new: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The key and value buffers (`[1, heads, capacity, D]`) with room for `new` positions after
        the cached ones, for a producer that writes them there itself and then calls `written(new)`
        (engine.decode.layer_graph); None before the first update or for several sequences."""
        buffers, length = self._buffers, self._length
        if not self.is_initialized or buffers is None:
            return None
        if length is not None and buffers[0].shape[0] == 1 and length + new <= buffers[0].shape[-2]:
            return buffers  # held there with room: the check of every decode step
        if self.keys.shape[0] != 1:
            return None
        return self._room_for(self.get_seq_length() + new, self.keys, self.values)

    def written(self, new: int) -> None:
        """Count `new` positions written into the buffers `room` gave."""
        self._hold(self._length + new)

    def reset(self) -> None:
        self._buffers, self._length, self._views = None, None, None  # keys and values: as assigned
        super().reset()


class _StoredKV:
    """An attention layer cache whose keys and values are kept in `storage` (a mixin over
    transformers' DynamicLayer and DynamicSlidingWindowLayer, whose cat/crop/slicing it reuses)."""

    storage: torch.dtype
    scales: tuple[torch.Tensor, torch.Tensor] | None = None  # fp8: keys', values' [1, heads, 1, 1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        compute = key_states.dtype
        if self.storage == FP8 and self.scales is None:
            self.scales = (_head_scale(key_states), _head_scale(value_states))
        keys, values = super().update(
            self._encode(key_states, 0), self._encode(value_states, 1), *args, **kwargs
        )
        return self._decode(keys, 0, compute), self._decode(values, 1, compute)

    def _encode(self, states: torch.Tensor, which: int) -> torch.Tensor:  # [B, heads, T, head_dim]
        if self.storage != FP8:
            return states.to(self.storage)
        return (states / self.scales[which]).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    def _decode(self, stored: torch.Tensor, which: int, compute: torch.dtype) -> torch.Tensor:
        if self.storage != FP8:
            return stored.to(compute)
        return stored.to(compute) * self.scales[which].to(compute)


def _head_scale(states: torch.Tensor) -> torch.Tensor:
    """Per head: the first write's largest magnitude over FP8_MAX / FP8_HEADROOM (never 0)."""
    amax = states.detach().abs().float().amax(dim=(0, 2, 3), keepdim=True)  # [1, heads, 1, 1]
    return (amax * FP8_HEADROOM / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)


class StoredLayer(_StoredKV, GrowingLayer):
    def __init__(self, storage: torch.dtype):
        super().__init__()
        self.storage = storage


class StoredSlidingWindowLayer(_StoredKV, DynamicSlidingWindowLayer):
    def __init__(self, sliding_window: int, storage: torch.dtype):
        super().__init__(sliding_window=sliding_window)
        self.storage = storage


def _stored_as(layer, storage: torch.dtype):
    """`layer` keeping its keys and values in `storage`; layers with recurrent state are left as
    they are (their attention part too: they are one object)."""
    if type(layer) in (DynamicLayer, GrowingLayer):
        return StoredLayer(storage)
    if type(layer) is DynamicSlidingWindowLayer:
        stored = StoredSlidingWindowLayer(layer.sliding_window, storage)
        stored.record_past = layer.record_past
        return stored
    return layer


def _unwindowed(layer):
    """`layer` with every position kept: a sliding window could not be cropped back."""
    if isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
        return LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
    if isinstance(layer, DynamicSlidingWindowLayer):
        return GrowingLayer()
    return layer


def is_recurrent(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def is_croppable(cache: DynamicCache) -> bool:
    """Whether `cache`'s attention layers can drop positions: a sliding-window layer past its window
    keeps only the last positions (transformers' `crop` refuses it), so such a cache is reusable
    only whole."""
    return not any(
        isinstance(layer, DynamicSlidingWindowLayer)
        and not layer.record_past
        and layer.get_seq_length() >= layer.sliding_window
        for layer in cache.layers
    )


def has_recurrent_state(cache: DynamicCache) -> bool:
    """Whether `cache` has layers (linear attention, Mamba) whose state cannot be cropped."""
    return any(is_recurrent(layer) for layer in cache.layers)


@dataclass(frozen=True)
class RecurrentState:
    """A copy of every recurrent layer's state, taken when the cache held `length` positions."""

    length: int
    layers: tuple[tuple[int, dict], ...]  # (layer index, {field: copy}) per recurrent layer

    @classmethod
    def save(cls, cache: DynamicCache) -> RecurrentState | None:
        """The recurrent layers' state now; None when `cache` has no recurrent layer."""
        if not has_recurrent_state(cache):
            return None
        layers = tuple(
            (index, {field: _copied(getattr(layer, field)) for field in _STATE_FIELDS})
            for index, layer in enumerate(cache.layers)
            if is_recurrent(layer)
        )
        return cls(cache.get_seq_length(), layers)

    def restore(self, cache: DynamicCache) -> None:
        """Put the saved state back (copied again, so it can be restored more than once)."""
        for index, fields in self.layers:
            for field, value in fields.items():
                setattr(cache.layers[index], field, _copied(value))


def _copied(states: dict) -> dict:
    """`states` (state index -> tensor, flag or size) with its tensors cloned."""
    return {i: v.clone() if hasattr(v, "clone") else copy.copy(v) for i, v in states.items()}


def rewind_cache(cache: DynamicCache, length: int, saved: RecurrentState | None = None) -> None:
    """Drop every position of `cache` from `length` on; recurrent layers go back to `saved`."""
    extra = cache.get_seq_length() - length
    if extra <= 0:
        return
    if has_recurrent_state(cache):
        if saved is None or saved.length != length:
            at = "none" if saved is None else f"one at {saved.length}"
            raise RuntimeError(
                f"cannot rewind a recurrent state to {length} positions: it needs a state saved there ({at})"
            )
        saved.restore(cache)
    for layer in cache.layers:
        if not is_recurrent(layer):
            layer.crop(-extra)
        elif isinstance(layer, DynamicLayer):  # linear and attention state in one layer
            DynamicLayer.crop(layer, -extra)
