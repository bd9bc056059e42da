"""`python -m engine.bench --vs-llama-cpp FILE.gguf`: both engines on the very same file in one run."""

import json
import sys

import pytest
from gguf import GGMLQuantizationType as QT

from engine.bench import main as bench
from engine.model.tiny_gguf import write_tiny_gguf


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
