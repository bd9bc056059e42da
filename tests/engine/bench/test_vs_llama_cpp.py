"""`python -m engine.bench --vs-llama-cpp FILE.gguf`: both engines on the very same file in one run."""

import json
import sys
import types
from typing import ClassVar

import pytest
from gguf import GGMLQuantizationType as QT

from engine.bench import llama_cpp, passes
from engine.bench import main as bench
from engine.tiny.gguf_writer import write_tiny_gguf


@pytest.mark.slow
def test_both_engines_run_the_same_file_side_by_side(tmp_path):
    pytest.importorskip("llama_cpp", reason="the optional extra 'llama' (llama-cpp-python) is not installed")
    path = write_tiny_gguf(tmp_path / "model", expert_type=QT.Q8_0, down_type=QT.Q8_0)
    out = tmp_path / "bench.json"
    argv = ["--vs-llama-cpp", str(path), "--device", "cpu", "--prompts", "1", "--new-tokens", "8"]
    assert bench.main([*argv, "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["engine"] for row in result["rows"]] == ["moe-chat", "llama.cpp"]
    assert result["model"]["path"] == str(path)  # MoE Chat ran the very same file
    vs = result["llama_cpp"]
    assert vs["decode_ratio"] > 0 and vs["prefill_ratio"] > 0 and vs["threads"] >= 1


def test_without_llama_cpp_the_error_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the extra were not installed
    path = write_tiny_gguf(tmp_path / "model", expert_type=QT.Q8_0, down_type=QT.Q8_0)
    argv = ["--vs-llama-cpp", str(path), "--device", "cpu", "--prompts", "1", "--new-tokens", "4"]
    assert bench.main([*argv, "--repeats", "1"]) == 2
    assert "pip install -e '.[llama]'" in capsys.readouterr().err


class _Recorded:
    """llama.cpp's runner as the bench drives it, its passes recorded in `calls`."""

    calls: ClassVar[list[str]] = []

    def __init__(self, path, threads, n_ctx=2048):
        self.path, self.threads = path, threads
        self.calls.append("llama.cpp loads")

    def timed_pass(self, prompts, new_tokens):
        self.calls.append("llama.cpp" if len(prompts[0]) > 8 else "llama.cpp warm-up")
        prefill = (200.0, 100.0, 300.0)[self.calls.count("llama.cpp") % 3]  # 100, 300, 200
        return {"tpot_ms": 2.0, "prefill_tps": prefill, "decode_tokens": len(prompts) * (new_tokens - 1)}

    def close(self):
        self.calls.append("llama.cpp closes")


@pytest.mark.parametrize("fits", [True, False])
def test_passes_alternate_where_memory_holds_both_engines(tmp_path, monkeypatch, fits):
    path = write_tiny_gguf(tmp_path / "model", expert_type=QT.Q8_0, down_type=QT.Q8_0)
    calls = _Recorded.calls = []
    engine_pass = passes.engine_pass

    def recorded_pass(model, prompt_ids, new_tokens, decoding=None):
        calls.append("moe-chat" if len(prompt_ids[0]) > 8 else "moe-chat warm-up")
        assert decoding is None or decoding.spec.mode == "none"  # plain decoding, as llama.cpp's
        return engine_pass(model, prompt_ids, new_tokens, decoding)

    monkeypatch.setattr(passes, "engine_pass", recorded_pass)
    monkeypatch.setattr(llama_cpp, "check_available", lambda *_: None)
    monkeypatch.setattr(llama_cpp, "fits_beside", lambda _path: fits)
    monkeypatch.setattr(llama_cpp, "LlamaCppRunner", _Recorded)
    out = tmp_path / "bench.json"
    argv = ["--vs-llama-cpp", str(path), "--device", "cpu", "--prompts", "1", "--new-tokens", "4"]
    assert bench.main([*argv, "--repeats", "3", "--json", str(out)]) == 0
    timed = [c for c in calls if c in ("moe-chat", "llama.cpp")]
    if fits:  # one engine's pass, then the other's: a drift of the host hits both alike
        assert timed == ["moe-chat", "llama.cpp"] * 3
    else:  # llama.cpp loads only once MoE Chat's model is closed
        assert timed == ["moe-chat"] * 3 + ["llama.cpp"] * 3
    result = json.loads(out.read_text())
    assert result["llama_cpp"]["alternated"] is fits
    assert result["llama_cpp"].get("pairs") == (3 if fits else None)  # pairs only where alternated
    assert result["llama_cpp"]["decode_ratio"] == pytest.approx(result["rows"][0]["tokens_per_s"] / 500.0)
    # the passes' median prefill rate, not the median tpot pass's (the second: 300)
    assert result["rows"][1]["prefill_tokens_per_s"] == 200.0


def test_paired_ratios_cancel_a_drift_between_pairs():
    """The host slowed down by 3x after the first pair: the medians of each engine's passes fall
    on either side of it, each pair's ratio does not."""
    ours = [{"tpot_ms": t, "prefill_tps": 300.0 / t} for t in (1.0, 1.0, 3.0)]
    theirs = [{"tpot_ms": t, "prefill_tps": 200.0 / t} for t in (1.1, 3.3, 3.3)]
    paired = llama_cpp.paired_ratios(ours, theirs)
    assert paired["paired_decode_ratio"] == pytest.approx(1.1)
    assert paired["paired_prefill_ratio"] == pytest.approx(1.5 * 1.1)
    assert paired["pairs"] == 3  # the passes' medians alone would have said 3.3 / 1.0


@pytest.mark.parametrize(
    ("probe", "says"),
    [
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "llama.cpp crashed (SIGSEGV) on"),
        ("raise SystemExit('ValueError: Failed to load model from file')", "Failed to load model"),
    ],
)
def test_a_llama_cpp_that_crashes_or_fails_on_the_file_is_a_clear_error_before_any_pass(
    tmp_path, monkeypatch, capsys, probe, says
):
    """llama.cpp first runs the file in a child process: a crash there (its AMX kernels segfault on
    some hosts) is an error that says so, not a bare segmentation fault of the whole bench."""
    pytest.importorskip("llama_cpp", reason="the optional extra 'llama' (llama-cpp-python) is not installed")
    monkeypatch.setattr(llama_cpp, "_PROBE", probe)
    monkeypatch.setattr(llama_cpp, "_cpu_has_amx", lambda: True)
    monkeypatch.setattr(passes, "engine_pass", lambda *a: pytest.fail("no pass may start"))
    path = write_tiny_gguf(tmp_path / "model", expert_type=QT.Q8_0, down_type=QT.Q8_0)
    argv = ["--vs-llama-cpp", str(path), "--device", "cpu", "--prompts", "1", "--new-tokens", "4"]
    assert bench.main([*argv, "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert says in err and str(path) in err and "-DGGML_AMX_INT8=OFF" in err


def test_a_llama_cpp_that_hangs_on_the_file_times_out(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="the optional extra 'llama' (llama-cpp-python) is not installed")
    monkeypatch.setattr(llama_cpp, "_PROBE", "import time; time.sleep(60)")
    monkeypatch.setattr(llama_cpp, "PROBE_TIMEOUT_S", 1)
    with pytest.raises(llama_cpp.LlamaCppUnavailable, match="did not generate 2 tokens"):
        llama_cpp.check_available(tmp_path / "model.gguf")


def test_llama_cpp_prefills_on_the_same_threads_as_it_decodes(monkeypatch, tmp_path):
    """llama-cpp-python's batch threads default to every CPU: a one-thread comparison would give
    llama.cpp's prompts all of them."""
    made = {}
    fake = types.ModuleType("llama_cpp")
    fake.Llama = lambda **options: made.update(options)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    llama_cpp.LlamaCppRunner(tmp_path / "model.gguf", threads=1)
    assert made["n_threads"] == made["n_threads_batch"] == 1
    assert "n_threads_batch=n" in llama_cpp._PROBE  # the crash probe's child too
