"""The router logits of each MoE layer's latest forward (`RoutingTrace`), for the cache policies
that score experts and for the tuner."""

from __future__ import annotations

import functools

import torch


class RoutingTrace:
    """The latest router logits of each MoE layer, `[T, E]`: recorded by the routers' hooks, or
    a step's layers at once (`record_layers`), taken apart only when read — a decode step of the
    ggml graph would otherwise spend a view a layer (a cost every token pays) on something
    read only by the tuner and by cache policies that score experts."""

    def __init__(self) -> None:
        self._logits: dict[int, torch.Tensor] = {}
        self._layers: tuple[tuple[int, ...], torch.Tensor, int] | None = None  # see record_layers

    @property
    def logits(self) -> dict[int, torch.Tensor]:
        self._take_apart()
        return self._logits

    def _take_apart(self) -> None:
        if self._layers is not None:
            layers, logits, last_rows = self._layers
            self._layers = None
            self._logits.update(zip(layers, logits.unbind(0), strict=True))
            self._logits[layers[-1]] = logits[-1, :last_rows]

    def hook(self, layer: int):
        """The router's forward hook for `layer`."""
        return functools.partial(self.record, layer)

    def record(self, layer: int, _module, _inputs, output) -> None:
        self.logits[layer] = output[0].detach()

    def record_layers(self, layers: tuple[int, ...], logits: torch.Tensor, last_rows: int) -> None:
        """The router logits `logits [L, T, E]` of a step's `layers`, the last one's on its first
        `last_rows` rows only."""
        if self._layers is not None and self._layers[0] != layers:
            self._take_apart()  # another set of layers: the previous one's first
        self._layers = (layers, logits, last_rows)

    def clear(self) -> None:
        self._logits.clear()
        self._layers = None
