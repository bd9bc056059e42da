"""A step's device experts computed together: a few batched kernels a layer, not a few an expert.

On a GPU every kernel launch costs microseconds whatever it computes. A decode step through a
Qwen3-30B-A3B-shaped model uses 48 × 8 experts; computed one at a time (a GGUF expert: dequantize
gate/up, a matmul, the activation, dequantize down, a matmul, the weight, the add, each several
kernels) a step launches thousands of kernels and is bound by their launches. Here a group of
the step's experts, pinned in their slots together (`pipeline.ready_together`), is gathered from the
cache's pool in one `index_select`; each field is viewed, or dequantized, for the whole group at
once; the group runs as two batched matmuls around the family's activation; and its weighted
outputs are added into the step's output by one matmul with a 0/1 matrix (no atomics: the same
sums whatever the run).

Where the cache holds every expert (`ExpertCache.holds_all`), a one-token step goes further
(`forward_resident`): its `top_k_index` is looked up in the layer's slot table on the device and
the K experts are gathered, computed and summed without the host reading which they are — no
host synchronisation a layer, the same kernels for every route; experts the fused kernels read
(GGUF blocks, FP8, int4 words) go through them instead (`engine.moe.fused_experts`: two launches a
layer), which is how FP8 and int4 experts take this path at all (`resident_asked`).

Each expert's values are the ones `OffloadedExperts.expert_forward` computes, weighted as
transformers weights them; only the summation order of the final combine differs (floating-point
rounding, ~1e-7 in float32). Groups are for steps whose experts serve few tokens each (decode,
drafting, a verify): a prefill's experts serve many and are large matmuls one at a time already.
Fields kept in another format's own layout (FP8, GPTQ/AWQ, ggml blocks repacked for the CPU) are
not grouped (`groupable`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.device_cache.pipeline import ready_together
from engine.formats.fields import PLAIN
from engine.formats.gguf.blocks import dequantize
from engine.formats.layout import ExpertLayout

GROUP_EXPERTS = 16  # experts computed together at most: bounds the dequantized weights' memory
GROUP_TOKENS = 16  # a step whose busiest expert serves more tokens computes one expert at a time


def groupable(layout: ExpertLayout) -> bool:
    """Whether every field of `layout` is a native tensor or ggml blocks as the file has them."""
    as_stored = (f.format is PLAIN or (f.ggml_type is not None and f.packing is None) for f in layout.fields)
    return layout.quant is None and all(as_stored)


def _together_asked(module) -> bool:
    """Whether `module` (an `OffloadedExperts`) is asked to compute its experts together
    (`ExpertControl.grouped`; None: on CUDA) and has a device pool to gather them from."""
    cache, grouped = module.cache, module.control.grouped
    if grouped is None:
        grouped = cache.device.type == "cuda"
    return bool(grouped) and cache.pool is not None


def groups_asked(module) -> bool:
    """Whether `module` computes its experts in groups where a step allows: asked for
    (`_together_asked`), a layout of native or ggml fields."""
    return _together_asked(module) and groupable(module.cache.store.layout_of(module.layer))


def resident_asked(module) -> bool:
    """Whether a one-token step over a cache holding every expert looks them up in the slot table
    (`forward_resident`): where `module` computes in groups, or where its layout is one torch's
    gather does not read (FP8, int4 words) but its fused kernels do (`module.fused`, decided at
    the layer's first such step)."""
    if not _together_asked(module):
        return False
    return groupable(module.cache.store.layout_of(module.layer)) or module.fused is not None


def in_groups(module, step, experts: Sequence[int], streaming: bool) -> bool:
    """Whether `module` computes `step`'s device `experts` in groups (`groups_asked`, or a one-token
    step of a layer with fused kernels, `fused_asked`): a step that does not stream, whose busiest
    expert serves at most `GROUP_TOKENS` tokens."""
    return (
        bool(experts)
        and not streaming
        and (groups_asked(module) or fused_asked(module, step))
        and max(len(step.routes[e]) for e in experts) <= GROUP_TOKENS
    )


def fused_asked(module, step) -> bool:
    """Whether `step`'s experts go through the layer's fused kernels from the slots they are brought
    into: a one-token step where experts are computed together and the layer has them (decided at
    its first such step: `OffloadedExperts.fused`)."""
    return step.hidden.shape[0] == 1 and _together_asked(module) and module.fused is not None


def forward_resident(
    module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """One token's experts (`hidden [1, H]`, `top_k_index` and `top_k_weights [1, K]`) from the
    slots `table [E]` gives (`ExpertCache.slot_table`), summed over K, the host never reading which
    experts they are: through the layer's fused kernels where it has them (`module.fused`,
    `engine.moe.fused_experts`: two launches), else in torch (`resident_in_torch`). Returns
    `[1, H]` in `hidden`'s dtype. Several tokens (a captured graph's verification) go one at a time:
    `[T, H]`."""
    if hidden.shape[0] > 1:
        rows = zip(hidden.split(1), top_k_index.split(1), top_k_weights.split(1), strict=True)
        return torch.cat([forward_resident(module, *row, table) for row in rows])
    fused = module.fused
    if fused is not None:
        return fused(hidden, top_k_index, top_k_weights, table)
    return resident_in_torch(module, hidden, top_k_index, top_k_weights, table)


def resident_in_torch(
    module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """`forward_resident` in torch: the experts looked up, gathered and computed as one group on the
    device — the kernels are the same whatever the route."""
    top_k = top_k_index.shape[1]
    layout = module.cache.store.layout_of(module.layer)
    weights = gathered_weights(
        module.cache.pool, table[top_k_index[0]], layout, hidden.dtype, module.is_transposed
    )
    x = hidden.expand(top_k, -1).unsqueeze(1)  # [K, 1, H]
    y = expert_outputs(module, x, top_k_weights.reshape(top_k, 1, 1), weights)  # [K, 1, H]
    return y.sum(dim=0).to(hidden.dtype)


def accumulate_in_groups(module, step, experts: Sequence[int]) -> None:
    """`experts` brought in and computed a group at a time (`pipeline.ready_together`): a one-token
    step's through the fused kernels where `fused_asked`, else gathered and computed in torch."""
    cache = module.cache
    layout = cache.store.layout_of(module.layer)
    fused = module.fused if fused_asked(module, step) else None
    for slots in ready_together(cache, module.layer, list(experts), GROUP_EXPERTS):
        rows = [slot.index for slot in slots]
        if fused is not None:
            _accumulate_fused(fused, step, [slot.key[1] for slot in slots], rows)
            continue
        weights = gathered_weights(cache.pool, rows, layout, step.hidden.dtype, module.is_transposed)
        accumulate_together(module, step, [slot.key[1] for slot in slots], weights)


def _accumulate_fused(fused, step, experts: list[int], rows: list[int]) -> None:
    """One token's routes to `experts` (pinned in pool `rows`) through the fused kernels, added
    into `step.out`: the kernels read a table of the group's rows, the token's routes given as
    positions in it (two small host-to-device copies, no synchronisation)."""
    where = {expert: i for i, expert in enumerate(experts)}
    routes = [(k, where[e]) for k, e in enumerate(step.index[0]) if e in where]
    device = step.hidden.device
    ids = torch.tensor([[i for _, i in routes]], device=device)
    weights = step.weights[[k for k, _ in routes]].reshape(1, -1)
    table = torch.tensor(rows, device=device)
    step.out.add_(fused(step.hidden, ids, weights, table).to(step.out.dtype))


def gathered_weights(
    pool: torch.Tensor,
    slots: Sequence[int] | torch.Tensor,
    layout: ExpertLayout,
    dtype: torch.dtype,
    transposed: bool = False,
) -> dict[str, torch.Tensor]:
    """Each field of the experts in pool rows `slots` (a list, or indices on the device), stacked
    `[n, *shape]`: native fields as stored, ggml blocks dequantized to `dtype` (float32 math, as
    `gguf_blocks.dequantize`). A ggml field holds `(out, in)` rows whatever the family's own
    orientation: for a family holding its weights `[in, out]` (`transposed`: gpt-oss) it is given
    as a transposed view, as its native fields are."""
    index = slots
    if not isinstance(index, torch.Tensor):
        index = torch.tensor(slots, dtype=torch.long).to(pool.device, non_blocking=True)
    rows = pool.index_select(0, index)  # [n, slot bytes]
    n = len(index)
    weights = {}
    for f in layout.fields:
        part = rows[:, f.offset : f.offset + f.nbytes]
        if f.ggml_type is None:
            weights[f.name] = part.view(f.dtype).view(n, *f.shape)
        else:
            weight = dequantize(part, f.ggml_type, (n, *f.weight_shape), dtype)
            weights[f.name] = weight.transpose(1, 2) if transposed else weight
    return weights


def _linear(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`x [n, m, in]` through each expert's weight: `w [n, out, in]` (or `[n, in, out]` transposed)."""
    return torch.bmm(x, w if transposed else w.transpose(1, 2))


def expert_outputs(
    module, x: torch.Tensor, scale: torch.Tensor, weights: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Each of `n` experts (stacked `weights`) on its `m` inputs `x [n, m, H]`, weighted by
    `scale [n, m, 1]` as the family weights them: `[n, m, H]`. `module` holds the family's flags
    and activation (an `OffloadedExperts`)."""
    if module.scales_input:  # Llama 4: the routing weight scales the expert's input
        x = x * scale
    gate_up = "gate_up_proj" if module.has_gate else "up_proj"
    up = _linear(x, weights[gate_up], module.is_transposed)
    if module.has_bias:
        up = up + weights[f"{gate_up}_bias"][:, None, :]
    act = module.template._apply_gate(up) if module.has_gate else module.template.act_fn(up)
    y = _linear(act, weights["down_proj"], module.is_transposed)
    if module.has_bias:
        y = y + weights["down_proj_bias"][:, None, :]
    return y if module.scales_input else y * scale


def accumulate_together(module, step, experts: Sequence[int], weights: dict[str, torch.Tensor]) -> None:
    """`experts` (with their stacked `weights`) on the tokens routed to them, weighted and added
    into `step.out`. `module` is the layer's `OffloadedExperts` (the family's flags and activation)."""
    hidden, top_k = step.hidden, step.top_k
    tokens = hidden.shape[0]
    width = max(len(step.routes[e]) for e in experts)
    pad = tokens * top_k  # a padded route reads an appended zero weight
    positions = [step.routes[e] + [pad] * (width - len(step.routes[e])) for e in experts]
    flat = [p for row in positions for p in row]
    index = torch.tensor(flat, dtype=torch.long).to(hidden.device, non_blocking=True)  # [n·m]
    token = torch.where(index < pad, index // top_k, 0)
    scale = torch.cat([step.weights, step.weights.new_zeros(1)])[index].view(len(experts), width, 1)
    x = hidden[token].view(len(experts), width, -1)  # [n, m, H]
    y = expert_outputs(module, x, scale, weights)
    # out[t] += Σ y[j] over the routes j of token t: one matmul with a 0/1 matrix, padding all zero
    combine = torch.zeros(tokens, len(flat), dtype=y.dtype, device=y.device)
    combine[token, torch.arange(len(flat), device=y.device)] = (index < pad).to(y.dtype)
    step.out.add_((combine @ y.view(len(flat), -1)).to(step.out.dtype))
