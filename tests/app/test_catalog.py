"""The shipped catalog, its validation, and the fit estimates the picker shows."""

from __future__ import annotations

import copy
import json

import pytest

from app.catalog import (
    GIB,
    RAM_OVERHEAD,
    CatalogError,
    estimate_fit,
    format_duration,
    format_params,
    load_catalog,
    vram_headroom,
)
from app.model_library import folder_size
from engine.model.adapters import SUPPORTED_MODEL_TYPES
from engine.model.check import check_model_folder
from engine.resources import demo_model_dir, resources_dir

REQUIRED_MODELS = {
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen1.5-MoE-A2.7B-Chat",
    "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "allenai/OLMoE-1B-7B-0924-Instruct",
    "unsloth/gpt-oss-20b-BF16",
    "microsoft/Phi-3.5-MoE-instruct",
    "ibm-granite/granite-3.1-3b-a800m-instruct",
}


@pytest.fixture(scope="module")
def catalog():
    return {entry.id: entry for entry in load_catalog()}


def test_the_catalog_lists_the_supported_moe_models_and_the_demo(catalog):
    assert {e.repo_id for e in catalog.values() if not e.bundled} >= REQUIRED_MODELS
    assert {e.architecture for e in catalog.values()} <= set(SUPPORTED_MODEL_TYPES)
    assert catalog["qwen3-30b-a3b"].draft_repo == "Qwen/Qwen3-0.6B"
    assert catalog["mixtral-8x7b-instruct-v0.1"].gated
    gpt_oss = catalog["gpt-oss-20b-bf16"]
    assert "MXFP4" in gpt_oss.notes and "openai/gpt-oss-20b" in gpt_oss.notes
    for entry in catalog.values():
        assert 0.8 < entry.expert_share < 1
        # BF16: about two bytes per parameter
        assert entry.download_bytes == pytest.approx(2 * entry.total_params, rel=0.05), entry.id


def test_the_demo_entry_describes_the_bundled_model(catalog):
    demo = catalog["demo"]
    assert demo.bundled and demo.repo_id is None and demo.local_path == str(demo_model_dir())
    check = check_model_folder(demo.local_path)
    assert check.ok
    assert demo.total_params == check.num_params
    assert (demo.num_experts, demo.top_k) == (check.num_experts, check.top_k)
    assert demo.download_bytes == folder_size(demo_model_dir())


def write_catalog(tmp_path, change) -> str:
    raw = json.loads((resources_dir() / "catalog.json").read_text())
    raw = copy.deepcopy(raw)
    change(raw["models"])
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(raw))
    return str(path)


def set_field(index, key, value):
    def change(models):
        models[index][key] = value

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (set_field(1, "architecture", "llama"), "Catalog entry 'qwen3-30b-a3b': architecture 'llama'"),
        (set_field(1, "top_k", 500), "Catalog entry 'qwen3-30b-a3b': top_k must be"),
        (
            set_field(2, "total_params", "14B"),
            "Catalog entry 'qwen1.5-moe-a2.7b-chat': 'total_params' is missing",
        ),
        (set_field(3, "gated", 1), "'mixtral-8x7b-instruct-v0.1': 'gated' is missing or not a bool"),
        (set_field(4, "expert_share", 1.5), "'deepseek-v2-lite-chat': expert_share must lie"),
        (set_field(5, "repo_id", "no-slash"), "'olmoe-1b-7b-0924-instruct': repo_id 'no-slash' is not"),
        (
            set_field(6, "id", "phi-3.5-moe-instruct"),
            "Catalog entry 'phi-3.5-moe-instruct': the id is used twice",
        ),
        (set_field(0, "repo_id", "a/b"), "Catalog entry 'demo': needs a repo_id, or bundled: true"),
        (lambda models: models.append("oops"), "Catalog entry #9: must be an object"),
    ],
)
def test_a_bad_entry_is_named_in_the_error(tmp_path, change, message):
    with pytest.raises(CatalogError) as caught:
        load_catalog(write_catalog(tmp_path, change))
    assert message in str(caught.value)


def test_an_unreadable_catalog_says_so(tmp_path):
    path = tmp_path / "catalog.json"
    path.write_text("{not json")
    with pytest.raises(CatalogError, match="cannot be read"):
        load_catalog(path)


def test_without_a_gpu_the_whole_model_must_fit_in_ram(catalog):
    olmoe = catalog["olmoe-1b-7b-0924-instruct"]
    roomy = estimate_fit(olmoe, 64 * GIB, None)
    assert roomy.fits_in_ram and roomy.level == "good" and roomy.gpu_cacheable_fraction is None
    assert roomy.ram_needed_bytes == olmoe.download_bytes + RAM_OVERHEAD
    assert roomy.summary.startswith("Fits (CPU only): ~")
    small = estimate_fit(olmoe, 16 * GIB, None)
    assert not small.fits_in_ram and small.level == "no"
    assert small.summary.startswith("Too big: needs ~")
    assert small.summary.endswith("this computer has 16.0 GiB")


def test_with_a_gpu_only_the_experts_stay_in_ram_and_the_rest_caches_experts(catalog):
    qwen = catalog["qwen3-30b-a3b"]
    vram = 24 * GIB
    fit = estimate_fit(qwen, 128 * GIB, vram)
    assert fit.ram_needed_bytes == qwen.expert_bytes + RAM_OVERHEAD
    spare = vram - qwen.resident_bytes - vram_headroom(vram)
    assert fit.gpu_cacheable_fraction == pytest.approx(spare / qwen.expert_bytes)
    assert fit.summary.endswith(f"the GPU caches {fit.gpu_cacheable_fraction:.0%} of the experts")
    assert fit.level == "good"
    granite = catalog["granite-3.1-3b-a800m-instruct"]
    assert estimate_fit(granite, 32 * GIB, vram).gpu_cacheable_fraction == 1.0


def test_a_gpu_too_small_for_the_non_expert_weights_means_cpu_only(catalog):
    mixtral = catalog["mixtral-8x7b-instruct-v0.1"]
    fit = estimate_fit(mixtral, 256 * GIB, 2 * GIB)
    assert fit.gpu_cacheable_fraction == 0.0
    assert fit.ram_needed_bytes == mixtral.download_bytes + RAM_OVERHEAD
    assert fit.summary.startswith("CPU only: the non-expert weights") and fit.level == "tight"


def test_formatting():
    assert format_params(30_500_000_000) == "30.5B"
    assert format_params(800_000_000) == "800M"
    assert format_params(6_178_752) == "6.2M"
    assert format_duration(42.4) == "42 s"
    assert format_duration(75) == "1 min 15 s"
    assert format_duration(3 * 3600 + 5 * 60) == "3 h 05 min"
