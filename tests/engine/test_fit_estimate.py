"""The catalog's fit estimate counts what the loader allocates: the routed experts in their stored
precision, the resident weights (BF16) and the KV cache at the context length, within 10%.

Each checkpoint is built here in the format users download (BF16 safetensors, a GGUF file), described
the way a catalog entry describes its release (download size, parameters, expert share, KV shape),
and loaded; what the loader holds is then measured: the expert store's bytes, the model's resident
parameters, and the KV cache after a prompt of the context length."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

import engine.resident.ggml_embedding as ggml_embedding
from app.catalog import CatalogEntry, estimate_fit, kv_bytes
from engine.config import OffloadConfig
from engine.loader import load_model
from engine.model.kv_size import KvShape
from engine.tiny.gguf_writer import gguf_config, write_tiny_gguf
from engine.tiny.models import build_tiny_model, save_tiny_model

CONTEXT = 96  # tokens
SIZES = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=512, num_experts=16)
SIZES |= dict(num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _entry(kind: str, download: int, params: dict[str, int], config: dict) -> CatalogEntry:
    """A catalog entry for the release; `params`: every weight's parameter count by name."""
    total = sum(params.values())
    share = sum(n for name, n in params.items() if ".mlp.experts." in name or "_exps." in name) / total
    quant = {"gguf": "Q8_0"}.get(kind)
    return CatalogEntry(
        id=f"tiny-{kind}",
        name="tiny",
        repo_id="test/tiny",
        architecture="qwen3_moe",
        total_params=total,
        active_params=total // 2,
        num_experts=config.get("num_experts") or config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        download_bytes=download,
        size_approximate=False,
        license="apache-2.0",
        gated=False,
        draft_repo=None,
        expert_share=share,
        format=kind,
        quant=quant,
        files=("tiny.gguf",) if kind == "gguf" else (),
        kv=KvShape.from_config(config),
    )


def _bf16(tmp_path: Path) -> tuple[Path, CatalogEntry]:
    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16, **SIZES)
    folder = save_tiny_model(model, tmp_path / "bf16", dtype=torch.bfloat16)
    download = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    params = {name: p.numel() for name, p in model.named_parameters()}
    return folder, _entry("safetensors-bf16", download, params, config)


def _gguf(tmp_path: Path) -> tuple[Path, CatalogEntry]:
    path = write_tiny_gguf(
        tmp_path / "gguf", expert_type=QT.Q8_0, down_type=QT.Q8_0, other_type=QT.Q8_0, **SIZES
    )
    params = {t.name: int(t.n_elements) for t in GGUFReader(path).tensors}
    return path, _entry("gguf", path.stat().st_size, params, gguf_config(path).to_dict())


def _gguf_quantized_embedding(tmp_path: Path) -> tuple[Path, CatalogEntry]:
    """As a 150k-token vocabulary's GGUF: the token embedding stays in its Q8_0 blocks (the tiny
    table counts as big here), and the entry says how big it is."""
    path, entry = _gguf(tmp_path)
    embedding = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    return path, replace(entry, embedding_params=int(embedding.n_elements))


def _allocated(path: Path) -> dict[str, int]:
    """What the loader holds for the model at CONTEXT tokens (CPU, BF16 compute)."""
    model = load_model(path, OffloadConfig(device="cpu", dtype="bfloat16"))
    try:
        kv_cache = model.new_kv_cache()
        model.forward(torch.arange(CONTEXT) % 50 + 10, kv_cache)
        kv = sum(
            t.numel() * t.element_size() for layer in kv_cache.layers for t in (layer.keys, layer.values)
        )
        return {"experts": model.store.nbytes, "resident": model.info().resident_nbytes, "kv": kv}
    finally:
        model.close()


BUILDS = {"bf16-safetensors": _bf16, "gguf-q8_0": _gguf, "gguf-q8_0-embedding": _gguf_quantized_embedding}


@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
def test_the_fit_estimate_is_within_ten_percent_of_what_the_loader_allocates(build, tmp_path, monkeypatch):
    if build is _gguf_quantized_embedding:
        monkeypatch.setattr(ggml_embedding, "MIN_QUANTIZED_EMBEDDING", 0)
    path, entry = build(tmp_path)
    allocated = _allocated(path)
    estimated = {
        "experts": entry.expert_bytes,
        "resident": entry.resident_bytes,
        "kv": kv_bytes(entry, CONTEXT),
    }
    assert estimated["kv"] == allocated["kv"]  # exact: the same shape, the same tokens
    for part in ("experts", "resident"):
        assert estimated[part] == pytest.approx(allocated[part], rel=0.10), part
    assert sum(estimated.values()) == pytest.approx(sum(allocated.values()), rel=0.10)
    # and the estimate's RAM figure is that sum (CPU only: everything in RAM) plus the fixed overhead
    fit = estimate_fit(entry, 64 * 2**30, None, context_tokens=CONTEXT)
    assert fit.ram_needed_bytes - sum(estimated.values()) == 2 * 2**30
