"""ggml's shared libraries: the prebuilt `libggml-python` wheel (a dependency), or llama-cpp-python's.

Contract: `library()` is (`Ggml`, "") — the few ggml functions the engine calls, with their C
signatures, loaded once — or (None, why not) where no ggml library can be used here;
`available()` says the same as (bool, why not), `loaded()` is the `Ggml` or that reason raised,
`installed()` whether they are here without loading them, and `source()` names those loaded.
ggml's warnings and errors go to this module's logger, its debug and info lines nowhere.

Which libraries: llama-cpp-python's where it is installed (the bench's llama.cpp peer runs in
the same process, and llama.cpp's own libraries ask for ggml by soname: one ggml in the process,
the one llama.cpp was built with), else the `libggml-python` wheel's (prebuilt for Linux x86-64,
Windows x86-64 and macOS arm64; its x86-64 build needs AVX2, FMA, F16C and BMI2). A CPU without
what the prebuilt build needs is told apart before anything is loaded: the engine then keeps the
exact kernels (the reason says why) rather than die on an illegal instruction.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path

_P = ctypes.c_void_p
log = logging.getLogger(__name__)


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _P), ("no_alloc", ctypes.c_bool)]


class Ggml:
    """The few ggml functions this module calls, with their C signatures."""

    def __init__(self, lib_dir: Path):
        base, cpu = _load(lib_dir, "ggml-base"), _load(lib_dir, "ggml-cpu")
        i64, size = ctypes.c_int64, ctypes.c_size_t
        self.init = _function(base, "ggml_init", _P, InitParams)
        self.free = _function(base, "ggml_free", None, _P)
        self.reset = _function(base, "ggml_reset", None, _P)
        self.new_tensor_2d = _function(base, "ggml_new_tensor_2d", _P, _P, ctypes.c_int, i64, i64)
        self.new_tensor_3d = _function(base, "ggml_new_tensor_3d", _P, _P, ctypes.c_int, i64, i64, i64)
        self.view_3d = _function(base, "ggml_view_3d", _P, _P, _P, i64, i64, i64, size, size, size)
        self.view_init = _function(base, "ggml_backend_view_init", ctypes.c_int, _P)
        self.mul_mat = _function(base, "ggml_mul_mat", _P, _P, _P, _P)
        self.mul_mat_id = _function(base, "ggml_mul_mat_id", _P, _P, _P, _P, _P)
        self.swiglu = _function(base, "ggml_swiglu", _P, _P, _P)
        # a standard layer's norms and rotation (engine.decode.layer_graph)
        self.rms_norm = _function(base, "ggml_rms_norm", _P, _P, _P, ctypes.c_float)
        self.mul = _function(base, "ggml_mul", _P, _P, _P, _P)
        self.add = _function(base, "ggml_add", _P, _P, _P, _P)
        self.neg = _function(base, "ggml_neg", _P, _P, _P)
        self.concat = _function(base, "ggml_concat", _P, _P, _P, _P, ctypes.c_int)
        self.new_tensor_1d = _function(base, "ggml_new_tensor_1d", _P, _P, ctypes.c_int, i64)
        self.reshape_3d = _function(base, "ggml_reshape_3d", _P, _P, _P, i64, i64, i64)
        # a MoE layer's routing (engine.decode.moe_graph)
        self.reshape_2d = _function(base, "ggml_reshape_2d", _P, _P, _P, i64, i64)
        self.view_2d = _function(base, "ggml_view_2d", _P, _P, _P, i64, i64, size, size)
        self.soft_max = _function(base, "ggml_soft_max", _P, _P, _P)
        self.argsort_top_k = _function(base, "ggml_argsort_top_k", _P, _P, _P, ctypes.c_int)
        self.get_rows = _function(base, "ggml_get_rows", _P, _P, _P, _P)
        self.sum_rows = _function(base, "ggml_sum_rows", _P, _P, _P)
        self.div = _function(base, "ggml_div", _P, _P, _P, _P)
        self.cont = _function(base, "ggml_cont", _P, _P, _P)
        # a layer's attention over its KV cache (engine.decode.layer_graph)
        self.set_rows = _function(base, "ggml_set_rows", _P, _P, _P, _P, _P)
        self.permute = _function(base, "ggml_permute", _P, _P, _P, *[ctypes.c_int] * 4)
        floats = [ctypes.c_float] * 3  # scale, ALiBi's max bias, logit soft-cap
        self.flash_attn_ext = _function(base, "ggml_flash_attn_ext", _P, _P, _P, _P, _P, _P, *floats)
        self.cpu_buffer_type = _function(cpu, "ggml_backend_cpu_buffer_type", _P)
        self.gallocr_new = _function(base, "ggml_gallocr_new", _P, _P)
        self.gallocr_alloc_graph = _function(base, "ggml_gallocr_alloc_graph", ctypes.c_bool, _P, _P)
        self.gallocr_free = _function(base, "ggml_gallocr_free", None, _P)
        self.new_graph_custom = _function(base, "ggml_new_graph_custom", _P, _P, size, ctypes.c_bool)
        self.build_forward_expand = _function(base, "ggml_build_forward_expand", None, _P, _P)
        self.tensor_overhead = _function(base, "ggml_tensor_overhead", size)
        self.graph_overhead_custom = _function(base, "ggml_graph_overhead_custom", size, size, ctypes.c_bool)
        self.row_size = _function(base, "ggml_row_size", size, ctypes.c_int, i64)
        self.tensor_alloc = _function(base, "ggml_backend_tensor_alloc", ctypes.c_int, _P, _P, _P)
        self.buffer_free = _function(base, "ggml_backend_buffer_free", None, _P)
        self.graph_compute = _function(base, "ggml_backend_graph_compute", ctypes.c_int, _P, _P)
        self.cpu_init = _function(cpu, "ggml_backend_cpu_init", _P)
        self.cpu_set_n_threads = _function(cpu, "ggml_backend_cpu_set_n_threads", None, _P, ctypes.c_int)
        self.cpu_buffer_from_ptr = _function(cpu, "ggml_backend_cpu_buffer_from_ptr", _P, _P, size)
        # llama.cpp's extra CPU buffer types (engine.ggml.interleave)
        self.cpu_reg = _function(cpu, "ggml_backend_cpu_reg", _P)
        self.reg_dev_get = _function(base, "ggml_backend_reg_dev_get", _P, _P, size)
        self.reg_proc_address = _function(base, "ggml_backend_reg_get_proc_address", _P, _P, ctypes.c_char_p)
        self.buft_name = _function(base, "ggml_backend_buft_name", ctypes.c_char_p, _P)
        self.buft_alloc_buffer = _function(base, "ggml_backend_buft_alloc_buffer", _P, _P, size)
        self.buffer_base = _function(base, "ggml_backend_buffer_get_base", _P, _P)
        self.tensor_set = _function(base, "ggml_backend_tensor_set", None, _P, _P, size, size)
        _function(base, "ggml_log_set", None, _LogCallback, _P)(_log_to_logging, None)


def _load(lib_dir: Path, stem: str) -> ctypes.CDLL:
    """The library `stem` in `lib_dir` by this platform's name for it (`libggml-base.so.0`,
    `libggml-base.dylib`, `ggml-base.dll`). On Linux its soname (`.so.0`) where the wheel has
    that file: the name llama.cpp's own libraries ask for, so the process holds one ggml (one
    log, one CPU backend), not a copy that a file of another name would load beside it."""
    names = {"win32": [f"{stem}.dll"], "darwin": [f"lib{stem}.dylib"]}.get(
        sys.platform, [f"lib{stem}.so.0", f"lib{stem}.so"]
    )
    path = next((lib_dir / n for n in names if (lib_dir / n).exists()), lib_dir / names[-1])
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


_LogCallback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_LOG_LEVELS = {3: logging.WARNING, 4: logging.ERROR}  # ggml.h: 1 debug, 2 info, 3 warn, 4 error


@_LogCallback
def _log_to_logging(level: int, text: bytes | None, _user_data) -> None:
    """ggml's warnings and errors into the engine's log; its debug and info lines (one per
    interleaved weight, engine.ggml.interleave) nowhere, instead of on stderr."""
    if level in _LOG_LEVELS and text:
        log.log(_LOG_LEVELS[level], "ggml: %s", text.decode(errors="replace").rstrip())


def _function(lib, name: str, restype, *argtypes):
    function = getattr(lib, name)
    function.restype, function.argtypes = restype, list(argtypes)
    return function


@functools.cache
def library() -> tuple[Ggml | None, str]:
    found = _lib_dir()
    if isinstance(found, str):
        return None, found
    name, lib_dir = found
    if sys.platform == "win32":  # ggml-cpu.dll finds ggml-base.dll in its folder (kept while in use)
        _SOURCE_DIRS.append(os.add_dll_directory(str(lib_dir)))
    try:
        ggml = Ggml(lib_dir)
    except (OSError, AttributeError) as err:
        return None, f"{name}'s ggml libraries in {lib_dir} cannot be used ({err})"
    log.info("ggml's kernels: %s (%s)", name, lib_dir)
    _SOURCE.append(name)
    return ggml, ""


_SOURCE: list[str] = []
_SOURCE_DIRS: list = []  # Windows: the DLL folders added to the search path
# what libggml-python's x86-64 build was compiled for (numpy's names for the features)
PREBUILT_NEEDS = ("AVX2", "FMA3", "F16C", "BMI2")


def _lib_dir() -> tuple[str, Path] | str:
    """(whose, the folder) of the ggml libraries to load, or why there are none: found without
    importing either package (llama_cpp's import loads llama.cpp itself)."""
    llama_cpp = _package_dir("llama_cpp")
    if llama_cpp is not None:
        return "llama-cpp-python", llama_cpp / "lib"
    root = _package_dir("libggml")
    if root is None:
        return "ggml's kernels come with the libggml-python package, which is not installed"
    missing = missing_cpu_features()
    if missing:
        return f"this CPU lacks {', '.join(missing)}, which the prebuilt ggml (libggml-python) needs"
    folders = [root / "lib64", root / "lib", root / "bin"]
    return "libggml-python", next((f for f in folders if f.is_dir()), root / "lib")


def _package_dir(name: str) -> Path | None:
    """The folder of the installed package `name`, or None (also where it is blocked in
    `sys.modules`, as a test does)."""
    module = sys.modules.get(name, False)
    if module is None:
        return None
    if module is not False:
        return Path(module.__file__).parent
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def installed() -> tuple[bool, str]:
    """Whether ggml's libraries are here for this CPU, and why not, without loading them (what
    the settings may offer)."""
    found = _lib_dir()
    return (False, found) if isinstance(found, str) else (True, "")


def missing_cpu_features() -> list[str]:
    """What libggml-python's build needs that this CPU lacks (x86-64 only: its arm64 build is for
    Apple's CPUs, which all have what it uses), as numpy's CPU dispatch detected it at run time."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # numpy 1
        from numpy.core._multiarray_umath import __cpu_features__
    return [feature for feature in PREBUILT_NEEDS if not __cpu_features__.get(feature, False)]


def source() -> str | None:
    """Whose ggml libraries are loaded ("libggml-python", "llama-cpp-python"), or None."""
    return _SOURCE[0] if _SOURCE else None


def available() -> tuple[bool, str]:
    """Whether ggml's kernels can run here, and why not."""
    ggml, reason = library()
    return ggml is not None, reason


def loaded() -> Ggml:
    """ggml's functions, or a RuntimeError saying why they cannot be loaded here."""
    ggml, reason = library()
    if ggml is None:
        raise RuntimeError(reason)
    return ggml
