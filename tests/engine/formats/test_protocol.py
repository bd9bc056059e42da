"""Every stored expert format is one object behind one protocol, and the loader's format is the first
that detects the checkpoint: no chain of checks on the checkpoint's type."""

from types import SimpleNamespace

import pytest
from gguf import GGMLQuantizationType as QT

from engine.config import ExpertBudget, OffloadConfig
from engine.formats import registry
from engine.formats.base import ExpertFormat, StoredExperts
from engine.formats.fields import PLAIN, FieldFormat, Fp8Blocks, GgmlBlocks, Int4Words
from engine.formats.fp8_experts import FP8
from engine.formats.gguf.experts import GGUF_BLOCKS
from engine.formats.int4_experts import INT4
from engine.formats.int_quant import QuantSpec
from engine.formats.mxfp4_experts import MXFP4
from engine.formats.native_experts import NATIVE, IntQuantFormat, NativeFormat
from engine.formats.registry import FORMATS, detect_format
from engine.loader import load_model
from engine.model.folder import open_checkpoint
from engine.tiny.gguf_writer import write_tiny_gguf
from engine.tiny.models import make_tiny_model

EVERY_FORMAT = (*FORMATS, IntQuantFormat(QuantSpec(8)), IntQuantFormat(QuantSpec(4)))
CPU = OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=8))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("float") / "qwen3_moe")


def detected(folder, **quantization_config) -> ExpertFormat:
    hf_config, checkpoint = open_checkpoint(folder)
    if quantization_config:
        hf_config = SimpleNamespace(quantization_config=quantization_config)
    try:
        return detect_format(hf_config, checkpoint)
    finally:
        checkpoint.close()


@pytest.mark.parametrize("expert_format", EVERY_FORMAT, ids=lambda f: f.name)
def test_every_format_is_one_object_behind_the_protocol(expert_format):
    assert isinstance(expert_format, ExpertFormat)
    assert isinstance(expert_format.kept_quantized, bool) and isinstance(expert_format.repacks_for_cpu, bool)
    assert len({f.name for f in EVERY_FORMAT}) == len(EVERY_FORMAT)


@pytest.mark.parametrize(
    "field_format",
    [PLAIN, GgmlBlocks(int(QT.Q4_K), (256, 256)), Fp8Blocks((128, 128)), Int4Words("gptq", (8, 8))],
)
def test_every_field_format_gives_its_weight(field_format):
    assert isinstance(field_format, FieldFormat) and field_format.label


def test_the_format_is_the_first_that_detects_the_checkpoint(tiny_folder, tmp_path):
    assert detected(tiny_folder) is NATIVE
    assert detected(write_tiny_gguf(tmp_path)) is GGUF_BLOCKS
    assert detected(tiny_folder, quant_method="fp8") is FP8
    assert detected(tiny_folder, quant_method="gptq", bits=4) is INT4
    assert detected(tiny_folder, quant_method="mxfp4") is MXFP4


def test_the_engine_own_quantization_is_never_a_checkpoint_s(tiny_folder):
    hf_config, checkpoint = open_checkpoint(tiny_folder)
    try:
        assert not IntQuantFormat(QuantSpec(8)).detect(hf_config, checkpoint)
    finally:
        checkpoint.close()


class Claiming(NativeFormat):
    """The native format under another name, claiming every checkpoint and counting what it opens."""

    name = "claiming"

    def __init__(self, claims: bool):
        self.claims, self.asked, self.opened = claims, 0, []

    def detect(self, hf_config, checkpoint) -> bool:
        self.asked += 1
        return self.claims

    def open(self, checkpoint, model) -> StoredExperts:
        experts = super().open(checkpoint, model)
        self.opened.append(experts)
        return experts


@pytest.mark.parametrize("claims", [True, False])
def test_the_loader_builds_the_store_from_the_format_that_detects(tiny_folder, monkeypatch, claims):
    claiming = Claiming(claims)
    monkeypatch.setattr(registry, "FORMATS", (claiming, *FORMATS))
    model = load_model(tiny_folder, CPU)
    try:
        assert claiming.asked == 1
        assert bool(claiming.opened) == claims  # else NATIVE, asked after it, opened the experts
        assert model.info().expert_dtype == "native"
    finally:
        model.close()
