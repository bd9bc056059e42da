"""The ahead-of-time kernels: the build (engine.gpu.build), its register and spill budget, the
manifest and `--check` (the launcher's tests: test_launcher.py).

Without a GPU: the smoke kernel is compiled for every target into a temporary folder, the
parsers read real and made-up cuobjdump output.
"""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.gpu import manifest as mf
from engine.gpu import toolchain
from engine.gpu.registry import SMOKE, KernelSpec

ROOT = Path(__file__).resolve().parents[3]
ALL_ARCHS = [f"sm_{cc}" for cc in (80, 86, 89, 90, 120)]
SMOKE_PARAMS = [
    {"name": "x_ptr", "type": "*fp32", "aligned": True},
    {"name": "y_ptr", "type": "*fp32", "aligned": True},
    {"name": "out_ptr", "type": "*fp32", "aligned": True},
    {"name": "n", "type": "i32", "aligned": False},
    {"name": "alpha", "type": "fp32", "aligned": False},
    {"name": "global_scratch", "type": "scratch"},
    {"name": "profile_scratch", "type": "scratch"},
]
HOARDING = KernelSpec(
    name="hoarding",
    function="tests.engine.gpu.aot_kernels:hoarding_kernel",
    signature={"x_ptr": "*fp32", "out_ptr": "*fp32", "BLOCK": "constexpr"},
    constexprs={"BLOCK": 8192},
    num_warps=1,
)
RES_USAGE = """\
Resource usage:
 Common:
  GLOBAL:0
 Function scaled_add_kernel:
  REG:28 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:576 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function hoarding_kernel:
  REG:255 STACK:488 SHARED:0 LOCAL:16 CONSTANT[0]:368 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


@pytest.fixture(scope="module")
def smoke_build(tmp_path_factory) -> Path:
    """The smoke kernel built for every target, once for the module."""
    pytest.importorskip("triton")
    from engine.gpu import build

    out = tmp_path_factory.mktemp("cubins")
    build.build(registry=(SMOKE,), out=out)
    return out


@pytest.fixture
def fresh_build(smoke_build, tmp_path) -> Path:
    """A copy of the module's build, for a test to spoil."""
    return Path(shutil.copytree(smoke_build, tmp_path / "cubins"))


# -- the build -------------------------------------------------------------------------------------


def test_the_build_compiles_the_smoke_kernel_for_every_target(smoke_build):
    import triton

    manifest = mf.read_manifest(smoke_build)
    entry = manifest["kernels"]["smoke_scaled_add"]
    assert manifest["triton_version"] == triton.__version__ and manifest["targets"] == [80, 86, 89, 90, 120]
    assert entry["entry"] == "scaled_add_kernel" and entry["num_warps"] == 4 and entry["exact_fp"]
    assert entry["params"] == SMOKE_PARAMS  # in launch order, Triton's two scratch pointers last
    assert sorted(entry["cubins"]) == sorted(ALL_ARCHS)
    assert {b["target"] for b in entry["cubins"].values()} == {"sm_80", "sm_86", "sm_89", "sm_90a", "sm_120a"}
    for built in entry["cubins"].values():
        cubin = smoke_build / built["file"]
        assert cubin.read_bytes()[:4] == b"\x7fELF" and built["sha256"] == mf.file_sha256(cubin)
        assert 0 < built["registers"] <= 128 and built["stack"] == built["local"] == 0
    (ptx,) = entry["ptx"]
    assert ptx["arch"] == 120 and ptx["target"] == "sm_120"  # portable, not sm_120a
    text = (smoke_build / ptx["file"]).read_text()
    assert toolchain.ptx_header(text)[1] == "sm_120" and ".file" not in text  # no paths, no line info


def test_check_passes_on_a_fresh_build(smoke_build):
    from engine.gpu import build

    assert build.check((SMOKE,), smoke_build) == []


def test_check_fails_when_the_source_hash_differs(fresh_build):
    from engine.gpu import build

    path = fresh_build / mf.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["kernels"]["smoke_scaled_add"]["source_hash"] = "0" * 64
    path.write_text(json.dumps(manifest))
    assert build.check((SMOKE,), fresh_build) == [
        "smoke_scaled_add: its source or settings changed since the build"
    ]


def test_check_fails_when_the_entry_or_the_files_change(fresh_build):
    from engine.gpu import build

    assert (
        "changed since the build" in build.check((dataclasses.replace(SMOKE, num_warps=8),), fresh_build)[0]
    )
    (fresh_build / "smoke_scaled_add.sm_90.cubin").write_bytes(b"\x7fELF")
    (fresh_build / "smoke_scaled_add.sm_80.cubin").unlink()
    problems = build.check((SMOKE, HOARDING), fresh_build)
    assert "smoke_scaled_add: smoke_scaled_add.sm_90.cubin is not the file the build wrote" in problems
    assert "smoke_scaled_add: smoke_scaled_add.sm_80.cubin is missing" in problems
    assert "hoarding: registered, never built" in problems


def test_the_committed_cubins_match_the_sources():
    """What CI runs: `python -m engine.gpu.build --check` on engine/gpu/cubins."""
    pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, "-m", "engine.gpu.build", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_spilling_kernel_fails_the_build_and_writes_nothing(tmp_path):
    pytest.importorskip("triton")
    from engine.gpu import build

    with pytest.raises(build.BuildError) as failed:
        build.build(registry=(SMOKE, HOARDING), out=tmp_path, targets=(80,))
    message = str(failed.value)
    assert "hoarding sm_80: 255 registers a thread, over the budget of 128" in message
    assert "hoarding sm_80: spills (" in message and "smoke_scaled_add" not in message
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the kernels that passed
    assert failed.value.kernels["hoarding"]["cubins"]["sm_80"]["stack"] > 0


# -- cuobjdump and PTX, as text --------------------------------------------------------------------


def test_res_usage_gives_each_functions_registers_and_local_memory():
    usage = toolchain.parse_res_usage(RES_USAGE)
    assert usage["scaled_add_kernel"] == toolchain.Usage(registers=28, stack=0, local=0, shared=0)
    assert usage["hoarding_kernel"] == toolchain.Usage(registers=255, stack=488, local=16, shared=0)


def test_the_budget_refuses_too_many_registers_and_any_spill():
    usage = toolchain.parse_res_usage(RES_USAGE)
    assert toolchain.budget_problems("add", "sm_90", usage["scaled_add_kernel"], 128) == []
    assert toolchain.budget_problems("add", "sm_90", usage["scaled_add_kernel"], 16) == [
        "add sm_90: 28 registers a thread, over the budget of 16"
    ]
    assert toolchain.budget_problems("hoard", "sm_80", usage["hoarding_kernel"], 255) == [
        "hoard sm_80: spills (488 bytes of stack, 16 of local memory a thread)"
    ]


def test_the_ptx_parameter_list_and_the_portable_target():
    ptx = (
        ".version 8.8\n.target sm_90a\n.address_size 64\n"
        ".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1,\n"
        "\t.param .f32 k_param_2,\n\t.param .align 4 .b8 k_param_3[8],\n"
        "\t.param .u64 .ptr .global .align 1 k_param_4\n)\n"
        ".reqntid 128\n{\n}\n"
    )
    assert toolchain.ptx_entry_params(ptx, "k") == [8, 4, 4, 8, 8]
    assert toolchain.ptx_header(ptx) == ("8.8", "sm_90a")
    assert toolchain.ptx_header(toolchain.portable_ptx(ptx)) == ("8.8", "sm_90")
    with pytest.raises(ValueError, match=r"no \.entry other"):
        toolchain.ptx_entry_params(ptx, "other")


# -- the launcher without a GPU --------------------------------------------------------------------
