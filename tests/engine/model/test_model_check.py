"""check_model_folder: what a folder holds, and every reason it cannot be loaded, from headers only."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.errors import UnsupportedArchitectureError
from engine.model.adapters import get_architecture
from engine.model.check import INDEX_NAME, check_model_folder
from engine.resources import demo_model_dir
from engine.tiny.models import TINY_ARCHITECTURES, build_tiny_model, make_tiny_model, save_tiny_model

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    model = build_tiny_model("qwen3_moe")
    return save_tiny_model(model, tmp_path_factory.mktemp("sharded") / "model", max_shard_size="100KB")


@pytest.fixture
def copy_of(tmp_path):
    def make(folder: Path) -> Path:
        return Path(shutil.copytree(folder, tmp_path / "copy"))

    return make


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_a_tiny_model_of_every_supported_type_passes(tmp_path, model_type):
    check = check_model_folder(make_tiny_model(tmp_path / model_type, model_type))
    assert check.ok, check.problems
    assert check.model_type == model_type
    assert check.num_experts == 8 and check.top_k == 2
    assert check.num_tensors > 0 and check.num_params > 0 and check.weight_files == ("model.safetensors",)


def test_the_demo_model_passes():
    check = check_model_folder(demo_model_dir())
    assert check.ok
    assert check.summary().startswith("qwen3_moe, 16 experts, top-2, 6.2M parameters in 1 file(s)")


def test_a_sharded_model_is_read_through_its_index(sharded):
    check = check_model_folder(sharded)
    assert check.ok, check.problems
    assert len(check.weight_files) > 1
    index = json.loads((sharded / INDEX_NAME).read_text())
    assert check.num_tensors == len(index["weight_map"])


def test_a_missing_shard_is_named(sharded, copy_of):
    folder = copy_of(sharded)
    lost = sorted(folder.glob("model-*.safetensors"))[1]
    lost.unlink()
    check = check_model_folder(folder)
    assert not check.ok
    assert f"is incomplete: shard(s) {lost.name} listed in {INDEX_NAME} are missing" in check.problems[0]


def test_a_tensor_the_index_lists_but_no_shard_holds_is_reported(sharded, copy_of):
    folder = copy_of(sharded)
    first_shard = sorted(folder.glob("model-*.safetensors"))[0].name
    edit_json(folder / INDEX_NAME, lambda d: d["weight_map"].update({"model.extra.weight": first_shard}))
    problems = check_model_folder(folder).problems
    assert any("lacks 1 tensor(s) its index lists: model.extra.weight" in p for p in problems)


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_reported(sharded, copy_of):
    folder = copy_of(sharded)
    weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    shards = [s for s in sorted(set(weight_map.values())) if list(weight_map.values()).count(s) > 1]
    name = next(n for n, shard in weight_map.items() if shard == shards[0])
    edit_json(folder / INDEX_NAME, lambda d: d["weight_map"].update({name: shards[1]}))
    problems = check_model_folder(folder).problems
    assert any(f"puts {name} in {shards[1]}, but it is in {shards[0]}" in p for p in problems)


def test_a_truncated_weight_file_is_corrupt(tmp_path):
    folder = make_tiny_model(tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    check = check_model_folder(folder)
    assert len(check.problems) == 1
    assert (
        check.problems[0].startswith("model.safetensors in ")
        and "is truncated or corrupt" in check.problems[0]
    )


def test_config_problems_use_the_loaders_words(tmp_path):
    folder = make_tiny_model(tmp_path / "m")
    edit_json(folder / "config.json", lambda c: c.update(model_type="llama"))
    with pytest.raises(UnsupportedArchitectureError) as loader_error:
        get_architecture("llama")
    assert check_model_folder(folder).problems == (str(loader_error.value),)

    edit_json(
        folder / "config.json",
        lambda c: c.update(model_type="qwen3_moe", quantization_config={"quant_method": "bitsandbytes"}),
    )
    assert check_model_folder(folder).problems == (
        "This checkpoint is pre-quantized (bitsandbytes); MoE Chat loads BF16/FP16/FP32 weights, "
        "FP8, GPTQ/AWQ int4 and MXFP4 checkpoints and GGUF files. "
        "Use the model's BF16 release or a GGUF file.",
    )

    (folder / "config.json").write_text("{broken")
    assert "config.json is not valid JSON" in check_model_folder(folder).problems[0]
    (folder / "config.json").unlink()
    assert (
        "has no config.json; it is not a Hugging Face model folder" in check_model_folder(folder).problems[0]
    )


def test_weights_stored_as_integers_are_a_quantized_checkpoint(tmp_path):
    folder = make_tiny_model(tmp_path / "m")
    save_file(
        {"model.layers.0.mlp.experts.gate_up_proj_qweight": np.zeros((4, 8), np.int32)},
        str(folder / "extra.safetensors"),
    )
    problems = check_model_folder(folder).problems
    assert problems == (
        "extra.safetensors stores weights as I32; quantized checkpoints (FP8, MXFP4, int) "
        "are not supported. Use the model's BF16/FP16 release.",
    )
    # MXFP4 experts (OpenAI's `_blocks`/`_scales` bytes) are read as they are
    save_file(
        {"model.layers.0.mlp.experts.gate_up_proj_blocks": np.zeros((4, 8), np.uint8)},
        str(folder / "extra.safetensors"),
    )
    assert check_model_folder(folder).problems == ()


def test_missing_tokenizer_and_weights_are_each_reported(tmp_path):
    folder = make_tiny_model(tmp_path / "m")
    for name in ("tokenizer.json", "model.safetensors"):
        (folder / name).unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\0")
    problems = check_model_folder(folder).problems
    assert len(problems) == 2
    assert "has no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json)" in problems[0]
    assert "No *.safetensors weights in" in problems[1] and "It has pytorch_model.bin" in problems[1]


def test_a_missing_folder_is_reported(tmp_path):
    assert check_model_folder(tmp_path / "nowhere").problems == (
        f"Model folder not found: {tmp_path / 'nowhere'} does not exist.",
    )


def test_importing_the_module_loads_neither_torch_nor_safetensors():
    code = "import sys, engine.model.check; print('torch' in sys.modules, 'safetensors' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]


def test_gptq_and_awq_int4_configs_pass_and_other_bit_widths_are_named():
    from engine.model.check import config_problems

    for method in ("gptq", "awq"):
        config = {"model_type": "qwen3_moe", "quantization_config": {"quant_method": method, "bits": 4}}
        assert config_problems(config) == []
        config["quantization_config"]["bits"] = 8
        assert config_problems(config) == [
            f"This checkpoint is {method} with 8-bit weights; MoE Chat loads {method} int4 only. "
            "Use the model's 4-bit or BF16 release, or a GGUF file."
        ]
