"""engine.gpu.checks without a GPU: every registered kernel has a check; each check's launches pass
arguments its manifest entry takes (their count, dtypes, alignment, ranges — `pack_args`, what a
cubin launch packs); the references are transformers' modules; and Triton's interpreter, running
the registry's own JIT kernels with the checks' very launches, meets the checks' tolerances (every
case but most bfloat16 expert ones; in a child process: tests/engine/gpu/interpreter.py says why).
What is left for the GPU is its own rounding and speed: `python -m engine.bench.gpu`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util

import numpy as np
import pytest
import torch

from engine.gpu import manifest as mf
from engine.gpu.checks import stage
from engine.gpu.checks.case import QWEN3, Shapes, relative, run_case
from engine.gpu.launcher import pack_args
from engine.gpu.registry import REGISTRY
from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter

# small enough for the interpreter; partial splits; every size another (a swap of two would show)
SMALL = Shapes(
    hidden=512,
    inter=256,
    experts=3,
    top_k=2,
    router_experts=64,
    tokens=2,
    heads=8,
    kv_heads=2,
    capacity=300,
    gemv_rows=16,
    group_size=64,
    timing_bytes=0,
)
SPECS = {spec.name: spec for spec in REGISTRY}
IDS = [spec.label for spec in stage.CASES]
# a bfloat16 expert case launches what its float32 one does in another dtype (the packing test
# checks each): the interpreter runs one of a family, and every other case
BF16_EXPERTS = ("Q4_K bf16", "FP8 per-tensor bf16", "int4_ct_g_idx bf16")
INTERPRETED = [
    spec
    for spec in stage.CASES
    if "bf16" not in spec.label or spec.label in BF16_EXPERTS or "moe_" not in spec.kernels[0]
]


def test_every_registered_kernel_has_a_check_and_one_entry_a_check():
    checked = [kernel for spec in stage.CASES for kernel in spec.kernels]
    assert sorted(set(checked)) == sorted(SPECS)
    keys = [spec.key(kernel) for spec in stage.CASES for kernel in spec.kernels]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("spec", stage.CASES, ids=IDS)
def test_each_check_launches_its_kernels_with_the_arguments_their_cubins_take(spec):
    manifest = mf.read_manifest()["kernels"]
    shapes = dataclasses.replace(SMALL, timing_bytes=1 << 18)  # the timed launches' turns too
    case = spec.build(shapes, "cpu", np.random.default_rng(0))
    assert tuple(launch.kernel for launch in case.launches) == spec.kernels
    for launch in case.launches:
        own = [name for name, kind in SPECS[launch.kernel].signature.items() if kind != "constexpr"]
        for args in (launch.args, *launch.rotations):
            assert len(args) == len(own), (launch.kernel, own)
            pack_args(launch.kernel, manifest[launch.kernel]["params"], args)
        assert all(isinstance(n, int) and n > 0 for n in launch.grid)
        assert not launch.read_bytes or len(launch.rotations) > 1  # timed from memory, not L2
    pairs = case.compare()  # on what the launches would overwrite: the names and shapes only
    assert {name for launch in case.launches for name in launch.judged_by} == set(pairs)
    assert all(got.shape == want.shape for got, want in pairs.values())


@pytest.mark.slow
def test_at_qwen3_s_shapes_every_argument_packs_as_on_the_gpu():
    """Sizes, offsets and the timed launches' slices at the GPU run's shapes (float32: the
    bfloat16 cases differ in dtype only), less memory to read in turn."""
    manifest = mf.read_manifest()["kernels"]
    shapes = dataclasses.replace(QWEN3, timing_bytes=8 << 20)
    for spec in stage.CASES:
        if "bf16" in spec.label:
            continue
        for launch in spec.build(shapes, "cpu", np.random.default_rng(0)).launches:
            for args in (launch.args, *launch.rotations):
                pack_args(launch.kernel, manifest[launch.kernel]["params"], args)


def test_relative_errors_count_equal_infinities_as_equal_and_others_never_within_tolerance():
    want = torch.tensor([float("-inf"), 2.0, -4.0])
    assert relative(torch.tensor([float("-inf"), 2.0, -3.0]), want) == 0.25
    assert not relative(torch.tensor([0.0, 2.0, -4.0]), want) <= 1.0
    assert not relative(torch.tensor([float("-inf"), float("nan"), -4.0]), want) <= 1.0


def test_a_spent_limit_starts_no_more_checks_and_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(stage, "copy_gbps", lambda: 1000.0)
    ran = []

    def check(spec, shapes, load, copy):
        ran.append(spec.label)
        if spec.label == "smoke":
            raise AssertionError("a check may not raise: its errors are entries")
        return {spec.key(k): {"ok": True} for k in spec.kernels}

    monkeypatch.setattr(stage, "check", check)
    found = stage.run(0.0)
    keys = [spec.key(kernel) for spec in stage.CASES for kernel in spec.kernels]
    assert not ran and found["summary"]["within_tolerance"] == f"0 of {len(keys)}"
    assert found["summary"]["not_run"] == keys
    assert "0 s ran out" in found["smoke_scaled_add"]["skipped"]


def test_the_references_are_transformers_modules():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeRMSNorm,
        apply_rotary_pos_emb,
        eager_attention_forward,
    )

    from engine.gpu.checks import decoder

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 256, generator=generator).to(dtype)
        norm = Qwen3MoeRMSNorm(256, eps=decoder.EPS).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(256, generator=generator) + 1)
            assert torch.equal(decoder.llama_rms_norm(x, norm.weight), norm(x))
        cos, sin = decoder.rotary_tables(40, 128, dtype, "cpu")
        q, k = (
            torch.randn(8, 128, generator=generator).to(dtype),
            torch.randn(2, 128, generator=generator).to(dtype),
        )
        want_q, want_k = apply_rotary_pos_emb(q[None], k[None], cos[None, 17], sin[None, 17])
        assert torch.equal(decoder.rotated(q, cos[17], sin[17]), want_q[0])
        assert torch.equal(decoder.rotated(k, cos[17], sin[17]), want_k[0])
    keys, values = (torch.randn(1, 2, 300, 128, generator=generator) for _ in "kv")
    q = torch.randn(8, 128, generator=generator)
    module = type("Attention", (), {"num_key_value_groups": 4, "training": False})()
    want, _ = eager_attention_forward(
        module,
        q.double()[None, :, None],
        keys[:, :, :226].double(),
        values[:, :, :226].double(),
        None,
        scaling=0.1,
    )
    found = decoder.attention_reference(q, keys, values, 225, 0.1, 384, 128)
    assert relative(found["attention"], want.reshape(8, 128)) < 1e-6  # its softmax is float32
    combined = (
        found["partial"] * torch.exp(found["max"] - found["max"].amax(-1, keepdim=True))[..., None]
    ).sum(1)
    weights = (found["sum"] * torch.exp(found["max"] - found["max"].amax(-1, keepdim=True))).sum(1)
    assert torch.allclose(combined / weights[:, None], found["attention"], rtol=0, atol=1e-12)


# -- Triton's interpreter ----------------------------------------------------------------------------


@pytest.mark.timeout(600)  # some 80 seconds on two cores
def test_the_checks_in_a_child_interpreter():
    """This module's interpreter tests, run by pytest in a process with TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    run_in_child_interpreter(__file__, timeout=900)


def interpreted(name: str):
    """The registry entry `name`'s JIT kernel, launched as the build compiles it (its constexprs,
    warps and fp fusion) with a cubin launch's grid and arguments."""
    spec = SPECS[name]
    module, _, function = spec.function.partition(":")
    kernel = getattr(importlib.import_module(module), function)

    def launch(grid, *args) -> None:
        options = {"num_warps": spec.num_warps, "enable_fp_fusion": not spec.exact_fp}
        kernel[grid](*args, **spec.constexprs, **options)

    return launch


@in_the_interpreter
@pytest.mark.parametrize("spec", INTERPRETED, ids=[spec.label for spec in INTERPRETED])
def test_the_interpreter_meets_each_check(spec):
    case = spec.build(SMALL, "cpu", np.random.default_rng(0))
    entries = run_case(case, interpreted)
    assert all(entry.get("ok") for entry in entries.values()), entries
