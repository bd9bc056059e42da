"""SP-MoE cutoff layer: each constraint binding in turn, and the manual override."""

import dataclasses

import pytest

from engine.speculative.cutoff import CutoffInputs, choose_cutoff, resolve_cutoff

MIB = 1 << 20

# 32 MoE layers, 2 experts of 100 MiB to prefetch per layer, 5 ms per copy: each layer costs
# 200 MiB of memory and 10 ms of copies.
BASE = CutoffInputs(
    moe_layers=32,
    experts_per_layer=2.0,
    expert_nbytes=100 * MIB,
    free_nbytes=100_000 * MIB,
    t_load_ms=5.0,
    draft_ms=1_000.0,
)


def _inputs(**changes) -> CutoffInputs:
    return dataclasses.replace(BASE, **changes)


def test_memory_bound() -> None:
    choice = choose_cutoff(_inputs(free_nbytes=1_000 * MIB))  # 5 layers fit exactly
    assert (choice.layer, choice.by_memory, choice.by_time) == (4, 4, 31)
    assert "limited by memory" in choice.reason
    assert "MoE layers 0–4 (5 of 32)" in choice.reason


def test_time_bound() -> None:
    choice = choose_cutoff(_inputs(draft_ms=75.0))  # 7 layers' copies take 70 ms, 8 take 80
    assert (choice.layer, choice.by_memory, choice.by_time) == (6, 31, 6)
    assert "limited by time" in choice.reason
    assert "75.0 ms" in choice.reason


def test_both_constraints_binding_at_once() -> None:
    choice = choose_cutoff(_inputs(free_nbytes=600 * MIB, draft_ms=30.0))
    assert (choice.layer, choice.by_memory, choice.by_time) == (2, 2, 2)
    assert "limited by memory and time" in choice.reason


def test_fractional_experts_per_layer() -> None:
    # unique_experts(...) * (1 - hit) is rarely whole: 1.5 experts = 7.5 ms per layer
    choice = choose_cutoff(_inputs(experts_per_layer=1.5, draft_ms=40.0))
    assert choice.layer == 4  # 5 layers: 37.5 ms; 6 layers: 45 ms


def test_both_generous_covers_every_layer() -> None:
    choice = choose_cutoff(BASE)
    assert (choice.layer, choice.by_memory, choice.by_time) == (31, 31, 31)
    assert "0–31 (32 of 32)" in choice.reason


def test_nothing_fits_means_no_prefetch() -> None:
    by_memory = choose_cutoff(_inputs(free_nbytes=150 * MIB))
    assert (by_memory.layer, by_memory.by_memory) == (-1, -1)
    assert by_memory.reason.startswith("No prefetch")
    assert "the first MoE layer alone" in by_memory.reason
    by_time = choose_cutoff(_inputs(draft_ms=9.0))
    assert (by_time.layer, by_time.by_time) == (-1, -1)


def test_nothing_to_prefetch_covers_every_layer() -> None:
    choice = choose_cutoff(_inputs(experts_per_layer=0.0, free_nbytes=0, draft_ms=0.0))
    assert choice.layer == 31


def test_inputs_are_validated() -> None:
    with pytest.raises(ValueError, match="t_load_ms"):
        _inputs(t_load_ms=-1.0)
    with pytest.raises(ValueError, match="moe_layers"):
        _inputs(moe_layers=0)


def test_manual_override_in_range() -> None:
    choice = resolve_cutoff(10, _inputs(free_nbytes=1_000 * MIB), moe_layers=32)
    assert choice.layer == 10
    assert choice.by_memory == 4  # the measured limit is still reported
    assert choice.reason.startswith("Set by hand")
    assert resolve_cutoff(-1, None, moe_layers=32).layer == -1
    assert resolve_cutoff(31, None, moe_layers=32).by_memory is None


@pytest.mark.parametrize("manual", [32, -2, 3.0, True])
def test_manual_override_out_of_range(manual) -> None:
    with pytest.raises(ValueError, match="from -1 \\(no prefetch\\) to 31"):
        resolve_cutoff(manual, BASE, moe_layers=32)


def test_no_manual_setting_uses_the_measurements() -> None:
    assert resolve_cutoff(None, _inputs(draft_ms=75.0), moe_layers=32).layer == 6
    with pytest.raises(ValueError, match="no measurements"):
        resolve_cutoff(None, None, moe_layers=32)
    with pytest.raises(ValueError, match="but the model has 24"):
        resolve_cutoff(None, BASE, moe_layers=24)
