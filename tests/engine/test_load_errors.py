"""Every bad model folder raises its own `EngineError` with a message a user can act on.

Each test breaks a copy of one tiny Qwen3-MoE folder (`broken`, from conftest) in one way and checks
the exact error class and that the message names the file or value and says what to do. A failed
load must leave nothing half-open: no simulated-link thread, no mapped checkpoint file, and the same
good folder loads again.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import (
    BudgetTooSmallError,
    CorruptCheckpointError,
    DeviceOutOfMemoryError,
    EngineError,
    InvalidConfigError,
    InvalidRequestError,
    MissingTensorsError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from engine.loader import load_model
from engine.model.adapters import SUPPORTED_MODEL_TYPES
from engine.model.checkpoint import INDEX_NAME
from tests.engine.error_helpers import CPU, EXPERT, edit_config, edit_weights, load_ok, mapped_files

pytestmark = pytest.mark.usefixtures("no_link_thread_left")


def test_every_error_is_an_engine_error():
    for cls in (
        ModelNotFoundError,
        InvalidConfigError,
        UnsupportedArchitectureError,
        CorruptCheckpointError,
        MissingTensorsError,
        BudgetTooSmallError,
        DeviceOutOfMemoryError,
        InvalidRequestError,
    ):
        assert issubclass(cls, EngineError)
        assert cls.kind != EngineError.kind


# -- the folder and its config ------------------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"Model folder not found: .*nowhere\. Check the path"):
        load_model(tmp_path / "nowhere", CPU)


def test_path_is_a_file(good_model):
    with pytest.raises(ModelNotFoundError, match=r"config\.json is a file; give the model's folder"):
        load_model(good_model / "config.json", CPU)


def test_folder_without_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(
        InvalidConfigError, match=r"model has no config\.json.*Give the folder that holds config\.json"
    ):
        load_model(broken, CPU)


def test_config_with_invalid_json(broken):
    (broken / "config.json").write_text('{"model_type": "qwen3_moe",')
    with pytest.raises(InvalidConfigError, match=r"config\.json is not valid JSON .*Re-download the model"):
        load_model(broken, CPU)


def test_config_without_model_type(broken):
    (broken / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(InvalidConfigError, match=r"config\.json has no model_type.*Re-download"):
        load_model(broken, CPU)


def test_unsupported_architecture_lists_the_supported_ones(broken):
    edit_config(broken, model_type="llama")
    with pytest.raises(UnsupportedArchitectureError, match="'llama' is not supported") as err:
        load_model(broken, CPU)
    assert all(model_type in str(err.value) for model_type in SUPPORTED_MODEL_TYPES)


def test_pre_quantized_config(broken):
    edit_config(broken, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(
        UnsupportedArchitectureError, match=r"pre-quantized \(bitsandbytes\).*Use the model's BF16"
    ):
        load_model(broken, CPU)


# -- the safetensors files ----------------------------------------------------------------------


def test_no_safetensors(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match=r"No \*\.safetensors weights in .*Is the download complete"):
        load_model(broken, CPU)


def test_pytorch_bin_only_gets_a_hint(broken):
    (broken / "model.safetensors").rename(broken / "pytorch_model.bin")
    with pytest.raises(
        ModelNotFoundError, match=r"It has pytorch_model\.bin.*download the safetensors version"
    ):
        load_model(broken, CPU)


def test_truncated_safetensors(broken):
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CorruptCheckpointError, match=r"model\.safetensors in .* is truncated or corrupt.*Re-download"
    ):
        load_model(broken, CPU)


def test_garbage_safetensors(broken):
    (broken / "model.safetensors").write_bytes(b"<html>Rate limit exceeded</html>" * 64)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors .*truncated or corrupt"):
        load_model(broken, CPU)


def test_corrupt_second_file_leaves_no_file_mapped(broken):
    (broken / "zz-extra.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CorruptCheckpointError, match=r"zz-extra\.safetensors .*truncated or corrupt") as err:
        load_model(broken, CPU)
    # While `err` keeps the half-built Checkpoint alive, the good first file must already be unmapped.
    if Path("/proc/self/maps").exists():  # Linux
        assert mapped_files(broken) == [], err.value
    (broken / "zz-extra.safetensors").unlink()
    load_ok(broken)


def test_index_naming_a_missing_shard(broken):
    weight_map = dict.fromkeys(load_file(broken / "model.safetensors"), "model-00002-of-00002.safetensors")
    (broken / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        CorruptCheckpointError,
        match=r"shard\(s\) model-00002-of-00002\.safetensors listed in .*missing\. Resume or repeat",
    ):
        load_model(broken, CPU)


def test_index_with_invalid_json(broken):
    (broken / INDEX_NAME).write_text('{"weight_map": ')
    with pytest.raises(
        CorruptCheckpointError, match=r"index\.json is not a valid safetensors index.*Re-download"
    ):
        load_model(broken, CPU)


# -- tensors ------------------------------------------------------------------------------------


def test_missing_non_expert_tensor(broken):
    edit_weights(broken, lambda tensors: tensors.pop("model.layers.1.post_attention_layernorm.weight"))
    with pytest.raises(
        MissingTensorsError,
        match=r"lacks 1 tensor\(s\): model\.layers\.1\.post_attention_layernorm\.weight\. The download",
    ):
        load_model(broken, CPU)


def test_missing_expert_tensor(broken):
    edit_weights(broken, lambda tensors: tensors.pop(EXPERT))
    with pytest.raises(
        MissingTensorsError, match=re.escape(repr(EXPERT)) + r" is missing.*download it again"
    ):
        load_model(broken, CPU)


def test_missing_experts_of_the_first_layer(broken):
    edit_weights(broken, lambda tensors: tensors.pop("model.layers.0.mlp.experts.0.gate_proj.weight"))
    with pytest.raises(
        MissingTensorsError, match=r"No routed-expert tensors for model\.layers\.0 .*checkpoint is incomplete"
    ):
        load_model(broken, CPU)


def test_expert_with_wrong_shape(broken):
    def narrow(tensors):
        tensors[EXPERT] = tensors[EXPERT][:, :16].contiguous()

    edit_weights(broken, narrow)
    with pytest.raises(
        CorruptCheckpointError,
        match=r"Expert 3 of model\.layers\.1 has down_proj of shape \(64, 16\).*config and weights disagree",
    ):
        load_model(broken, CPU)


def test_non_expert_with_wrong_shape(broken):
    name = "model.layers.0.post_attention_layernorm.weight"

    def widen(tensors):
        tensors[name] = torch.ones(65)

    edit_weights(broken, widen)
    with pytest.raises(
        CorruptCheckpointError, match=re.escape(name) + r" has shape \(65,\).*config\.json and the weights"
    ):
        load_model(broken, CPU)


def test_unsupported_tensor_dtype(broken):
    def quantize(tensors):
        tensors[EXPERT] = tensors[EXPERT].to(torch.int8)

    edit_weights(broken, quantize)
    with pytest.raises(
        CorruptCheckpointError, match=re.escape(repr(EXPERT)) + r" is stored as I8.*BF16/FP16 release"
    ):
        load_model(broken, CPU)


# -- nothing left half-open ---------------------------------------------------------------------


def test_failed_loads_leave_the_folder_loadable(broken):
    """Failures before, during and after the cache and link are set up; then the folder loads."""
    config = broken / "config.json"
    good_config = config.read_text()
    config.write_text("{")
    with pytest.raises(InvalidConfigError):
        load_model(broken, CPU)
    config.write_text(good_config)
    with pytest.raises(BudgetTooSmallError):
        load_model(broken, OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=1)))
    (broken / "tokenizer.json").write_text("{")  # fails after the link has started
    with pytest.raises(InvalidConfigError, match=r"The tokenizer in .* cannot be loaded"):
        load_model(broken, CPU)
    (broken / "tokenizer.json").unlink()
    load_ok(broken)
