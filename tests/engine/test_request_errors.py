"""Bad budgets, options, device out-of-memory and bad prompts: each its own `EngineError`,
with a message that names the value and says what to do."""

import re
from dataclasses import replace

import pytest
import torch

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import (
    BudgetTooSmallError,
    DeviceOutOfMemoryError,
    InvalidRequestError,
)
from engine.generation import GenerationConfig, generate_text
from engine.loader import cache_slots, expert_headroom, load_model
from engine.sampling import SamplingConfig
from tests.engine.error_helpers import CPU, EXPERT_NBYTES, GREEDY_4, load_ok

pytestmark = pytest.mark.usefixtures("no_link_thread_left")


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
        load_model(good_model, replace(CPU, sim_link_gbps=100.0))  # a link: the pool is allocated
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
