"""Launch the ahead-of-time cubins (`engine/gpu/cubins/`, written by `engine.gpu.build`) through the
CUDA driver with ctypes: no triton and no compiler on the user's machine.

    kernel = CubinKernel.load("smoke_scaled_add")  # the image for the current device
    kernel(((n + 1023) // 1024,), x, y, out, n, 2.0)  # out = x · 2 + y, on torch's current stream

`CubinKernel.load` picks the cubin for the device's compute capability (else the nearest lower
cubin of its major that is not arch-specific, else the PTX for the driver to compile) and loads it
into the device's primary context, the one torch uses. A call packs the arguments as the manifest
lists them (`pack_args`, pure and tested without a GPU: tensor → its address, ints → i32/i64 with
range checks, Triton's scratch pointers → null) and launches with `cuLaunchKernel` on torch's
current stream. Nothing here synchronizes or reads the device, so a launch is captured by a CUDA
graph like any torch kernel. Failures raise RuntimeError naming the kernel and the CUresult.
"""

import ctypes
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.gpu import manifest as mf

LIBRARY_NAMES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
STATIC_SHARED_LIMIT = 48 * 1024  # above it a kernel must opt in to dynamic shared memory
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_JIT_ERROR_LOG_BUFFER = 5
CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6

INTS = {
    "i32": (ctypes.c_int32, -(2**31), 2**31 - 1),
    "u32": (ctypes.c_uint32, 0, 2**32 - 1),
    "i64": (ctypes.c_int64, -(2**63), 2**63 - 1),
    "u64": (ctypes.c_uint64, 0, 2**64 - 1),
}
FLOATS = {"fp32": ctypes.c_float, "fp64": ctypes.c_double}
HALVES = ("fp16", "bf16")  # passed as their 16 bits
TORCH_DTYPES = {
    "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
    "i8": "int8", "u8": "uint8", "i16": "int16", "u16": "uint16", "i32": "int32", "u32": "uint32",
    "i64": "int64", "u64": "uint64", "i1": "bool", "fp8e4nv": "float8_e4m3fn", "fp8e5": "float8_e5m2",
}  # fmt: skip


# -- arguments: pure, no driver --------------------------------------------------------------------


def pack_args(kernel: str, params: list[dict], args: tuple) -> list:
    """One ctypes value a kernel parameter, in the manifest's order: the caller's `args` for the
    kernel's own parameters, null for the scratch pointers Triton appends."""
    own = [p for p in params if p["type"] != mf.SCRATCH]
    if len(args) != len(own):
        names = ", ".join(p["name"] for p in own)
        raise TypeError(f"kernel {kernel} takes {len(own)} arguments ({names}); got {len(args)}")
    given = iter(args)
    return [
        ctypes.c_uint64(0) if p["type"] == mf.SCRATCH else pack_one(kernel, p, next(given)) for p in params
    ]


def pack_one(kernel: str, param: dict, arg):
    name, kind = param["name"], param["type"]
    where = f"kernel {kernel}: {name} ({kind})"
    if kind.startswith("*"):
        return _pointer(where, kind[1:], param.get("aligned", False), arg)
    if hasattr(arg, "data_ptr"):
        raise TypeError(f"{where} takes a Python number, not a tensor (reading one would synchronize)")
    if kind in INTS:
        ctype, low, high = INTS[kind]
        if isinstance(arg, bool | float) or not hasattr(arg, "__index__"):
            raise TypeError(f"{where} takes an int; got {type(arg).__name__}")
        value = arg.__index__()
        if not low <= value <= high:
            raise ValueError(f"{where} = {value} does not fit")
        if param.get("aligned") and value % 16:
            raise ValueError(f"{where} = {value}: the kernel was built for multiples of 16")
        return ctype(value)
    if kind in FLOATS:
        return FLOATS[kind](float(arg))
    if kind in HALVES:
        return ctypes.c_uint16(half_bits(float(arg), kind))
    raise TypeError(f"{where}: a parameter type the launcher cannot pass")


def _pointer(where: str, element: str, aligned: bool, arg) -> ctypes.c_uint64:
    if not hasattr(arg, "data_ptr"):
        raise TypeError(f"{where} takes a tensor; got {type(arg).__name__}")
    dtype = str(arg.dtype).removeprefix("torch.")
    if dtype != TORCH_DTYPES.get(element):
        raise TypeError(f"{where} takes a {TORCH_DTYPES.get(element, element)} tensor; got {dtype}")
    if not arg.is_contiguous():
        raise ValueError(f"{where}: the kernel reads it as contiguous; pass .contiguous()")
    address = arg.data_ptr()
    if aligned and address % 16:
        raise ValueError(f"{where}: address {address:#x} is not 16-byte aligned, as the kernel was built for")
    return ctypes.c_uint64(address)


def half_bits(value: float, kind: str) -> int:
    """The 16 bits of `value` as float16 or bfloat16 (rounded to nearest even)."""
    if kind == "fp16":
        return struct.unpack("<H", struct.pack("<e", value))[0]
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def param_pointers(values: list) -> ctypes.Array:
    """`void* kernelParams[]` for cuLaunchKernel: the address of each packed value."""
    return (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))


def grid3(kernel: str, grid) -> tuple[int, int, int]:
    dims = (grid,) if isinstance(grid, int) else tuple(grid)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"kernel {kernel}: a grid is 1 to 3 non-negative ints; got {grid!r}")
    return (*dims, *(1,) * (3 - len(dims)))


# -- the driver ------------------------------------------------------------------------------------

_P = ctypes.c_void_p
_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_P), ctypes.c_int],
    "cuCtxGetCurrent": [ctypes.POINTER(_P)],
    "cuCtxSetCurrent": [_P],
    "cuModuleLoadData": [ctypes.POINTER(_P), ctypes.c_char_p],
    "cuModuleLoadDataEx": [ctypes.POINTER(_P), ctypes.c_char_p, ctypes.c_uint, _P, _P],
    "cuModuleGetFunction": [ctypes.POINTER(_P), _P, ctypes.c_char_p],
    "cuFuncSetAttribute": [_P, ctypes.c_int, ctypes.c_int],
    "cuLaunchKernel": [_P, *[ctypes.c_uint] * 7, _P, _P, _P],
}


class CudaDriver:
    """The few driver calls the launcher makes; `check` turns a CUresult into a RuntimeError."""

    _loaded: "CudaDriver | None" = None

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, argtypes in _SIGNATURES.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int

    @classmethod
    def get(cls, kernel: str) -> "CudaDriver":
        if cls._loaded is None:
            for name in LIBRARY_NAMES:
                try:
                    lib = ctypes.CDLL(name)
                except OSError:
                    continue
                driver = cls(lib)
                driver.check(kernel, "cuInit", driver.lib.cuInit(0))
                cls._loaded = driver
                break
            else:
                raise RuntimeError(
                    f"kernel {kernel}: no CUDA driver ({' or '.join(LIBRARY_NAMES)} not found); "
                    "the GPU kernels need an NVIDIA driver"
                )
        return cls._loaded

    def error_name(self, result: int) -> str:
        name = ctypes.c_char_p()
        if self.lib.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {result}"

    def check(self, kernel: str, call: str, result: int, detail: str = "") -> None:
        if result != 0:
            raise RuntimeError(f"kernel {kernel}: {call} failed with {self.error_name(result)}{detail}")

    def attribute(self, kernel: str, attribute: int, device: int) -> int:
        value = ctypes.c_int()
        self.check(
            kernel,
            "cuDeviceGetAttribute",
            self.lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device),
        )
        return value.value

    def primary_context(self, kernel: str, ordinal: int) -> int:
        device, context = ctypes.c_int(), _P()
        self.check(kernel, "cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(device), ordinal))
        self.check(
            kernel,
            "cuDevicePrimaryCtxRetain",
            self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
        )
        return context.value

    def make_current(self, kernel: str, context: int) -> None:
        """`context` current on this thread, if none is (torch's runtime may not have set one yet)."""
        current = _P()
        self.check(kernel, "cuCtxGetCurrent", self.lib.cuCtxGetCurrent(ctypes.byref(current)))
        if current.value is None:
            self.check(kernel, "cuCtxSetCurrent", self.lib.cuCtxSetCurrent(context))
        elif current.value != context:
            raise RuntimeError(f"kernel {kernel}: another device's CUDA context is current on this thread")

    def load_module(self, kernel: str, image: mf.Image) -> int:
        module, data = _P(), image.path.read_bytes()
        if image.kind == "cubin":
            self.check(kernel, "cuModuleLoadData", self.lib.cuModuleLoadData(ctypes.byref(module), data))
            return module.value
        log = ctypes.create_string_buffer(8192)
        options = (ctypes.c_int * 2)(CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        values = (_P * 2)(ctypes.addressof(log), len(log))
        result = self.lib.cuModuleLoadDataEx(ctypes.byref(module), data + b"\0", 2, options, values)
        self.check(kernel, f"cuModuleLoadDataEx (PTX for sm_{image.arch})", result, f": {log.value.decode()}")
        return module.value


# -- the kernel ------------------------------------------------------------------------------------


@dataclass
class CubinKernel:
    """One manifest kernel loaded on one device."""

    name: str
    params: list[dict]
    block: int  # threads a block: 32 · num_warps
    shared: int  # dynamic shared memory bytes a block
    device: int
    image: mf.Image
    driver: CudaDriver
    context: int
    function: int

    @classmethod
    def load(cls, name: str, directory: Path | None = None, device: int | None = None) -> "CubinKernel":
        """`name` from the manifest in `directory` (the shipped cubins by default), for `device`
        (torch's current CUDA device by default; load and launch with that device current)."""
        manifest = mf.read_manifest(directory or mf.CUBIN_DIR)
        entry = manifest["kernels"].get(name)
        if entry is None:
            raise RuntimeError(
                f"kernel {name}: not built (the manifest has {', '.join(sorted(manifest['kernels']))})"
            )
        driver = CudaDriver.get(name)
        if device is None:
            import torch

            device = torch.cuda.current_device()
        context = driver.primary_context(name, device)
        major = driver.attribute(name, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
        minor = driver.attribute(name, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
        image = mf.select_image(name, entry, 10 * major + minor, directory or mf.CUBIN_DIR)
        driver.make_current(name, context)
        module = driver.load_module(name, image)
        function = _P()
        found = driver.lib.cuModuleGetFunction(ctypes.byref(function), module, entry["entry"].encode())
        driver.check(name, f"cuModuleGetFunction({entry['entry']})", found)
        block = 32 * entry["num_warps"]
        kernel = cls(
            name, entry["params"], block, image.shared, device, image, driver, context, function.value
        )
        kernel._opt_in_shared()
        return kernel

    def _opt_in_shared(self) -> None:
        if self.shared <= STATIC_SHARED_LIMIT:
            return
        limit = self.driver.attribute(
            self.name, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self.device
        )
        if self.shared > limit:
            raise RuntimeError(
                f"kernel {self.name}: needs {self.shared} bytes of shared memory; this GPU gives {limit}"
            )
        attribute = CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        set_limit = self.driver.lib.cuFuncSetAttribute(self.function, attribute, self.shared)
        self.driver.check(self.name, "cuFuncSetAttribute", set_limit)

    def __call__(self, grid, *args, stream=None) -> None:
        """Launch on `stream` (torch's current stream by default); returns at once. A range of
        torch's profiler while it records (`launch_ranges`: how a step's count sees the launch)."""
        import torch

        from engine.gpu.launch_ranges import launch_range

        current = torch.cuda.current_device()
        if current != self.device:
            raise RuntimeError(f"kernel {self.name}: loaded for cuda:{self.device}, called on cuda:{current}")
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.device != torch.device("cuda", self.device):
                raise RuntimeError(f"kernel {self.name}: a tensor on {arg.device}, not cuda:{self.device}")
        values = pack_args(self.name, self.params, args)
        if stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        with launch_range(self.name):
            self.launch(grid, values, getattr(stream, "cuda_stream", stream))

    def launch(self, grid, values: list, stream: int) -> None:
        """Launch with `pack_args`' values on the stream handle `stream`, unchecked (an empty grid
        launches nothing)."""
        gx, gy, gz = grid3(self.name, grid)
        if gx * gy * gz == 0:
            return
        self.driver.make_current(self.name, self.context)
        launched = self.driver.lib.cuLaunchKernel(
            self.function, gx, gy, gz, self.block, 1, 1, self.shared, stream, param_pointers(values), None
        )
        self.driver.check(self.name, "cuLaunchKernel", launched)
