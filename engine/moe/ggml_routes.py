"""A MoE layer's routes computed by ggml where its experts lie in the host store (`--kernels ggml`).

`InPlaceGgml` is the part of `OffloadedExperts` (engine.moe.layer) that runs every route of a step
through llama.cpp's `ggml_mul_mat_id`, one node a projection, as llama.cpp runs a MoE layer: the
experts used in place (the cache is the store itself, which never changes while a step runs), in
ggml blocks or in ggml rows of their own float type (engine.store.placement). A family's own gate
runs in torch between the projections, and its biases (gpt-oss) are added per route; a SwiGLU
family's whole expert is one ggml graph in float32 (`routed_swiglu`). engine.decode.moe_graph
folds the same experts into a layer's ggml graph.
"""

from __future__ import annotations

import functools

import torch

from engine.formats import int_quant as quant
from engine.formats.gguf.repack import GGML_PACKINGS
from engine.ggml import kernels as ggml_kernels


class InPlaceGgml:
    """ggml's routes of an `OffloadedExperts` (its cache, store, layer and family flags)."""

    @functools.cached_property
    def grouped_in_ggml(self) -> bool:
        """Whether the layer's experts go through ggml together: llama.cpp's kernels (`--kernels
        ggml`) on the store itself (in place: no slot is reused while the step runs)."""
        fields = self.cache.store.layout_of(self.layer).fields
        weights = {f.name: f for f in fields if f.ggml_type is not None or quant.is_weight(f.shape)}
        named = {"gate_up_proj" if self.has_gate else "up_proj", "down_proj"} <= weights.keys()
        return self.cache.in_place and named and all(f.packing in GGML_PACKINGS for f in weights.values())

    @functools.cached_property
    def ggml_fields(self) -> tuple[torch.Tensor, tuple[int, int, int, int], tuple[int, int, int, int]]:
        """The layer's experts in the store and where gate/up and down lie in each (`linear_routed`)."""
        fields = {
            f.name: (f.offset, f.ggml_type, *f.weight_shape)
            for f in self.cache.store.layout_of(self.layer).fields
            if f.ggml_type is not None
        }
        gate_up = fields["gate_up_proj" if self.has_gate else "up_proj"]
        return self.cache.store.layer_buffer(self.layer), gate_up, fields["down_proj"]

    @functools.cached_property
    def swiglu_in_ggml(self) -> bool:
        """Whether the experts gate as SwiGLU (`silu(gate) · up`, gate rows first), which ggml
        computes itself (with no bias between): asked of the family's own gate on a probe."""
        if not self.has_gate or self.has_bias:
            return False
        probe = torch.linspace(-4.0, 4.0, 16).view(2, 8)
        gate, up = probe.chunk(2, dim=-1)
        return torch.equal(self.template._apply_gate(probe), torch.nn.functional.silu(gate) * up)

    def _routed_in_ggml(
        self, hidden: torch.Tensor, weights: torch.Tensor, index: list[list[int]]
    ) -> torch.Tensor:
        """Every route of the step through the layer's experts where they lie in the store, one ggml
        node a projection (llama.cpp's `mul_mat_id`: a token's row quantized once for all its
        experts); each route's output weighted as `_accumulate` weights it, a token's routes summed
        in their top-k order: `[T, H]`."""
        experts, gate_up, down = self.ggml_fields
        weights = weights.reshape(len(index), -1, 1)  # [T, K, 1]
        x = hidden  # [T, H]: every route of a token multiplies the same row
        if self.scales_input:  # Llama 4: a row per route, scaled by its weight
            x = x[:, None, :] * weights
        if self.swiglu_in_ggml:  # the whole expert in one ggml graph, its activation in float32
            y = ggml_kernels.routed_swiglu(x, experts, gate_up, down, index).to(x.dtype)  # [T, K, H]
        else:
            routes = torch.tensor(index) if self.has_bias else None  # [T, K]: each route's expert
            up = ggml_kernels.linear_routed(x, experts, gate_up, index).to(x.dtype)  # [T, K, 2I]
            up = self._biased(up, "gate_up_proj_bias" if self.has_gate else "up_proj_bias", routes)
            act = self.template._apply_gate(up) if self.has_gate else self.template.act_fn(up)
            y = ggml_kernels.linear_routed(act, experts, down, index).to(x.dtype)  # [T, K, H]
            y = self._biased(y, "down_proj_bias", routes)
        if not self.scales_input:
            y = y * weights
        return y.sum(dim=1, dtype=hidden.dtype)

    @functools.cached_property
    def ggml_biases(self) -> dict[str, torch.Tensor]:
        """Each bias field of the layer's experts where the store holds it: `[E, n]` views."""
        buffer = self.cache.store.layer_buffer(self.layer)
        return {
            f.name: buffer[:, f.offset : f.offset + f.nbytes].view(f.dtype)
            for f in self.cache.store.layout_of(self.layer).fields
            if f.ggml_type is None and not quant.is_weight(f.shape)
        }

    def _biased(self, y: torch.Tensor, name: str, routes: torch.Tensor | None) -> torch.Tensor:
        """`y [T, K, n]` plus each route's expert's bias `name` (gpt-oss); `y` without biases."""
        return y if routes is None else y + self.ggml_biases[name][routes]
