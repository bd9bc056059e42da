"""GGUF files as llama.cpp, LM Studio and Ollama users have them: loaded with the routed experts
kept in the file's quantized blocks, the logits equal transformers' own GGUF loading (fp32, 1e-4)
and 32 greedy tokens are identical, with a quarter of the experts cached on a simulated link.
Bad files get one clear error each."""

import shutil
from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import AutoModelForCausalLM

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import CorruptCheckpointError, InvalidConfigError, ModelNotFoundError
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.loader import load_model
from engine.tiny.gguf_writer import gguf_config, write_split_gguf, write_tiny_gguf
from tests.engine.exactness import assert_matches_reference

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64]
TYPES = [(QT.Q4_K, QT.Q6_K), (QT.Q8_0, QT.Q8_0), (QT.Q4_0, QT.Q5_1), (QT.F16, QT.BF16)]


def offload(expert_budget: str = "4") -> OffloadConfig:
    return OffloadConfig(
        device="cpu", dtype="float32", expert_budget=ExpertBudget.parse(expert_budget), sim_link_gbps=50.0
    )


@pytest.fixture(scope="module", params=TYPES, ids=[f"{a.name}-{b.name}" for a, b in TYPES])
def tiny_gguf(request, tmp_path_factory):
    expert_type, down_type = request.param
    folder = tmp_path_factory.mktemp(f"gguf-{expert_type.name}")
    return write_tiny_gguf(folder, expert_type=expert_type, down_type=down_type, other_type=QT.Q8_0)


def reference(path):
    """transformers' own GGUF loading (with the config keys it misses put right), fp32."""
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=gguf_config(path), dtype=torch.float32
    )
    return model.eval()


def test_logits_and_greedy_tokens_equal_transformers_gguf_loading(tiny_gguf):
    expected_model = reference(tiny_gguf)
    model = load_model(tiny_gguf, offload())
    try:
        assert model.cache.n_slots == 4 < model.store.total_experts  # the cache must evict
        assert_matches_reference(model, expected_model, PROMPT)
    finally:
        model.close()


def test_experts_computed_in_groups_equal_transformers_gguf_loading(tiny_gguf, monkeypatch):
    """The grouped path (CUDA's default; forced here) dequantizes a group's blocks at once: the same
    logits and greedy tokens. On the CPU Q4_K and Q6_K fields are repacked for its kernels (one
    expert at a time), so those files are checked on CUDA (tests/engine/cuda/test_gpu.py)."""
    import engine.moe.batched_experts as grouped

    groups = []
    real = grouped.accumulate_together
    monkeypatch.setattr(grouped, "accumulate_together", lambda *a: groups.append(a[2]) or real(*a))
    model = load_model(tiny_gguf, offload("12"))  # each layer keeps 5: decode steps do not stream
    try:
        model.control.grouped = True
        assert_matches_reference(model, reference(tiny_gguf), PROMPT)
        assert bool(groups) == grouped.groupable(model.store.layout_of(0))
    finally:
        model.close()


def test_the_experts_stay_in_the_files_blocks(tiny_gguf):
    model = load_model(tiny_gguf, offload())
    try:
        fields = {f.name: f for f in model.store.layout_of(0).fields}
        assert fields["gate_up_proj"].ggml_type is not None and fields["down_proj"].ggml_type is not None
        assert model.info().disk_layout.startswith("gguf ")
        dense_bytes = sum(4 * f.weight_shape[0] * f.weight_shape[1] for f in fields.values())
        if fields["gate_up_proj"].ggml_type == QT.Q4_K:  # ~4.5 bits a weight cross the link, not 32
            assert model.store.expert_nbytes < 0.2 * dense_bytes
    finally:
        model.close()


def test_a_folder_holding_the_file_and_a_split_set_load_alike(tmp_path):
    path = write_tiny_gguf(tmp_path / "one", expert_type=QT.Q8_0, down_type=QT.Q8_0)
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    whole = shutil.copy(path, split_dir / path.name)
    parts = write_split_gguf(whole, 3)
    whole.unlink()  # the folder holds the split set alone
    ids = torch.tensor(PROMPT)
    logits = []
    for source in (path, path.parent, parts[1], split_dir):
        model = load_model(source, offload("all"))
        try:
            logits.append(model.forward(ids, model.new_kv_cache()))
        finally:
            model.close()
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], rtol=0, atol=0)


def test_a_split_set_with_a_part_missing_names_it(tmp_path):
    path = write_tiny_gguf(tmp_path, expert_type=QT.Q8_0, down_type=QT.Q8_0)
    parts = write_split_gguf(path, 3)
    parts[2].unlink()
    with pytest.raises(ModelNotFoundError, match=parts[2].name):
        load_model(parts[0], offload())


def test_a_truncated_file_is_a_corrupt_checkpoint(tmp_path):
    path = write_tiny_gguf(tmp_path, expert_type=QT.Q8_0, down_type=QT.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="download it again"):
        load_model(path, offload())


def test_an_unsupported_gguf_architecture_is_named(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "llama.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(Exception, match="llama") as caught:
        load_model(path, offload())
    assert caught.value.__class__.__name__ in ("UnsupportedArchitectureError", "InvalidConfigError")


def test_a_quantized_file_refuses_a_second_quantization(tiny_gguf):
    with pytest.raises(InvalidConfigError, match="--expert-dtype native"):
        load_model(tiny_gguf, OffloadConfig(device="cpu", expert_dtype="int4"))


def test_the_folder_check_reads_a_gguf_header(tmp_path):
    from engine.model.check import check_model_folder

    path = write_tiny_gguf(tmp_path / "ok", expert_type=QT.Q8_0, down_type=QT.Q8_0)
    for source in (path, path.parent):
        check = check_model_folder(source)
        assert check.ok, check.problems
        assert (check.model_type, check.num_experts, check.top_k) == ("qwen3_moe", 8, 2)
        assert check.weight_files == (path.name,) and check.weight_bytes == path.stat().st_size
    path.write_bytes(path.read_bytes()[:1000])
    assert "download it again" in check_model_folder(path).summary()


def test_speculation_on_a_gguf_model_is_lossless_and_substitutes_are_refused(tiny_gguf):
    from engine.errors import InvalidRequestError
    from engine.generation_config import SpecConfig

    model = load_model(tiny_gguf, offload())
    try:
        greedy = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(greedy=True), ignore_eos=True)
        plain = generate_text(model, PROMPT, greedy).token_ids
        spec = SpecConfig(mode="self", top_r=1, confidence_tau=0.0)
        assert generate_text(model, PROMPT, replace(greedy, spec=spec, prefetch="spmoe")).token_ids == plain
        with pytest.raises(InvalidRequestError, match="--spec self or draft"):
            generate_text(model, PROMPT, replace(greedy, spec=SpecConfig(mode="substitute")))
    finally:
        model.close()


@pytest.mark.parametrize("embed_type", [QT.Q4_K, QT.Q8_0])
def test_a_big_quantized_token_embedding_stays_in_its_blocks_and_outputs_do_not_change(
    tmp_path, monkeypatch, embed_type
):
    """As a 150k-token Q4_K embedding would (the tiny table counts as big here): the embedding is
    a GgmlEmbedding holding the file's blocks, a quarter or half of BF16's bytes, and the logits
    and 32 greedy tokens still equal transformers' GGUF loading."""
    import engine.resident.ggml_embedding as ggml_embedding

    monkeypatch.setattr(ggml_embedding, "MIN_QUANTIZED_EMBEDDING", 0)
    path = write_tiny_gguf(tmp_path, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=embed_type)
    model = load_model(path, offload())
    try:
        embedding = model.hf_model.get_input_embeddings()
        assert isinstance(embedding, ggml_embedding.GgmlEmbedding) and embedding.ggml_type == embed_type
        assert (
            embedding.blocks.numel() < 0.6 * 2 * embedding.num_embeddings * embedding.embedding_dim
        )  # BF16: 2 B
        assert_matches_reference(model, reference(path), PROMPT)
    finally:
        model.close()


def test_a_bfloat16_token_embedding_stays_in_its_rows_when_the_model_computes_in_float32(
    tmp_path, monkeypatch
):
    """Upcast to float32 the table would take twice the file's bytes: its BF16 rows are kept and
    a lookup converts them (exactly); computing in bfloat16 the table is an ordinary parameter."""
    import engine.resident.ggml_embedding as ggml_embedding

    monkeypatch.setattr(ggml_embedding, "MIN_QUANTIZED_EMBEDDING", 0)
    path = write_tiny_gguf(tmp_path, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.BF16)
    model = load_model(path, offload())
    try:
        embedding = model.hf_model.get_input_embeddings()
        assert isinstance(embedding, ggml_embedding.GgmlEmbedding) and embedding.ggml_type == QT.BF16
        assert embedding.blocks.numel() == 2 * embedding.num_embeddings * embedding.embedding_dim
        assert_matches_reference(model, reference(path), PROMPT)
    finally:
        model.close()
    model = load_model(path, replace(offload(), dtype="bfloat16"))
    try:
        assert type(model.hf_model.get_input_embeddings()) is torch.nn.Embedding
    finally:
        model.close()


def test_a_small_embedding_is_loaded_dense(tiny_gguf):
    model = load_model(tiny_gguf, offload())
    try:
        assert isinstance(model.hf_model.get_input_embeddings(), torch.nn.Embedding)
    finally:
        model.close()


def test_auto_dtype_is_float32_only_where_ggml_computes_a_gguf_on_the_cpu(tiny_gguf):
    """`--kernels ggml` keeps the matrices in their blocks, so float32 activations (llama.cpp's)
    cost no upcast of weights; elsewhere a GGUF computes in bfloat16 as before."""
    from engine.loader import open_checkpoint, resolve_dtype

    _, checkpoint = open_checkpoint(tiny_gguf)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", checkpoint, cpu, "ggml") == torch.float32
    assert resolve_dtype("auto", checkpoint, cpu, "exact") == torch.bfloat16
    assert resolve_dtype("auto", checkpoint, cuda, "ggml") == torch.bfloat16
    assert resolve_dtype("bfloat16", checkpoint, cpu, "ggml") == torch.bfloat16
