"""engine.ggml.library: which ggml it loads (llama-cpp-python's where installed, else the prebuilt
libggml-python wheel's), and a CPU the prebuilt build cannot run on told apart before anything
is loaded — a reason, not an illegal instruction."""

from __future__ import annotations

import sys
import types

import pytest

from engine.ggml import library

pytest.importorskip("libggml", reason="the libggml-python wheel is not installed on this platform")


@pytest.fixture
def fresh(monkeypatch):
    """`library()` computed again in the test (it is cached for the process)."""
    library.library.cache_clear()
    monkeypatch.setattr(library, "_SOURCE", [])
    yield
    library.library.cache_clear()


def test_without_llama_cpp_the_prebuilt_wheel_is_loaded(fresh, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    ggml, reason = library.library()
    assert ggml is not None and reason == "" and library.source() == "libggml-python"
    assert ggml.row_size(12, 256) == 144  # a Q4_K row of 256: one 144-byte block


def test_an_installed_llama_cpp_python_is_preferred(fresh, monkeypatch, tmp_path):
    fake = types.ModuleType("llama_cpp")
    fake.__file__ = str(tmp_path / "llama_cpp" / "__init__.py")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert library._lib_dir() == ("llama-cpp-python", tmp_path / "llama_cpp" / "lib")
    ggml, reason = library.library()  # that folder holds no library: a reason, not a crash
    assert ggml is None and reason.startswith("llama-cpp-python's ggml libraries in")


def test_a_cpu_without_avx2_keeps_the_exact_kernels(fresh, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setattr(library, "missing_cpu_features", lambda: ["AVX2", "FMA3"])
    assert library.available() == (
        False,
        "this CPU lacks AVX2, FMA3, which the prebuilt ggml (libggml-python) needs",
    )
    assert library.source() is None


def test_this_cpu_is_checked_for_what_the_prebuilt_build_needs(monkeypatch):
    monkeypatch.setattr(library.platform, "machine", lambda: "arm64")
    assert library.missing_cpu_features() == []  # Apple silicon's wheel: nothing to check
    monkeypatch.setattr(library.platform, "machine", lambda: "x86_64")
    assert set(library.missing_cpu_features()) <= set(library.PREBUILT_NEEDS)
