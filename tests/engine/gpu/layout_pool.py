"""A layer's experts laid out by a format's own `ExpertLayout` in a device cache's pool, and the torch
reference of the fused kernels on them: the format's `dequantize` (float32, the weights' exact
values) → `F.linear` → silu(gate) · up → Σ_k w_k · down_k(act_k). What the FP8 and int4 interpreter
tests share.

The reference's products are summed in float64: on these random weights a gate's or up's sum
cancels to a fifth of its terms' magnitudes, and silu(gate) · up carries that, so a float32 BLAS
sum strays from the exact one by up to ~1.3e-6 of the output's largest value — more than the
kernels' own float32 sums (~2e-7) and than the bound, 1e-6 of it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from engine.formats.layout import ExpertLayout
from engine.gpu.projections import projection

EXPERTS, SLOTS = 6, 8
IDS = [4, 1, 4]  # top-k with a repeat, their slots out of order
RTOL = 1e-6  # of the output's largest value: the kernels' float32 sums against the exact ones


class LayoutPool:
    """EXPERTS experts laid out by `layout` in shuffled rows of a uint8 pool of SLOTS rows (the other
    rows random bytes), each expert's fields written by `fill(views, rng)`; its slot table."""

    def __init__(self, layout: ExpertLayout, fill: Callable, dequantize: Callable, rng: np.random.Generator):
        self.layout, self.dequantize = layout, dequantize
        self.pool = torch.from_numpy(rng.integers(0, 256, (SLOTS, layout.nbytes), dtype=np.uint8))
        slots = rng.permutation(SLOTS)[:EXPERTS]
        for slot in slots:
            fill(layout.views(self.pool[slot]), rng)
        self.table = torch.tensor(slots)  # int64, as ExpertCache.slot_table makes it
        self.gate_up, self.down = projection(layout, "gate_up_proj"), projection(layout, "down_proj")
        assert not isinstance(self.gate_up, str) and not isinstance(self.down, str), (self.gate_up, self.down)

    def weight(self, expert: int, name: str) -> torch.Tensor:
        """Expert `expert`'s field `name` as the format dequantizes it, float32 `[out, in]`."""
        return self.dequantize(self.layout.views(self.pool[int(self.table[expert])])[name])

    def reference_act(self, x: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """`[K, I]` float64, of x as the kernels read it (its float32 values)."""
        acts = []
        for expert in ids:
            weight = self.weight(expert, "gate_up_proj").double()
            gate, up = F.linear(x.float().double().reshape(-1), weight).chunk(2)
            acts.append(F.silu(gate) * up)
        return torch.stack(acts)

    def reference_out(self, act: torch.Tensor, ids: list[int], weights: torch.Tensor) -> torch.Tensor:
        """`[H]` float64 of `act [K, I]` (float32 values, as the kernels store them)."""
        out = torch.zeros(self.down.rows, dtype=torch.float64)
        for k, expert in enumerate(ids):
            weight = self.weight(expert, "down_proj").double()
            out += weights[k].float().double() * F.linear(act[k].float().double(), weight)
        return out

    def gate_up_act(self, kernels, x: torch.Tensor, ids: list[int], block_n: int) -> torch.Tensor:
        """`kernels.moe_gate_up` (a module: engine.gpu.fp8_moe, int4_moe) on this pool."""
        return kernels.moe_gate_up(x, self.pool, self.table, torch.tensor(ids), self.gate_up, block_n)

    def down_out(self, kernels, act: torch.Tensor, ids: list[int], weights: torch.Tensor, block_n: int):
        ids = torch.tensor(ids)
        return kernels.moe_down(act, self.pool, self.table, ids, weights, self.down, block_n)


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    """`got` (float32) within `rtol` of `want`'s largest value of `want` (the float64 reference)."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    error, scale = (got.double() - want).abs().max().item(), want.abs().max().item()
    assert error <= rtol * scale, f"max |Δ| {error:.3g} > {rtol:g} · max |ref| {scale:.3g}"


def normal(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
