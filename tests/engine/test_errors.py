"""Every bad input the engine can meet raises its own `EngineError` with a message a user can act on.

Each test breaks a copy of one tiny Qwen3-MoE folder (saved once per module) in one way and checks
the exact error class and that the message names the file or value and says what to do. A failed
load must leave nothing half-open: no simulated-link thread, no mapped checkpoint file, and the same
good folder loads again.
"""

import json
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import INDEX_NAME
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
from engine.generation import GenerationConfig, generate_text
from engine.loader import cache_slots, expert_headroom, load_model
from engine.models import SUPPORTED_MODEL_TYPES
from engine.sampling import SamplingConfig
from engine.tiny_models import make_tiny_model

CPU = OffloadConfig(device="cpu")
GREEDY_4 = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(greedy=True))
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"  # [H=64, I=32], not in the first MoE layer
EXPERT_NBYTES = (2 * 32 * 64 + 64 * 32) * 4  # one fp32 expert: gate_up [64, 64] + down [64, 32]


@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("good") / "qwen3_moe")


@pytest.fixture
def broken(good_model, tmp_path) -> Path:
    """A private copy of the good folder for one test to break."""
    return Path(shutil.copytree(good_model, tmp_path / "model"))


@pytest.fixture(autouse=True)
def no_link_thread_left():
    """Every model a test loads is closed, and every failed load stops its simulated link."""
    before = set(threading.enumerate())
    yield
    left = [t for t in set(threading.enumerate()) - before if t.name == "sim-link"]
    assert not left, "a simulated-link thread outlived its model"


def load_ok(folder: Path) -> None:
    """The folder loads and generates: an earlier failure left nothing in the way."""
    model = load_model(folder, CPU)
    try:
        assert len(generate_text(model, [1, 2, 3], GREEDY_4).token_ids) >= 1
    finally:
        model.close()


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_weights(folder: Path, edit) -> None:
    """Rewrite model.safetensors with `edit(tensors)` applied (tensors copied out of the file first)."""
    path = folder / "model.safetensors"
    tensors = {name: t.clone() for name, t in load_file(path).items()}
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def mapped_files(folder: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line]


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
    edit_config(broken, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(UnsupportedArchitectureError, match=r"pre-quantized \(fp8\).*Use the model's BF16"):
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


# -- the expert budget and the other offload options --------------------------------------------


def test_one_expert_for_top_2(good_model):
    config = OffloadConfig(device="cpu", expert_budget=ExpertBudget.parse("1"))
    with pytest.raises(
        BudgetTooSmallError,
        match=r"budget \(1 expert\) holds 1 expert\(s\).*needs 2 experts.*at least 0\.05 MiB or 2 experts",
    ):
        load_model(good_model, config)


def test_byte_budget_below_two_experts_gives_the_minimum(good_model):
    budget = ExpertBudget.parse(f"{EXPERT_NBYTES * 2 - 1}B")
    with pytest.raises(BudgetTooSmallError, match=r"holds 1 expert\(s\).*at least 0\.05 MiB") as err:
        load_model(good_model, OffloadConfig(device="cpu", expert_budget=budget))
    # The minimum is rounded up, so the value the message gives is itself enough.
    minimum = re.search(r"at least ([\d.]+) MiB", str(err.value)).group(1)
    model = load_model(
        good_model, OffloadConfig(device="cpu", expert_budget=ExpertBudget.parse(minimum + "MiB"))
    )
    try:
        assert model.cache.n_slots == 2
    finally:
        model.close()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lots", r"Cannot read expert budget 'lots': give a size such as 2GiB"),
        ("-3", r"Cannot read expert budget '-3'"),
        ("1.5", r"Expert budget '1\.5': a number of experts must be whole"),
        ("0", r"Expert budget of 0 experts must be at least 1"),
        ("0GB", r"Expert budget '0GB' must be larger than zero"),
        ("2 parsecs", r"Cannot read expert budget '2 parsecs'"),
    ],
)
def test_unparsable_budget(text, message):
    with pytest.raises(InvalidRequestError, match=message):
        ExpertBudget.parse(text)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"device": "tpu"}, r"Unknown device 'tpu'; choose one of auto, cpu, cuda"),
        ({"device": "cuda:x"}, r"Unknown device 'cuda:x'; use cpu, cuda or cuda:N"),
        ({"policy": "fifo"}, r"Unknown cache policy 'fifo'; choose one of lru, lfu, mrs"),
        ({"dtype": "int4"}, r"Unknown dtype 'int4'"),
        ({"sim_link_gbps": -5.0}, r"--sim-link-gbps must be a positive bandwidth in GB/s, got -5\.0"),
        ({"sim_link_gbps": float("nan")}, r"--sim-link-gbps must be a positive bandwidth in GB/s, got nan"),
        ({"sim_latency_us": -1.0}, r"latency cannot be negative"),
    ],
)
def test_invalid_offload_config(good_model, changes, message):
    with pytest.raises(InvalidRequestError, match=message):
        load_model(good_model, OffloadConfig(**changes))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda(good_model):
    with pytest.raises(InvalidRequestError, match=r"--device cuda was asked for.*Use --device cpu"):
        load_model(good_model, OffloadConfig(device="cuda"))


# -- out of device memory -----------------------------------------------------------------------


def test_out_of_memory_for_the_expert_cache(good_model, monkeypatch):
    empty = torch.empty

    def empty_without_device_memory(*args, **kwargs):
        if kwargs.get("device") is not None and kwargs.get("dtype") is torch.uint8:  # the slot pool
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty_without_device_memory)
    with pytest.raises(DeviceOutOfMemoryError, match=r"expert cache \(16 slots .*Lower --expert-budget"):
        load_model(good_model, CPU)
    monkeypatch.undo()
    load_ok(good_model)


def test_out_of_memory_for_resident_weights(good_model, monkeypatch):
    def to_empty(self, *, device, recurse=True):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(torch.nn.Module, "to_empty", to_empty)
    with pytest.raises(DeviceOutOfMemoryError, match=r"resident \(non-expert\) weights.*use --device cpu"):
        load_model(good_model, CPU)
    monkeypatch.undo()
    load_ok(good_model)


def test_out_of_memory_during_forward(good_model, monkeypatch):
    model = load_model(good_model, CPU)
    try:
        experts = model.hf_model.model.layers[1].mlp.experts

        def forward(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        monkeypatch.setattr(experts, "forward", forward)
        with pytest.raises(DeviceOutOfMemoryError, match=r"while running the model\. Lower --expert-budget"):
            generate_text(model, [1, 2, 3], GREEDY_4)
        assert model.cache.used_slots == 0, "slots in doubt are dropped"
        monkeypatch.undo()
        assert len(generate_text(model, [1, 2, 3], GREEDY_4).token_ids) >= 1
    finally:
        model.close()


# -- requests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(good_model):
    model = load_model(good_model, CPU)
    yield model
    model.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (GenerationConfig(max_new_tokens=0), r"max_new_tokens must be at least 1"),
        (GenerationConfig(stop_strings=("\n\n", "")), r"Stop strings cannot be empty"),
        (GenerationConfig(sampling=SamplingConfig(temperature=-1)), r"temperature must be .* got -1"),
        (GenerationConfig(sampling=SamplingConfig(top_p=0)), r"top_p must be in \(0, 1\].* got 0"),
        (GenerationConfig(sampling=SamplingConfig(top_k=-1)), r"top_k must be an integer >= 0"),
    ],
)
def test_invalid_generation_options(loaded, config, message):
    with pytest.raises(InvalidRequestError, match=message):
        generate_text(loaded, "Hello", config)


def test_text_prompt_without_tokenizer(broken):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (broken / name).unlink(missing_ok=True)
    model = load_model(broken, CPU)
    try:
        with pytest.raises(InvalidRequestError, match=r"has no tokenizer: give the prompt as token ids"):
            generate_text(model, "Hello", GREEDY_4)
        assert len(generate_text(model, [1, 2, 3], GREEDY_4).token_ids) >= 1  # ids still work
    finally:
        model.close()


@pytest.mark.parametrize(("ids", "bad"), [([1, 259], 259), ([5, -1], -1)], ids=["past-vocab", "negative"])
def test_prompt_ids_out_of_vocabulary(loaded, ids, bad):
    with pytest.raises(
        InvalidRequestError, match=rf"token id {bad} is outside this model's vocabulary \[0, 259\)"
    ):
        generate_text(loaded, ids, GREEDY_4)


def test_empty_prompt(loaded):
    with pytest.raises(InvalidRequestError, match="The prompt is empty"):
        generate_text(loaded, [], GREEDY_4)


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


def test_auto_budget_fills_the_free_device_memory():

    budget = ExpertBudget.parse(None)
    assert budget.is_auto and str(budget) == "auto"
    assert ExpertBudget.parse("all").all_experts and str(ExpertBudget.parse("all")) == "all experts"
    assert cache_slots(budget, 100, 64, 2, auto_nbytes=None) == 64  # CPU: everything
    assert cache_slots(budget, 100, 64, 2, auto_nbytes=1050) == 10
    assert cache_slots(ExpertBudget.parse("all"), 100, 64, 2, auto_nbytes=1050) == 64
    assert expert_headroom(80 * 2**30) == 8 * 2**30 and expert_headroom(4 * 2**30) == 2**30


def test_auto_budget_without_room_says_the_gpu_is_full():

    with pytest.raises(
        DeviceOutOfMemoryError, match=r"Only 0 MiB of GPU memory is left for experts.*--device cpu"
    ):
        cache_slots(ExpertBudget.parse(None), 2**20, 64, 2, auto_nbytes=-5 * 2**20)
