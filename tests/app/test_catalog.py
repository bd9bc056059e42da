"""The shipped catalog, its validation, and the fit estimates the picker shows: each release in
its own format (BF16 safetensors, GGUF quants, MXFP4 and FP8 ones that are still to come)."""

from __future__ import annotations

import copy
import json

import pytest

from app.catalog import (
    GGUF_EXPERT_BITS,
    GIB,
    HOST_STORE_FACTORS,
    RAM_OVERHEAD,
    CatalogError,
    estimate_fit,
    format_duration,
    format_params,
    kv_bytes,
    load_catalog,
    vram_headroom,
)
from app.model_library import ModelSource, folder_size
from engine.config import format_bytes
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
    "unsloth/Qwen3-30B-A3B-GGUF",
    "unsloth/Qwen3-30B-A3B-Instruct-2507-GGUF",
    "unsloth/Qwen3-30B-A3B-Thinking-2507-GGUF",
    "unsloth/Qwen3-Coder-30B-A3B-Instruct-GGUF",
    "Qwen/Qwen3-30B-A3B-Instruct-2507",
    "Qwen/Qwen3-30B-A3B-Thinking-2507",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct",
    "Qwen/Qwen3-30B-A3B-Instruct-2507-FP8",
    "openai/gpt-oss-20b",
}
# Bits per weight a quant's whole file comes to (llama.cpp's mixes keep some tensors wider).
BITS_PER_WEIGHT = {"Q4_K_M": (4.5, 5.2), "Q8_0": (8.4, 8.7)}


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
        if entry.format == "safetensors-bf16":  # about two bytes per parameter
            assert entry.download_bytes == pytest.approx(2 * entry.total_params, rel=0.05), entry.id
            assert entry.quant is None and entry.files == () and entry.format_label == "BF16"


def test_each_gguf_entry_fetches_one_quant_file_of_a_plausible_size(catalog):
    ggufs = [e for e in catalog.values() if e.format == "gguf"]
    assert {e.quant for e in ggufs} == {"Q4_K_M", "Q8_0"} and len(ggufs) >= 9
    for entry in ggufs:
        assert entry.size_approximate and entry.status == "available"
        [file] = entry.files
        assert file.endswith(f"-{entry.quant}.gguf") or file.endswith(f".{entry.quant}.gguf"), file
        low, high = BITS_PER_WEIGHT[entry.quant]
        assert low < 8 * entry.download_bytes / entry.total_params < high, entry.id
        assert entry.source == ModelSource(entry.repo_id, (file,), entry.quant)
        assert entry.source.key == f"{entry.repo_id}:{entry.quant}"
        assert entry.format_label == f"GGUF {entry.quant}"
    q4 = catalog["qwen3-30b-a3b-gguf-q4_k_m"]
    assert (q4.repo_id, q4.files) == ("unsloth/Qwen3-30B-A3B-GGUF", ("Qwen3-30B-A3B-Q4_K_M.gguf",))
    assert q4.download_bytes == 18_600_000_000
    assert catalog["qwen3-30b-a3b-gguf-q8_0"].download_bytes == 32_500_000_000


def test_mxfp4_gpt_oss_and_the_fp8_release_are_offered_as_shipped(catalog):
    gpt_oss = catalog["gpt-oss-20b"]
    assert (gpt_oss.repo_id, gpt_oss.format, gpt_oss.quant) == ("openai/gpt-oss-20b", "mxfp4", "MXFP4")
    assert (gpt_oss.total_params, gpt_oss.active_params, gpt_oss.num_experts, gpt_oss.top_k) == (
        20_900_000_000,
        3_600_000_000,
        32,
        4,
    )
    assert gpt_oss.download_bytes == 13_800_000_000 and gpt_oss.format_label == "MXFP4"
    assert not gpt_oss.coming  # the engine keeps gpt-oss's MXFP4 experts as they are
    assert gpt_oss.source == ModelSource("openai/gpt-oss-20b")  # the whole repo (its safetensors)
    fp8 = catalog["qwen3-30b-a3b-instruct-2507-fp8"]
    assert (fp8.repo_id, fp8.format, fp8.quant) == ("Qwen/Qwen3-30B-A3B-Instruct-2507-FP8", "fp8", "FP8")
    assert not fp8.coming  # the engine keeps FP8 experts as they are, too
    assert {e.id for e in catalog.values() if e.coming} == set()
    assert all(not e.status_reason for e in catalog.values() if not e.coming)


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


def set_field(entry_id, key, value):
    """Set `key` of the entry `entry_id`; a value of None removes the key."""

    def change(models):
        entry = next(m for m in models if m["id"] == entry_id)
        entry.pop(key) if value is None else entry.__setitem__(key, value)

    return change


def both(first, second):
    def change(models):
        first(models)
        second(models)

    return change


Q4 = "qwen3-30b-a3b-gguf-q4_k_m"
FP8 = "qwen3-30b-a3b-instruct-2507-fp8"


def split_set(files):
    """Make the Q4_K_M entry a split set of `files`."""

    def change(models):
        entry = next(m for m in models if m["id"] == Q4)
        del entry["file"]
        entry["files"] = files

    return change


SPLIT = ["Q4/Qwen3-30B-A3B-Q4_K_M-00001-of-00002.gguf", "Q4/Qwen3-30B-A3B-Q4_K_M-00002-of-00002.gguf"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (set_field("qwen3-30b-a3b", "architecture", "llama"), "'qwen3-30b-a3b': architecture 'llama'"),
        (set_field("qwen3-30b-a3b", "top_k", 500), "Catalog entry 'qwen3-30b-a3b': top_k must be"),
        (
            set_field("qwen1.5-moe-a2.7b-chat", "total_params", "14B"),
            "Catalog entry 'qwen1.5-moe-a2.7b-chat': 'total_params' is missing",
        ),
        (
            set_field("mixtral-8x7b-instruct-v0.1", "gated", 1),
            "'mixtral-8x7b-instruct-v0.1': 'gated' is missing or not a bool",
        ),
        (
            set_field("deepseek-v2-lite-chat", "expert_share", 1.5),
            "'deepseek-v2-lite-chat': expert_share must",
        ),
        (
            set_field("olmoe-1b-7b-0924-instruct", "repo_id", "no-slash"),
            "'olmoe-1b-7b-0924-instruct': repo_id 'no-slash' is not",
        ),
        (
            set_field("granite-3.1-3b-a800m-instruct", "id", "phi-3.5-moe-instruct"),
            "Catalog entry 'phi-3.5-moe-instruct': the id is used twice",
        ),
        (set_field("demo", "repo_id", "a/b"), "Catalog entry 'demo': needs a repo_id, or bundled: true"),
        (set_field(Q4, "repo_id", "un--sloth/x"), f"'{Q4}': repo_id 'un--sloth/x' is not an 'org/name'"),
        (set_field(Q4, "files", ["a.gguf", 3]), f"'{Q4}': a gguf entry names its 'file', or the 'files'"),
        (split_set([SPLIT[0], 3]), f"'{Q4}': 3 is not the path of a .gguf file"),
        (lambda models: models.insert(3, "oops"), "Catalog entry #3: must be an object"),
        (set_field("qwen3-30b-a3b", "format", None), "'qwen3-30b-a3b': 'format' is missing or not a str"),
        (set_field("qwen3-30b-a3b", "format", "awq"), "'qwen3-30b-a3b': format 'awq' is not one of"),
        (set_field("qwen3-30b-a3b", "quant", "Q4_K_M"), "'qwen3-30b-a3b': a quant (Q4_K_M, MXFP4, FP8…)"),
        (set_field("qwen3-30b-a3b", "file", "x.gguf"), "'qwen3-30b-a3b': 'file'/'files' choose what to"),
        (set_field(Q4, "quant", None), f"'{Q4}': a quant (Q4_K_M, MXFP4, FP8…) is needed"),
        (set_field(Q4, "quant", "Q4:K"), f"'{Q4}': quant 'Q4:K' is not a quant name"),
        (set_field(Q4, "quant", 4), f"'{Q4}': 'quant' must be a string"),
        (set_field(Q4, "file", None), f"'{Q4}': a gguf entry names its 'file', or the 'files'"),
        (set_field(Q4, "files", SPLIT), f"'{Q4}': a gguf entry names its 'file', or the 'files'"),
        (
            set_field(Q4, "file", "model.safetensors"),
            f"'{Q4}': 'model.safetensors' is not the path of a .gguf",
        ),
        (set_field(Q4, "file", "../up.gguf"), f"'{Q4}': '../up.gguf' is not the path of a .gguf"),
        (set_field(Q4, "architecture", "mixtral"), f"'{Q4}': MoE Chat reads GGUF files of "),
        (set_field("qwen3-30b-a3b-gguf-q8_0", "quant", "Q4_K_M"), "downloads the same files as "),
        (set_field(Q4, "status", "soon"), f"'{Q4}': status 'soon' is not one of available, coming"),
        (set_field(Q4, "status", "coming"), f"'{Q4}': a 'coming' entry says why in status_reason"),
        (set_field(Q4, "status_reason", "why"), f"'{Q4}': a 'coming' entry says why in status_reason"),
        (
            both(set_field(FP8, "status", "coming"), set_field(FP8, "status_reason", "x" * 81)),
            f"'{FP8}': status_reason must be at most 80",
        ),
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
    assert roomy.ram_needed_bytes == olmoe.download_bytes + kv_bytes(olmoe) + RAM_OVERHEAD  # KV in RAM too
    assert roomy.summary.startswith("Fits (CPU only): ~")
    small = estimate_fit(olmoe, 16 * GIB, None)  # the loader keeps the experts as int8 then
    assert small.fits_in_ram and small.level == "tight"
    expert_bytes = int(olmoe.expert_bytes * HOST_STORE_FACTORS["int8"])
    assert small.ram_needed_bytes == expert_bytes + olmoe.resident_bytes + kv_bytes(olmoe) + RAM_OVERHEAD
    assert small.summary.endswith("(experts kept as int8, lossy: outputs differ slightly)")
    tiny = estimate_fit(olmoe, 4 * GIB, None)  # not even as int4
    assert not tiny.fits_in_ram and tiny.level == "no"
    # the need at the release's own precision, the int4 one beside it, and the RAM it is compared with
    assert tiny.ram_needed_bytes == roomy.ram_needed_bytes
    assert tiny.summary.startswith(f"Too big: needs ~{format_bytes(roomy.ram_needed_bytes)} of RAM (~")
    assert "even with its experts as int4, lossy" in tiny.summary
    assert "about 3.4 GiB of this computer's 4.0 GiB RAM can hold a model" in tiny.summary


def test_with_a_gpu_only_the_experts_stay_in_ram_and_the_rest_caches_experts(catalog):
    qwen = catalog["qwen3-30b-a3b"]
    vram = 24 * GIB
    fit = estimate_fit(qwen, 128 * GIB, vram)
    assert fit.ram_needed_bytes == qwen.expert_bytes + RAM_OVERHEAD
    spare = vram - qwen.resident_bytes - kv_bytes(qwen) - vram_headroom(vram)  # the KV cache is on the GPU
    assert fit.gpu_cacheable_fraction == pytest.approx(spare / qwen.expert_bytes)
    assert fit.summary.endswith(f"the GPU caches {fit.gpu_cacheable_fraction:.0%} of the experts")
    assert fit.level == "good"
    granite = catalog["granite-3.1-3b-a800m-instruct"]
    assert estimate_fit(granite, 32 * GIB, vram).gpu_cacheable_fraction == 1.0


def test_a_split_gguf_set_is_every_part_in_order(tmp_path):
    entries = {e.id: e for e in load_catalog(write_catalog(tmp_path, split_set(SPLIT)))}
    assert entries[Q4].files == tuple(SPLIT)
    assert entries[Q4].source.path_in(tmp_path) == tmp_path / SPLIT[0]
    for bad in (SPLIT[:1], SPLIT[::-1], [SPLIT[0], SPLIT[1].replace("Q4/", "")]):
        with pytest.raises(CatalogError, match="must list every part of one split set"):
            load_catalog(write_catalog(tmp_path, split_set(bad)))


def test_a_gguf_keeps_its_quantized_experts_in_ram_and_the_rest_in_bf16(catalog):
    q4, bf16 = catalog[Q4], catalog["qwen3-30b-a3b"]
    # the Q4_K_M blocks, not a BF16 copy: 4.84 bits a weight (engine/model/tiny_gguf's Q4_K_M rule)
    assert q4.expert_bytes == int(30_500_000_000 * 0.95 * GGUF_EXPERT_BITS["Q4_K_M"] / 8)
    assert q4.expert_bytes == pytest.approx(18_600_000_000 * 0.95, rel=0.02)  # ~ the file's share
    # dequantized to BF16 at load, but for the 151936 × 2048 token embedding, kept in Q4_K (4.5 bits)
    embedding = 151_936 * 2048
    assert q4.resident_bytes == int(2 * 30_500_000_000 * 0.05 - embedding * (2 - 4.5 / 8))
    assert bf16.resident_bytes - q4.resident_bytes == pytest.approx(447e6, rel=0.02)  # saved on the GPU
    vram = 8 * GIB
    fit = estimate_fit(q4, 32 * GIB, vram)
    assert fit.ram_needed_bytes == q4.expert_bytes + RAM_OVERHEAD
    assert fit.gpu_cacheable_fraction == pytest.approx(
        (vram - q4.resident_bytes - kv_bytes(q4) - vram_headroom(vram)) / q4.expert_bytes
    )
    assert fit.fits_in_ram and fit.level == "tight"  # 18.5 GiB is over 60% of what 32 GiB leaves us
    assert estimate_fit(q4, 64 * GIB, vram).level == "good"
    as_bf16 = estimate_fit(bf16, 32 * GIB, vram)  # the same model in BF16 fits only converted to int4
    assert as_bf16.fits_in_ram and "kept as int4" in as_bf16.summary and as_bf16.level == "tight"
    assert as_bf16.ram_needed_bytes == int(bf16.expert_bytes * HOST_STORE_FACTORS["int4"]) + RAM_OVERHEAD
    cpu = estimate_fit(q4, 32 * GIB, None)  # on the CPU the BF16 resident weights are in RAM too
    assert cpu.ram_needed_bytes == q4.expert_bytes + q4.resident_bytes + kv_bytes(q4) + RAM_OVERHEAD
    q8 = estimate_fit(catalog["qwen3-30b-a3b-gguf-q8_0"], 32 * GIB, vram)
    assert q8.ram_needed_bytes > fit.ram_needed_bytes and not q8.fits_in_ram


def test_mxfp4_keeps_its_experts_in_mxfp4_and_ships_the_rest_in_bf16(catalog):
    gpt_oss = catalog["gpt-oss-20b"]
    assert gpt_oss.resident_bytes == int(2 * 20_900_000_000 * (1 - 0.91))
    assert gpt_oss.expert_bytes == 13_800_000_000 - gpt_oss.resident_bytes  # ~10 GB of MXFP4 blocks
    fit = estimate_fit(gpt_oss, 16 * GIB, 8 * GIB)
    assert fit.fits_in_ram and fit.ram_needed_bytes == gpt_oss.expert_bytes + RAM_OVERHEAD
    as_bf16 = estimate_fit(catalog["gpt-oss-20b-bf16"], 16 * GIB, 8 * GIB)
    assert as_bf16.fits_in_ram and "kept as int4" in as_bf16.summary  # only converted, with its error


def test_a_gpu_too_small_for_the_non_expert_weights_means_cpu_only(catalog):
    mixtral = catalog["mixtral-8x7b-instruct-v0.1"]
    fit = estimate_fit(mixtral, 256 * GIB, 2 * GIB)
    assert fit.gpu_cacheable_fraction == 0.0
    assert fit.ram_needed_bytes == mixtral.download_bytes + kv_bytes(mixtral) + RAM_OVERHEAD
    assert fit.summary.startswith(
        "CPU only: the non-expert weights and the KV cache for 8k tokens (~4.5 GiB)"
    )
    assert fit.level == "tight"


def test_formatting():
    assert format_params(30_500_000_000) == "30.5B"
    assert format_params(800_000_000) == "800M"
    assert format_params(6_178_752) == "6.2M"
    assert format_duration(42.4) == "42 s"
    assert format_duration(75) == "1 min 15 s"
    assert format_duration(3 * 3600 + 5 * 60) == "3 h 05 min"


def test_every_release_says_its_kv_cache_shape_and_the_fit_counts_it(catalog):
    assert all(entry.kv is not None for entry in catalog.values())
    qwen = catalog["qwen3-30b-a3b"]  # 48 layers × 4 KV heads × 128 × (key, value) × BF16: 96 KiB a token
    assert kv_bytes(qwen, 1) == 96 * 1024 and kv_bytes(qwen) == 8192 * 96 * 1024
    gpt_oss = catalog["gpt-oss-20b"]  # half its layers keep a 128-token window
    assert kv_bytes(gpt_oss, 8192) == 2 * 8 * 64 * 2 * (12 * 8192 + 12 * 127)
    short, long = (estimate_fit(qwen, 64 * GIB, None, context_tokens=n) for n in (4096, 32768))
    assert long.ram_needed_bytes - short.ram_needed_bytes == kv_bytes(qwen, 32768) - kv_bytes(qwen, 4096)


def test_a_kv_shape_that_makes_no_sense_is_a_clear_catalog_error(tmp_path):
    for bad in ({"layers": 0, "kv_heads": 16, "head_dim": 128}, {"layers": 16, "heads": 16}):

        def change(models, bad=bad):
            next(m for m in models if m["id"] == "olmoe-1b-7b-0924-instruct")["kv"] = bad

        with pytest.raises(CatalogError, match="olmoe-1b-7b-0924-instruct"):
            load_catalog(write_catalog(tmp_path, change))


def test_a_bf16_release_too_big_for_a_24_gib_computer_says_its_own_size_and_the_usable_ram(catalog):
    """The 56.9 GiB BF16 release on a 24 GiB machine: its need as BF16, not a silent int4 figure
    below a Q4_K_M file's, and the usable RAM it is compared with."""
    bf16, q4 = catalog["qwen3-30b-a3b"], catalog[Q4]
    fit = estimate_fit(bf16, 24 * GIB, None)
    assert not fit.fits_in_ram and fit.ram_needed_bytes > estimate_fit(q4, 24 * GIB, None).ram_needed_bytes
    assert fit.summary.startswith(f"Too big: needs ~{format_bytes(fit.ram_needed_bytes)} of RAM")
    assert "even with its experts as int4, lossy" in fit.summary
    assert (
        "about 20.4 GiB of this computer's 24.0 GiB RAM can hold a model (the rest stays with the system)"
        in fit.summary
    )
