"""Where the fused expert kernels apply (`engine.moe.fused_experts`), decided once a layer, and the
torch path wherever they do not. The kernels themselves run in Triton's interpreter in a child
process (tests/engine/gpu/test_fused_experts_model.py) and on a GPU
(tests/engine/cuda/test_gpu_fused_experts.py)."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.config import ExpertBudget, OffloadConfig
from engine.formats.fp8_experts import fp8_layout
from engine.formats.gguf.blocks import row_bytes
from engine.formats.gguf.experts import GgufFormat, ggml_layout
from engine.formats.gguf.repack import GGML, Q6_K_INT8
from engine.formats.int4 import CT, GPTQ
from engine.formats.int4_experts import int4_layout
from engine.formats.layout import ExpertLayout
from engine.loader import load_model
from engine.moe import fused_experts
from engine.moe.fused_experts import FusedExperts
from engine.tiny.gguf_writer import write_tiny_gguf

H, INTER = 256, 512
NATIVE = ExpertLayout.from_shapes({"gate_up_proj": (2 * INTER, H), "down_proj": (H, INTER)}, torch.bfloat16)


def load_emulating_cuda(path, monkeypatch, dtype: str = "float32"):
    """`path` loaded on the CPU as CUDA holds it: the file's blocks as stored (not repacked for the
    CPU's kernels), a device pool with a slot for every expert, filled, experts computed in groups."""
    monkeypatch.setattr(GgufFormat, "repacks_for_cpu", False)
    config = OffloadConfig(
        device="cpu", dtype=dtype, expert_budget=ExpertBudget.parse("all"), sim_link_gbps=50.0
    )
    model = load_model(path, config)
    model.cache.fill()
    model.control.grouped = True
    return model


def experts_of(model) -> list:
    """Each MoE layer's `OffloadedExperts`."""
    return [layer.mlp.experts for layer in model.hf_model.model.layers]


def _layout(gate_up=QT.Q4_K, down=QT.Q6_K, down_packing=None, bias=False) -> ExpertLayout:
    fields = [
        ("gate_up_proj", (2 * INTER, H), gate_up, row_bytes(gate_up, H), None),
        ("down_proj", (H, INTER), down, row_bytes(down, INTER), down_packing),
    ]
    layout = ggml_layout(fields)
    if bias:
        biases = {"gate_up_proj_bias": (2 * INTER,), "down_proj_bias": (H,)}
        plain = ExpertLayout.from_shapes(biases, torch.float32)
        layout = ExpertLayout.placed([*layout.fields, *plain.fields])
    return layout


def _module(layout: ExpertLayout, device: str = "cpu", fused: bool | None = True, **flags) -> SimpleNamespace:
    """What `FusedExperts.choose` reads of an `OffloadedExperts`."""
    cache = SimpleNamespace(store=SimpleNamespace(layout_of=lambda _: layout), device=torch.device(device))
    module = SimpleNamespace(layer=0, cache=cache, control=SimpleNamespace(fused=fused))
    module.__dict__.update({"scales_input": False, "has_bias": False, "swiglu_in_ggml": True} | flags)
    return module


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (_module(_layout(gate_up=QT.Q3_K)), "gate_up_proj is Q3_K: the fused kernels read Q4_K, Q5_K"),
        (_module(_layout(down_packing=Q6_K_INT8)), "down_proj is repacked for the CPU's kernels (q6_k_int8)"),
        (_module(_layout(down_packing=GGML)), "down_proj is repacked for the CPU's kernels"),
        (_module(_layout(bias=True), has_bias=True), "the experts have biases"),
        (_module(_layout(bias=True)), "not gate_up_proj and down_proj"),
        (_module(_layout(), scales_input=True), "the routing weight scales each expert's input"),
        (_module(_layout(), swiglu_in_ggml=False), "do not gate as SwiGLU"),
        (_module(NATIVE), "gate_up_proj is native, not GGUF blocks"),
        (_module(_layout(), fused=None), "on the CPU only when asked"),
        (_module(_layout(), fused=False), "turned off"),
        (_module(_layout(), device="meta"), "no fused kernels run on meta"),
    ],
    ids=["Q3_K", "Q6_K repacked", "ggml rows", "biases", "a bias field", "scaled input", "no SwiGLU",
         "native", "cpu unasked", "off", "another device"],
)  # fmt: skip
def test_each_layout_the_kernels_do_not_read_is_declined_with_its_reason(module, reason) -> None:
    chosen = FusedExperts.choose(module)
    assert isinstance(chosen, str) and reason in chosen, chosen


def _gpt_oss_gate() -> SimpleNamespace:
    """What `ClampedGate.of` reads of gpt-oss's experts module: its alpha, limit and gate."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    template = SimpleNamespace(alpha=1.702, limit=7.0)
    template._apply_gate = lambda gate_up: GptOssExperts._apply_gate(template, gate_up)
    return template


def test_gpt_oss_experts_are_read_in_mxfp4_with_their_biases() -> None:
    """Its gate and biases pass for MXFP4 blocks (what stops them here is the interpreter, as for
    any layout); the same experts in Q4_K are declined, saying why."""
    layout = _layout(QT.MXFP4, QT.MXFP4, bias=True)
    template = _gpt_oss_gate()
    chosen = FusedExperts.choose(_module(layout, has_bias=True, template=template))
    assert isinstance(chosen, str) and ("interpreter is off" in chosen or "triton is not installed" in chosen)
    chosen = FusedExperts.choose(_module(_layout(bias=True), has_bias=True, template=template))
    assert chosen == "gpt-oss's gate is built for MXFP4 experts, not q4_k"


def test_on_the_cpu_they_need_triton_s_interpreter() -> None:
    """This process runs triton's JIT for real (the interpreter is a child's): asked for on the CPU,
    the kernels decline, saying why."""
    chosen = FusedExperts.choose(_module(_layout(QT.Q8_0, QT.Q8_0)))
    assert isinstance(chosen, str) and ("interpreter is off" in chosen or "triton is not installed" in chosen)


FP8 = fp8_layout([("gate_up_proj", (2 * INTER, H), (128, 128)), ("down_proj", (H, INTER), (128, 128))])
GPTQ_ACT_ORDER = int4_layout(
    [("gate_up_proj", (2 * INTER, H), GPTQ, 2, 2), ("down_proj", (H, INTER), GPTQ, 4, 1)], torch.float16
)
CT_FLOAT32_SCALES = int4_layout(
    [("gate_up_proj", (2 * INTER, H), CT, 2, 0), ("down_proj", (H, INTER), CT, 4, 0)], torch.float32
)


@pytest.mark.parametrize("layout", [FP8, GPTQ_ACT_ORDER], ids=["fp8", "gptq act-order"])
def test_fp8_and_int4_experts_with_their_companions_are_read(layout) -> None:
    """Their layouts pass (scales, zeros, g_idx are companions, not weights): what stops them here
    is the interpreter, as for GGUF blocks."""
    chosen = FusedExperts.choose(_module(layout))
    assert isinstance(chosen, str) and ("interpreter is off" in chosen or "triton is not installed" in chosen)


def test_a_projection_no_kernel_reads_is_declined_with_its_reason() -> None:
    chosen = FusedExperts.choose(_module(CT_FLOAT32_SCALES))
    assert chosen == "gate_up_proj's int4 scales are torch.float32: the kernels read float16 and bfloat16"


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("fused"), expert_type=QT.Q4_K, down_type=QT.Q6_K)


def test_a_layer_decides_once_and_its_steps_run_in_torch_where_the_kernels_decline(
    gguf_path, monkeypatch, caplog
) -> None:
    """Asked for on the CPU without the interpreter: each layer asks `FusedExperts.of` at its first
    one-token step and never again, the reason is logged once for the model, and the slot-table
    steps run in torch."""
    import engine.moe.batched_experts as batched

    decisions, in_torch = [], []
    real_of, real_torch = FusedExperts.of.__func__, batched.resident_in_torch
    monkeypatch.setattr(
        FusedExperts, "of", classmethod(lambda cls, m: decisions.append(m.layer) or real_of(cls, m))
    )
    monkeypatch.setattr(
        batched, "resident_in_torch", lambda *a: in_torch.append(a[0].layer) or real_torch(*a)
    )
    fused_experts._log_once.cache_clear()
    model = load_emulating_cuda(gguf_path, monkeypatch)
    try:
        model.control.fused = True
        kv = model.new_kv_cache()
        with caplog.at_level(logging.INFO, logger=fused_experts.__name__):
            model.forward(torch.tensor([3, 17, 42, 99]), kv, logits_to_keep=1)  # its last layer: one row
            in_torch.clear()
            for token in (5, 9, 13):
                model.forward(torch.tensor([token]), kv)
        layers = sorted(model.store.layer_indices)
        assert sorted(decisions) == layers and in_torch == layers * 3
        assert all(experts.fused is None for experts in experts_of(model))
        declined = [
            r.getMessage() for r in caplog.records if "fused expert kernels do not apply" in r.getMessage()
        ]
        assert len(declined) == 1 and ("interpreter" in declined[0] or "triton" in declined[0])
    finally:
        model.close()


def test_a_model_on_the_cpu_keeps_the_torch_path_unless_asked(gguf_path, monkeypatch) -> None:
    """`ExpertControl.fused` None: the CPU computes the slot-table steps in torch, and the logits are
    those of a cache that evicts (its experts one at a time)."""
    model = load_emulating_cuda(gguf_path, monkeypatch)
    evicting = load_model(gguf_path, replace(model.config, expert_budget=ExpertBudget(experts=4)))
    try:
        ids = torch.tensor([3, 17, 42, 99, 5])
        kv = model.new_kv_cache()
        model.forward(ids[:4], kv, logits_to_keep=1)
        got = model.forward(ids[4:], kv)
        kv = evicting.new_kv_cache()
        evicting.forward(ids[:4], kv, logits_to_keep=1)
        want = evicting.forward(ids[4:], kv)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert all(experts.fused is None for experts in experts_of(model))
    finally:
        model.close()
        evicting.close()


def test_on_cuda_cubins_that_do_not_load_decline_with_the_driver_s_reason_logged_once(
    monkeypatch, caplog
) -> None:
    def no_driver(name: str, device: int):
        raise RuntimeError(f"kernel {name}: no CUDA driver (libcuda.so.1 not found)")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fused_experts, "_cubin", no_driver)
    fused_experts._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger=fused_experts.__name__):
        for _ in range(3):  # three layers: one line
            assert FusedExperts.of(_module(_layout(), device="cuda", fused=None)) is None
    reason = "their cubins do not load: kernel moe_gate_up_q4_k_fp32: no CUDA driver"
    assert [r.levelno for r in caplog.records if reason in r.getMessage()] == [logging.INFO]
