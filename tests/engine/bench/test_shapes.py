"""`python -m engine.bench.shapes`: the large-shape GGUF files, written here with the shape shrunk."""

from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from engine.bench import shapes


def _small(monkeypatch):
    small = {"hidden_size": 256, "moe_intermediate_size": 256, "num_experts": 8, "head_dim": 64}
    small |= {"num_attention_heads": 4, "num_key_value_heads": 2}
    monkeypatch.setattr(shapes, "QWEN3_30B_A3B_LAYER", {**shapes.QWEN3_30B_A3B_LAYER, **small})


def test_each_type_is_written_as_llama_cpp_lays_it_out(tmp_path, monkeypatch):
    _small(monkeypatch)
    assert shapes.main([str(tmp_path), "--types", "Q4_K_M", "BF16"]) == 0
    q4 = {t.name: t.tensor_type for t in GGUFReader(tmp_path / "qwen3-30b-a3b-2layers-Q4_K_M.gguf").tensors}
    assert q4["blk.0.ffn_up_exps.weight"] == q4["blk.0.attn_q.weight"] == QT.Q4_K
    # llama.cpp's Q4_K_M rule: the last layer's down projections get more bits
    assert (q4["blk.0.ffn_down_exps.weight"], q4["blk.1.ffn_down_exps.weight"]) == (QT.Q4_K, QT.Q6_K)
    assert q4["blk.0.ffn_gate_inp.weight"] == QT.F32  # the router, as the converter keeps it
    bf16 = GGUFReader(tmp_path / "qwen3-30b-a3b-2layers-BF16.gguf")
    assert {t.tensor_type for t in bf16.tensors if len(t.shape) > 1 and "gate_inp" not in t.name} == {QT.BF16}
    assert int(bf16.get_field("qwen3moe.expert_count").contents()) == 8


def test_layers_repeats_the_two_random_layers_to_the_depth_asked(tmp_path, monkeypatch):
    """`--layers N`: the file at depth N, layer k holding layer k mod 2's bytes, and the engine and
    the metadata both see N layers."""
    import numpy as np

    from engine.config import ExpertBudget, OffloadConfig
    from engine.loader import load_model

    _small(monkeypatch)
    assert shapes.main([str(tmp_path), "--types", "Q4_K_M", "--layers", "5"]) == 0
    path = tmp_path / "qwen3-30b-a3b-5layers-Q4_K_M.gguf"
    reader = GGUFReader(path)
    assert int(reader.get_field("qwen3moe.block_count").contents()) == 5
    tensors = {t.name: t for t in reader.tensors}
    for layer in range(5):
        for name in ("ffn_down_exps", "attn_q", "ffn_gate_inp"):
            mine, source = tensors[f"blk.{layer}.{name}.weight"], tensors[f"blk.{layer % 2}.{name}.weight"]
            assert mine.tensor_type == source.tensor_type and np.array_equal(mine.data, source.data)
    config = OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("all"))
    model = load_model(path, config)
    try:
        assert model.store.layer_indices == list(range(5))
    finally:
        model.close()
