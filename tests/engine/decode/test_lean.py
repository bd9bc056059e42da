"""engine.decode.lean: when a one-token step leaves transformers' forward, and when it must not.

Bit-for-bit equality with the forward on every family it takes is in test_all_families.py
(`test_lean_decode_steps_are_the_forward_bit_for_bit`); here: what hooks, caches, norms and
configs make it step aside, so nothing that watches the forward misses a step.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ExpertBudget, OffloadConfig
from engine.decode import lean as lean_decode
from engine.decode.cpu_attention import use_cpu_attention
from engine.decode.row_views import Row
from engine.loader import load_model
from engine.model.hf_calls import decoder_of
from engine.tiny.models import TINY_ARCHITECTURES, build_tiny_model, save_tiny_model, tiny_config
from engine.tiny.registry import shrunk_config

PROMPT = torch.tensor([3, 17, 42, 99, 7, 25, 11, 64] * 3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = save_tiny_model(build_tiny_model("qwen3_moe"), tmp_path_factory.mktemp("lean"))
    config = OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("all"))
    loaded = load_model(folder, config)
    yield loaded
    loaded.close()


def _steps(model, count: int = 3) -> torch.Tensor:
    cache = model.new_kv_cache()
    model.forward(PROMPT, cache)
    return torch.stack([model.forward(torch.tensor([5 + i]), cache)[0] for i in range(count)])


def test_a_standard_decoder_runs_lean_and_its_rms_norms_run_as_one_operator(model, monkeypatch):
    assert model.lean is not None
    layer = model.lean.layers[0]
    assert isinstance(layer.input_norm, lean_decode.functools.partial)  # torch's rms_norm, checked equal
    calls = []
    original = lean_decode.LeanDecode.step
    monkeypatch.setattr(
        lean_decode.LeanDecode, "step", lambda self, *args: calls.append(1) or original(self, *args)
    )
    cache = model.new_kv_cache()
    model.forward(PROMPT, cache)
    model.forward(torch.tensor([5]), cache)
    assert model.forward(torch.tensor([5, 6, 7]), cache, logits_to_keep=0).shape[0] == 3
    assert len(calls) == 3  # a prompt, a decode step, a verification


def test_a_prompt_runs_its_last_layers_mlp_on_the_kept_positions_only(model):
    """The last layer's MLP sees the rows whose logits are asked for; the earlier layers every row
    (their outputs are the next layer's keys and values)."""
    seen = []
    handles = [
        layer.mlp.register_forward_hook(
            lambda _m, args, _o, index=index: seen.append((index, args[0].shape[1]))
        )
        for index, layer in enumerate(model.lean.layers)
    ]
    try:
        model.forward(PROMPT, model.new_kv_cache(), logits_to_keep=1)
        last = len(model.lean.layers) - 1
        assert seen == [(i, len(PROMPT)) for i in range(last)] + [(last, 1)]
        seen.clear()
        model.forward(PROMPT, model.new_kv_cache(), logits_to_keep=0)
        assert seen == [(i, len(PROMPT)) for i in range(last + 1)]
    finally:
        for handle in handles:
            handle.remove()


def test_a_hook_on_the_decoder_or_the_model_sends_steps_through_transformers(model):
    """An MTP drafter records the decoder's output on every forward: with a hook there, every
    step is transformers' forward, so the hook sees it; the logits are the same either way."""
    plain = _steps(model)
    decoder = decoder_of(model.hf_model)
    for module in (decoder, model.hf_model):
        seen = []
        handle = module.register_forward_hook(lambda _m, _a, _o, seen=seen: seen.append(1))
        try:
            assert torch.equal(_steps(model), plain)
        finally:
            handle.remove()
        assert len(seen) == 1 + 3  # the prompt and every step


def test_a_hooked_norm_is_called_as_a_module():
    """A norm something watches (a prefetcher's pre-hook) stays the module, so its hook runs."""
    hf = build_tiny_model("qwen3_moe")
    norm = hf.model.layers[0].post_attention_layernorm
    seen = []
    norm.register_forward_pre_hook(lambda _m, _a: seen.append(1))
    assert lean_decode._fused(norm) is norm
    other = hf.model.layers[1].post_attention_layernorm
    assert lean_decode._fused(other) is not other


def test_a_norm_torchs_rms_norm_does_not_reproduce_stays_the_module():
    class OffsetNorm(torch.nn.Module):  # Gemma's and Qwen3-Next's (1 + weight) norms, in spirit
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(16))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return torch.nn.functional.rms_norm(x, (16,), 1 + self.weight, self.variance_epsilon)

    norm = OffsetNorm()
    assert lean_decode._fused(norm) is norm


def test_a_cache_of_other_layers_or_another_length_is_not_taken(model):
    cache = model.new_kv_cache()
    assert model.lean.takes(cache)
    cache.layers = cache.layers[:-1]
    assert not model.lean.takes(cache)
    assert not model.lean.takes(object())


@pytest.mark.parametrize(
    ("model_type", "overrides", "reason"),
    [
        ("gpt_oss", {}, "not the engine's CPU attention"),  # sinks: transformers' eager attention
        ("granitemoe", {}, "scales or caps"),  # its embedding, residual and logits multipliers
        ("qwen3_moe", {"layer_types": ["full_attention", "sliding_attention"]}, "attends fully"),
    ],
)
def test_decoders_other_than_the_standard_one_are_refused_with_the_reason(model_type, overrides, reason):
    config = _config(model_type)
    for name, value in overrides.items():
        setattr(config, name, value)
    attention = "eager" if model_type == "gpt_oss" else "sdpa"  # as the engine loads each (no sdpa for sinks)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    use_cpu_attention(hf)
    assert reason in lean_decode._refusal(hf)
    assert lean_decode.LeanDecode.of(hf) is None


def _config(model_type: str):
    return tiny_config(model_type) if model_type in TINY_ARCHITECTURES else shrunk_config(model_type)


def test_rotary_values_come_from_a_table_equal_to_the_modules_own(model, monkeypatch):
    """Slices of the table the rotary module filled equal its own outputs bit for bit, past the
    table's first size too; frequencies that change with the length, or a module whose values a
    table does not reproduce, are asked of the module at every step."""
    module = model.lean.decoder.rotary_emb
    rotary = lean_decode.RotaryTable(module)
    assert rotary.static
    hidden = torch.zeros(1, 3, model.hf_config.hidden_size)
    for first in (0, 5, 1022, 1500):
        got = rotary(hidden, first, 3)
        wanted = module(hidden, torch.arange(first, first + 3)[None])
        assert all(torch.equal(a, b) for a, b in zip(got, wanted, strict=True))
    assert next(iter(rotary._tables.values()))[0].shape[1] == 2048  # doubled once
    monkeypatch.setattr(module, "rope_type", "dynamic")
    assert not lean_decode.RotaryTable(module).static
    monkeypatch.undo()
    calls = []
    forward = module.forward

    def batch_dependent(x, position_ids):  # a module whose values depend on the run it is given
        calls.append(1)
        cos, sin = forward(x, position_ids)
        return cos + position_ids.shape[-1], sin

    monkeypatch.setattr(module, "forward", batch_dependent)
    other = lean_decode.RotaryTable(module)
    got = other(hidden, 4, 3)
    assert not other.static and torch.equal(got[0], module(hidden, torch.arange(4, 7)[None])[0])
    calls.clear()
    other(hidden, 7, 1)
    assert calls  # the module, every step


def test_one_positions_rotary_values_are_rows_of_the_table_where_a_graph_reads_them(model, monkeypatch):
    """`at` gives one position's cos and sin as `Row`s of the table, holding the module's values;
    a run of positions, or a position past the table, as the module's tensors."""
    module = model.lean.decoder.rotary_emb
    rotary = lean_decode.RotaryTable(module)
    hidden = torch.zeros(1, 1, model.hf_config.hidden_size)
    for position in (0, 7, 1500):
        cos, sin = rotary.at(position, 1)
        assert isinstance(cos, Row) and cos.shape == sin.shape == (1, 1, cos.shape[-1])
        wanted = module(hidden, torch.tensor([[position]]))
        assert torch.equal(cos.tensor(), wanted[0]) and torch.equal(sin.tensor(), wanted[1])
    assert all(isinstance(a, torch.Tensor) for a in rotary.at(3, 2))
    monkeypatch.setattr(lean_decode.RotaryTable, "TABLE_POSITIONS", 1024)
    assert all(isinstance(a, torch.Tensor) for a in lean_decode.RotaryTable(module).at(1500, 1))


def test_a_row_is_a_tables_memory_read_as_its_shape():
    table = torch.arange(24, dtype=torch.int64)
    row = Row.of(table, 6, (2, 3))
    assert row.data_ptr() == table.data_ptr() + 6 * 8 and row.numel() == 6 and row.is_contiguous()
    assert row.tensor().tolist() == [[6, 7, 8], [9, 10, 11]]
    with pytest.raises(IndexError):
        Row.of(table, 20, (2, 3))  # past the table's end
    with pytest.raises(IndexError):
        Row.of(table, -1, (1,))
    with pytest.raises(ValueError, match="contiguous"):
        Row.of(table.view(4, 6).t(), 0, (1,))


def test_rotary_values_past_the_tables_limit_come_from_the_module(model, monkeypatch):
    module = model.lean.decoder.rotary_emb
    monkeypatch.setattr(lean_decode.RotaryTable, "TABLE_POSITIONS", 1024)
    rotary = lean_decode.RotaryTable(module)
    hidden = torch.zeros(1, 3, model.hf_config.hidden_size)
    for first in (1000, 1500):
        got = rotary(hidden, first, 3)
        wanted = module(hidden, torch.arange(first, first + 3)[None])
        assert all(torch.equal(a, b) for a, b in zip(got, wanted, strict=True))
    assert max(table[0].shape[1] for table in rotary._tables.values()) == 1024
