"""Experts computed in groups (`engine.moe.batched_experts`, `pipeline.ready_together`): the values of
one expert at a time, slots pinned a group at a time and always released."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.device_cache.pipeline import ready_together
from engine.errors import BudgetTooSmallError
from engine.formats.gguf.blocks import row_bytes
from engine.formats.gguf.experts import ggml_layout
from engine.formats.gguf.repack import GGML
from engine.formats.layout import ExpertLayout
from engine.moe.batched_experts import accumulate_together, forward_resident, gathered_weights, groupable
from engine.moe.layer import OffloadedExperts, _Step, group_by_expert
from engine.tiny.models import build_tiny_model
from tests.engine.cache_helpers import NUM_EXPERTS, ManualTransfer, make_cache
from tests.engine.formats.gguf.test_blocks import _random_valid_bytes

H, INTER = 256, 512  # K-quant rows are whole 256-weight blocks


def _ggml_pool(n_slots: int) -> tuple[ExpertLayout, torch.Tensor]:
    """A GGUF layer's layout (gate/up Q4_K, down Q6_K, as Q4_K_M) and a pool of random experts."""
    layout = ggml_layout(
        [
            ("gate_up_proj", (2 * INTER, H), QT.Q4_K, row_bytes(QT.Q4_K, H), None),
            ("down_proj", (H, INTER), QT.Q6_K, row_bytes(QT.Q6_K, INTER), None),
        ]
    )
    rng = np.random.default_rng(3)
    pool = torch.zeros(n_slots, layout.nbytes, dtype=torch.uint8)
    for slot in range(n_slots):
        for f in layout.fields:
            data = _random_valid_bytes(f.ggml_type, f.weight_shape, rng) // 8  # small scales: no overflow
            pool[slot, f.offset : f.offset + f.nbytes] = torch.from_numpy(data.reshape(-1))
    return layout, pool


def _module() -> SimpleNamespace:
    """The flags and activation of Qwen3-MoE's experts, as `OffloadedExperts` holds them."""
    experts = build_tiny_model("qwen3_moe").model.layers[0].mlp.experts
    return SimpleNamespace(
        has_gate=True, has_bias=False, is_transposed=False, scales_input=False, template=experts, fused=None
    )


def test_ggml_experts_in_a_group_give_the_values_of_one_at_a_time() -> None:
    layout, pool = _ggml_pool(n_slots=6)
    assert groupable(layout)
    module = _module()
    index = [[4, 1], [1, 5], [0, 4]]  # [T][K]: expert 1 and 4 serve two tokens, padding for the rest
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    weights = torch.rand(6, generator=torch.Generator().manual_seed(1))

    def step() -> _Step:
        return _Step(hidden, weights, 2, torch.zeros_like(hidden), group_by_expert(index), index)

    expected = step()
    for expert, positions in expected.routes.items():
        views = layout.views(pool[expert])
        for pos in positions:
            token = pos // 2
            y = OffloadedExperts.expert_forward(module, hidden[token : token + 1], views)
            expected.out[token] += (y * weights[pos])[0]
    grouped = step()
    experts = sorted(grouped.routes)
    accumulate_together(module, grouped, experts, gathered_weights(pool, experts, layout, torch.float32))
    scale = expected.out.abs().max().item()
    torch.testing.assert_close(grouped.out, expected.out, atol=1e-5 * scale, rtol=1e-5)


def test_one_tokens_experts_looked_up_in_a_slot_table_give_the_values_of_one_at_a_time() -> None:
    """`forward_resident`: the experts of `top_k_index` found through the table (experts in
    shuffled slots), on the device, summed over K — as each expert computed alone and added."""
    layout, pool = _ggml_pool(n_slots=6)
    module = _module()
    module.layer, module.cache = (
        0,
        SimpleNamespace(pool=pool, store=SimpleNamespace(layout_of=lambda _: layout)),
    )
    table = torch.tensor([3, 0, 5, 1, 4, 2])  # expert -> slot
    hidden = torch.randn(1, H, generator=torch.Generator().manual_seed(0))
    top_k_index = torch.tensor([[4, 1, 2]])
    top_k_weights = torch.rand(1, 3, generator=torch.Generator().manual_seed(1))
    expected = torch.zeros_like(hidden)
    for k, expert in enumerate(top_k_index[0].tolist()):
        views = layout.views(pool[table[expert]])
        expected += OffloadedExperts.expert_forward(module, hidden, views) * top_k_weights[0, k]
    out = forward_resident(module, hidden, top_k_index, top_k_weights, table)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


def test_a_repacked_or_quantized_layout_is_not_grouped() -> None:
    layout = ggml_layout([("down_proj", (H, INTER), QT.Q6_K, row_bytes(QT.Q6_K, INTER), GGML)])
    assert not groupable(layout)


def test_groups_end_at_the_limit_and_every_slot_is_released(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=NUM_EXPERTS)
    seen = []
    for group in ready_together(cache, 0, list(range(NUM_EXPERTS)), limit=3):
        assert all(slot.pins == 1 for slot in group)
        seen.append([slot.key[1] for slot in group])
    assert seen == [list(range(i, min(i + 3, NUM_EXPERTS))) for i in range(0, NUM_EXPERTS, 3)]
    assert all(slot.pins == 0 for slot in cache.slots)


def test_a_group_ends_where_only_releasing_it_would_free_a_slot(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=2)
    sizes = [len(group) for group in ready_together(cache, 0, list(range(NUM_EXPERTS)), limit=16)]
    assert sizes == [2] * (NUM_EXPERTS // 2) + [1] * (NUM_EXPERTS % 2)
    assert cache.stats.phases["decode"].misses == NUM_EXPERTS  # each counted once


def test_an_error_in_a_group_leaves_no_slot_pinned(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=4)
    groups = ready_together(cache, 0, [0, 1, 2], limit=16)
    with pytest.raises(RuntimeError, match="compute failed"):
        for _group in groups:
            raise RuntimeError("compute failed")
    groups.close()
    assert all(slot.pins == 0 for slot in cache.slots)


def test_every_slot_pinned_by_other_work_is_a_budget_error_in_groups_too(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=1)
    cache.acquire((1, 0))
    with pytest.raises(BudgetTooSmallError, match="--expert-budget"):
        list(ready_together(cache, 0, [0], limit=16))
