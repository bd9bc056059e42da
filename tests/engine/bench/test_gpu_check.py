"""engine.bench.gpu: the prepared GPU check writes its JSON after every stage, whatever a stage does."""

from __future__ import annotations

import json
import sys

from engine.bench import gpu


def test_every_stage_is_recorded_even_when_one_fails_or_the_budget_runs_out(tmp_path, monkeypatch):
    seen = []

    def fails(out, limit):
        seen.append(("environment", limit))
        raise RuntimeError("no CUDA device")

    def slow(out, limit):
        seen.append(("kernels", limit))
        return {"ok": True}

    monkeypatch.setattr(gpu, "environment", fails)
    monkeypatch.setattr(gpu, "kernels", slow)
    monkeypatch.setattr(gpu, "gpu_tests", lambda out, limit: {"summary": "3 passed"})
    monkeypatch.setattr(gpu, "graph_stage", lambda out, limit: {"families": {}})
    monkeypatch.setattr(gpu, "shapes", lambda out, limit, depths, h2d, on_row: {"depths": depths})
    assert gpu.main([str(tmp_path), "--budget-s", "100", "--layers", "2"]) == 0
    stages = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
    assert stages["environment"]["error"] == "RuntimeError: no CUDA device"
    assert stages["kernels"]["ok"] and stages["pytest"]["summary"] == "3 passed"
    assert stages["graphs"]["families"] == {} and stages["shapes"]["depths"] == [2]
    assert all(limit <= 100 for _, limit in seen)


def test_a_stage_past_the_budget_is_skipped_and_said_so(tmp_path, monkeypatch):
    for name in ("environment", "kernels", "gpu_tests", "graph_stage"):
        monkeypatch.setattr(gpu, name, lambda out, limit: {})
    monkeypatch.setattr(gpu, "shapes", lambda out, limit, depths, h2d, on_row: {})
    gpu.main([str(tmp_path), "--budget-s", "1"])
    stages = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
    assert stages["shapes"] == {"skipped": "the check's time budget ran out"}


def test_a_child_that_runs_too_long_is_stopped_with_its_output_kept(tmp_path):
    code = "import sys, time; print('started', flush=True); time.sleep(30)"
    done = gpu._child([sys.executable, "-c", code], tmp_path / "child.log", 6)
    assert done["rc"] is None and "timed out" in done["error"]


def test_without_a_gpu_the_environment_says_so(tmp_path):
    found = gpu.environment(tmp_path, 30)
    assert found["torch"] and ("error" in found or found.get("device"))


def test_without_a_gpu_the_kernels_stage_says_so(tmp_path):
    """The stage reaches engine.gpu.checks (an import error would read "skipped")."""
    assert gpu.kernels(tmp_path, 30) == {"error": "no CUDA device"}


def test_the_shape_rows_go_headline_first_each_written_with_its_link_floor(tmp_path, monkeypatch):
    """Rows in `ROWS`' order (the resident and 8 GiB 48-layer rows before the variants), each one
    reported as it finishes, its TPOT beside the link's floor at the measured copy rate."""
    benched, reported = [], []
    monkeypatch.setattr(
        gpu, "_shape_file", lambda out, layers, deadline, results: tmp_path / f"{layers}.gguf"
    )

    def bench(path, out, tag, options, limit):
        benched.append(tag)
        return {"tpot_ms": 20.0, "bytes_per_token": 5e8 if "GiB" in tag else 0}

    monkeypatch.setattr(gpu, "_bench", bench)
    rows = gpu.shapes(tmp_path, 100, [48], h2d_gbps=50.0, on_row=lambda rows: reported.append(list(rows)))
    assert benched[:3] == ["48-resident", "48-8 GiB", "48-8 GiB, self-speculation"]
    assert all(not tag.startswith("16") for tag in benched)
    assert reported[0] == ["48 layers, resident"] and reported[-1] == list(rows)
    eight = rows["48 layers, 8 GiB"]
    floor_ms = 1e3 * 5e8 / 50e9  # the row's bytes a token at the copy rate
    assert eight["link_floor_ms"] == floor_ms and eight["tpot_over_floor"] == 20.0 / floor_ms
    assert "link_floor_ms" not in rows["48 layers, resident"]  # nothing moved
