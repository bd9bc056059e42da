"""The launcher (engine.gpu.launcher): arguments packed in the manifest's order, the image each
card runs, clear refusals, and the CUDA driver's calls through a stand-in libcuda built here. The
`gpu` tests load the committed cubins through the real driver and launch them, in a CUDA graph too:

    python -m pytest -q -p no:cacheprovider tests/engine/gpu/test_launcher.py -m gpu
"""

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.gpu import launcher
from engine.gpu import manifest as mf
from tests.engine.gpu.test_aot import ALL_ARCHS, SMOKE_PARAMS


def test_arguments_are_packed_in_the_manifests_order_with_null_scratch_pointers():
    x, y, out = torch.ones(8), torch.zeros(8), torch.empty(8)
    values = launcher.pack_args("smoke", SMOKE_PARAMS, (x, y, out, 8, 2.5))
    assert [type(v) for v in values] == [ctypes.c_uint64] * 3 + [ctypes.c_int32, ctypes.c_float] + [
        ctypes.c_uint64
    ] * 2
    assert [v.value for v in values] == [x.data_ptr(), y.data_ptr(), out.data_ptr(), 8, 2.5, 0, 0]
    pointers = launcher.param_pointers(values)
    assert [ctypes.cast(p, ctypes.POINTER(ctypes.c_int32)).contents.value for p in pointers[3:4]] == [8]
    assert ctypes.cast(pointers[0], ctypes.POINTER(ctypes.c_uint64)).contents.value == x.data_ptr()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((1, 2), TypeError, r"takes 5 arguments \(x_ptr, y_ptr, out_ptr, n, alpha\); got 2"),
        (
            (torch.ones(8, dtype=torch.float64), 0, 0, 8, 1.0),
            TypeError,
            r"x_ptr \(\*fp32\) takes a float32 tensor",
        ),
        ((3, 0, 0, 8, 1.0), TypeError, r"x_ptr \(\*fp32\) takes a tensor; got int"),
        (("x", torch.tensor(8), 1.0), TypeError, r"n \(i32\) takes a Python number, not a tensor"),
        (("x", 2**31, 1.0), ValueError, r"n \(i32\) = 2147483648 does not fit"),
        (("x", 8.0, 1.0), TypeError, r"n \(i32\) takes an int; got float"),
        (
            (torch.ones(9)[1:], 0, 0, 8, 1.0),
            ValueError,
            r"x_ptr \(\*fp32\): address 0x[0-9a-f]+ is not 16-byte",
        ),
        (
            (torch.ones(8, 2)[:, 0], 0, 0, 8, 1.0),
            ValueError,
            r"x_ptr \(\*fp32\): the kernel reads it as contiguous",
        ),
    ],
)
def test_packing_refuses_what_the_kernel_was_not_built_for(args, error, match):
    if args[0] == "x":  # the three tensors are fine, the scalars are not
        args = (torch.ones(8), torch.ones(8), torch.ones(8), *args[1:])
    with pytest.raises(error, match=match):
        launcher.pack_args("smoke", SMOKE_PARAMS, args)


def test_half_precision_scalars_and_grids():
    assert launcher.half_bits(1.0, "fp16") == 0x3C00 and launcher.half_bits(-2.0, "bf16") == 0xC000
    assert launcher.half_bits(1.0 + 2**-8, "bf16") == 0x3F80  # a tie rounds to even
    assert launcher.grid3("k", 7) == (7, 1, 1) and launcher.grid3("k", (2, 3)) == (2, 3, 1)
    with pytest.raises(ValueError, match="kernel k: a grid is 1 to 3 non-negative ints"):
        launcher.grid3("k", (1, 2, 3, 4))


ENTRY = {
    "cubins": {
        f"sm_{cc}": {"file": f"k.sm_{cc}.cubin", "target": f"sm_{cc}{'a' * (cc >= 90)}", "shared": 0}
        for cc in (80, 86, 89, 90, 120)
    },
    "ptx": [{"file": "k.sm_120.ptx", "arch": 120, "target": "sm_120", "shared": 64}],
}


@pytest.mark.parametrize(
    ("capability", "file", "kind"),
    [
        (80, "k.sm_80.cubin", "cubin"),
        (87, "k.sm_86.cubin", "cubin"),  # Orin: sm_86 code runs on 8.7
        (90, "k.sm_90.cubin", "cubin"),
        (120, "k.sm_120.cubin", "cubin"),
        (121, "k.sm_120.ptx", "ptx"),  # sm_120a code runs on 12.0 only: the driver compiles the PTX
        (130, "k.sm_120.ptx", "ptx"),
    ],
)
def test_the_image_for_each_compute_capability(capability, file, kind):
    image = mf.select_image("k", ENTRY, capability, Path("/c"))
    assert (image.path, image.kind) == (Path("/c") / file, kind)


@pytest.mark.parametrize("capability", [75, 100])
def test_an_unsupported_arch_is_refused_by_name(capability):
    with pytest.raises(
        RuntimeError, match=rf"kernel k: nothing runs on this GPU \(sm_{capability}\); built for sm_80"
    ):
        mf.select_image("k", ENTRY, capability)


def test_the_launcher_refuses_clearly_without_a_driver(monkeypatch):
    monkeypatch.setattr(launcher, "LIBRARY_NAMES", ("libcuda-not-here.so.1",))
    monkeypatch.setattr(launcher.CudaDriver, "_loaded", None)
    with pytest.raises(
        RuntimeError, match=r"kernel smoke_scaled_add: no CUDA driver \(libcuda-not-here.so.1"
    ):
        launcher.CubinKernel.load("smoke_scaled_add")
    with pytest.raises(RuntimeError, match=r"kernel nope: not built \(the manifest has .*smoke_scaled_add"):
        launcher.CubinKernel.load("nope")


FAKE_DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
int major = 9, minor = 0, launches = 0, optin = 232448, func_attribute = -1, func_value = -1;
unsigned grid[3], block, shared;
void *stream, *current;
int cuInit(unsigned flags) { return 0; }
int cuGetErrorName(int r, const char **s) {
    *s = r == 700 ? "CUDA_ERROR_ILLEGAL_ADDRESS" : r == 218 ? "CUDA_ERROR_INVALID_PTX" : 0;
    return *s ? 0 : 1;
}
int cuDeviceGet(int *d, int ordinal) { *d = ordinal; return 0; }
int cuDeviceGetAttribute(int *v, int a, int d) {
    *v = a == 75 ? major : a == 76 ? minor : a == 97 ? optin : 0;
    return 0;
}
int cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)0x1234; return 0; }
int cuCtxGetCurrent(void **c) { *c = current; return 0; }
int cuCtxSetCurrent(void *c) { current = c; return 0; }
int cuModuleLoadData(void **m, const char *image) {
    *m = (void *)1;
    return memcmp(image, "\x7f" "ELF", 4) ? 200 : 0;
}
int cuModuleLoadDataEx(void **m, const char *ptx, unsigned n, int *options, void **values) {
    if (n == 2 && options[0] == 5 && options[1] == 6) snprintf(values[0], (size_t)values[1], "ptxas says no");
    return 218;
}
int cuModuleGetFunction(void **f, void *m, const char *name) {
    *f = (void *)2;
    return strcmp(name, "scaled_add_kernel") && strcmp(name, "decode_attention_split_kernel") ? 500 : 0;
}
int cuFuncSetAttribute(void *f, int a, int v) { func_attribute = a, func_value = v; return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned sh, void *st, void **p, void **extra) {
    if (current != (void *)0x1234) return 201;
    launches++, grid[0] = gx, grid[1] = gy, grid[2] = gz, block = bx * by * bz, shared = sh, stream = st;
    float *x = *(float **)p[0], *y = *(float **)p[1], *out = *(float **)p[2];
    int n = *(int32_t *)p[3];
    float alpha = *(float *)p[4];
    if (n < 0 || *(uint64_t *)p[5] || *(uint64_t *)p[6]) return 700;
    for (int i = 0; i < n; i++) out[i] = x[i] * alpha + y[i];  /* the kernel, on the host's memory */
    return 0;
}
"""


@pytest.fixture
def fake_driver(tmp_path, monkeypatch) -> ctypes.CDLL:
    """A libcuda of C stand-ins (compiled here) whose cuLaunchKernel runs the smoke kernel on host
    memory: the launcher's ctypes calls, its context handling and its kernelParams, end to end."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler")
    (tmp_path / "fake.c").write_text(FAKE_DRIVER)
    library = tmp_path / "libfakecuda.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(tmp_path / "fake.c")], check=True)
    monkeypatch.setattr(launcher, "LIBRARY_NAMES", (str(library),))
    monkeypatch.setattr(launcher.CudaDriver, "_loaded", None)
    return ctypes.CDLL(str(library))


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in driver is a Linux shared library")
def test_the_launcher_drives_the_cuda_driver(fake_driver):
    kernel = launcher.CubinKernel.load("smoke_scaled_add", device=0)
    assert (kernel.image.path.name, kernel.block, kernel.shared) == ("smoke_scaled_add.sm_90.cubin", 128, 0)
    x, y, out = torch.randn(3000), torch.randn(3000), torch.empty(3000)
    kernel.launch((3,), launcher.pack_args(kernel.name, kernel.params, (x, y, out, 3000, 0.3)), 0xABC)
    assert torch.equal(out, x * 0.3 + y)
    assert list((ctypes.c_uint * 3).in_dll(fake_driver, "grid")) == [3, 1, 1]
    assert ctypes.c_void_p.in_dll(fake_driver, "stream").value == 0xABC
    kernel.launch((0, 4), [], 0)  # an empty grid launches nothing
    assert ctypes.c_int.in_dll(fake_driver, "launches").value == 1
    with pytest.raises(
        RuntimeError, match="kernel smoke_scaled_add: cuLaunchKernel failed with CUDA_ERROR_ILLEGAL"
    ):
        kernel.launch(1, launcher.pack_args(kernel.name, kernel.params, (x, y, out, -1, 0.3)), 0)
    ctypes.c_int.in_dll(fake_driver, "major").value = 12
    ctypes.c_int.in_dll(fake_driver, "minor").value = 1  # no cubin for 12.1: the PTX, which fails here
    with pytest.raises(
        RuntimeError, match=r"cuModuleLoadDataEx \(PTX for sm_120\) failed with .*: ptxas says no"
    ):
        launcher.CubinKernel.load("smoke_scaled_add", device=0)
    ctypes.c_int.in_dll(fake_driver, "major").value = 7
    with pytest.raises(RuntimeError, match=r"kernel smoke_scaled_add: nothing runs on this GPU \(sm_71\)"):
        launcher.CubinKernel.load("smoke_scaled_add", device=0)


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in driver is a Linux shared library")
def test_a_kernel_past_48_kib_of_shared_memory_opts_in_to_it(fake_driver):
    """The attention's float32 split kernel holds its 3xTF32 operands in 68 KiB: the manifest
    records it, and the load raises the function's dynamic shared memory limit to it."""
    name = "decode_attention_split_d128_fp32"
    shared = mf.read_manifest()["kernels"][name]["cubins"]["sm_90"]["shared"]
    assert shared > launcher.STATIC_SHARED_LIMIT
    kernel = launcher.CubinKernel.load(name, device=0)
    attribute = ctypes.c_int.in_dll(fake_driver, "func_attribute").value
    assert (kernel.shared, attribute) == (shared, launcher.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
    assert ctypes.c_int.in_dll(fake_driver, "func_value").value == shared
    ctypes.c_int.in_dll(fake_driver, "optin").value = 64 * 1024
    with pytest.raises(
        RuntimeError, match=f"{name}: needs {shared} bytes of shared memory; this GPU gives 65536"
    ):
        launcher.CubinKernel.load(name, device=0)


def test_the_shipped_manifest_lists_what_the_launcher_needs():
    manifest = mf.read_manifest()
    smoke = manifest["kernels"]["smoke_scaled_add"]
    assert smoke["params"] == SMOKE_PARAMS and sorted(smoke["cubins"]) == sorted(ALL_ARCHS)
    for entry in manifest["kernels"].values():
        assert [p["type"] for p in entry["params"][-2:]] == [mf.SCRATCH] * 2
        for item in [*entry["cubins"].values(), *entry["ptx"]]:
            assert (mf.CUBIN_DIR / item["file"]).is_file()


# -- on a GPU --------------------------------------------------------------------------------------


@pytest.fixture
def smoke_kernel():
    return launcher.CubinKernel.load("smoke_scaled_add")


@pytest.mark.gpu
def test_the_smoke_cubin_runs_and_rounds_as_torch_does(smoke_kernel):
    n = 5000  # not a multiple of the block: the mask works
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.full((n,), float("nan"), device="cuda")
    smoke_kernel(((n + 1023) // 1024,), x, y, out, n, 0.3)
    assert torch.equal(out, x * 0.3 + y)  # no FMA: the product and the sum rounded apart
    assert smoke_kernel.image.kind == "cubin"


@pytest.mark.gpu
def test_the_smoke_cubin_runs_on_a_side_stream_and_in_a_cuda_graph(smoke_kernel):
    n = 4096
    x, y, out = (torch.randn(n, device="cuda") for _ in range(3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        smoke_kernel((n // 1024,), x, y, out, n, 2.0)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, x * 2.0 + y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        smoke_kernel((n // 1024,), x, y, out, n, -1.5)
    x.copy_(torch.randn(n, device="cuda"))
    graph.replay()
    assert torch.equal(out, x * -1.5 + y)


@pytest.mark.gpu
def test_the_moe_cubins_match_the_reference():
    """The registered kquant_moe cubins against gguf_blocks' dequantize → matmul (Q8_0 experts and a
    Q4_K matrix), with the pool and helpers of the interpreter tests."""
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    from engine.formats.gguf.blocks import dequantize
    from tests.engine.gpu.test_kquant_moe import HIDDEN, INTER, Pool, assert_close, random_blocks

    rng = np.random.default_rng(0)
    pool, ids = Pool((QT.Q8_0, QT.Q8_0), rng), [4, 1, 4]
    x, weights = torch.randn(HIDDEN), torch.tensor([0.6, 0.25, 0.15])
    gpu = {
        name: t.cuda()
        for name, t in {"pool": pool.pool, "table": pool.table, "ids": torch.tensor(ids)}.items()
    }
    act = torch.empty(3, INTER, device="cuda")
    gate_up = launcher.CubinKernel.load("moe_gate_up_q8_0_fp32")
    gate_up(
        (INTER // 8, 3),
        x.cuda(),
        gpu["pool"],
        gpu["table"],
        gpu["ids"],
        act,
        pool.pool.shape[1],
        0,
        INTER,
        HIDDEN,
    )
    assert_close(act.cpu(), pool.reference_act(x, ids))
    out = torch.empty(HIDDEN, device="cuda")
    down = launcher.CubinKernel.load("moe_down_q8_0_fp32")
    args = (
        act,
        gpu["pool"],
        gpu["table"],
        gpu["ids"],
        weights.cuda(),
        out,
        pool.pool.shape[1],
        pool.down_offset,
    )
    down((HIDDEN // 8,), *args, HIDDEN, INTER, 3)
    assert_close(out.cpu(), pool.reference_out(act.cpu(), ids, weights))
    blocks = random_blocks(QT.Q4_K, 96, HIDDEN, rng)
    gemv, y = launcher.CubinKernel.load("quantized_gemv_q4_k_fp32"), torch.empty(96, device="cuda")
    gemv((96 // 8,), x.cuda(), blocks.cuda(), y, 96, HIDDEN)
    assert_close(y.cpu(), dequantize(blocks, QT.Q4_K, (96, HIDDEN), torch.float32) @ x)
