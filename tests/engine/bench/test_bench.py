"""`python -m engine.bench`: the table, the JSON and the side-by-side comparison (not timings)."""

import itertools
import json

import pytest
import torch

from engine.bench import main as bench
from engine.prompts import lengthened
from engine.tiny.models import make_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), model_type="mixtral", seed=4)


def test_budget_sweep_with_transformers_side_by_side(folder, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--model", str(folder), "--expert-budget", "4,all", "--new-tokens", "6", "--repeats", "1"]
    code = bench.main(
        [*argv, "--prompts", "2", "--sim-link-gbps", "20", "--compare-transformers", "--json", str(out)]
    )
    assert code == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    # One row per budget, then the side-by-side pair (interleaved passes) for the largest cache.
    assert [r["engine"] for r in rows] == ["moe-chat", "moe-chat", "moe-chat", "transformers"]
    small, full, side_by_side, reference = rows
    # every expert cached: decode misses only an expert's first use (a prompt runs the last
    # layer's experts on its last token only, so a few of that layer's are first used in decode)
    assert side_by_side["budget"] == full["budget"] and side_by_side["hit_rate"] >= 0.9
    assert small["cache_slots"] == 4 and full["cache_slots"] == 16
    assert small["simulated_link"] is True and full["simulated_link"] is True
    assert full["hit_rate"] >= 0.9 and full["bytes_per_token"] < small["bytes_per_token"]
    assert small["hit_rate"] < full["hit_rate"] and small["bytes_per_token"] > 0
    assert 0.0 <= small["copy_hidden"] <= 1.0  # the share of copying compute did not wait for
    assert small["decode_tokens"] == 2 * 5
    assert result["compared_budget"] == "all experts"
    assert result["speed_vs_transformers"] == pytest.approx(
        side_by_side["tokens_per_s"] / reference["tokens_per_s"]
    )
    table = capsys.readouterr().out
    assert "tpot_ms" in table and "hidden" in table and "simulated" in table
    assert "of transformers' generate" in table


def test_bad_budget_is_an_error_not_a_crash(folder, capsys):
    assert bench.main(["--model", str(folder), "--expert-budget", "lots", "--repeats", "1"]) == 2
    assert "expert budget" in capsys.readouterr().err


def test_compare_runs_every_configuration_side_by_side_on_a_calibrated_link(folder, tmp_path, capsys):
    out = tmp_path / "compare.json"
    argv = ["--model", str(folder), "--compare", "--sim-link", "calibrated", "--new-tokens", "6"]
    argv += ["--repeats", "1", "--prompts", "1", "--draft-model", str(folder), "--json", str(out)]
    assert (
        bench.main([*argv, "--configs", "next-layer", "hybrimoe", "draft+spmoe", "self", "substitute"]) == 0
    )
    result = json.loads(out.read_text())
    assert result["simulated_link"] is True
    assert result["calibration"]["copy_over_layer"] == 3.0 and result["calibration"]["link_gbps"] > 0
    assert result["expert_budget"] == "4 experts"  # a quarter of the tiny model's 16
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["on-demand LRU", "next-layer", "hybrimoe", "draft+spmoe", "self", "substitute"]
    for row in rows.values():
        for key in ("name", "spec", "prefetch", "tpot_ms", "tokens_per_s", "hit_rate", "accept_len"):
            assert key in row
        assert row["h2d_bytes_per_token"] is not None and row["tpot_ms"] > 0
        assert 0.0 <= row["copy_hidden"] <= 1.0  # every configuration copies on this quarter cache
        assert row["same_tokens_as_baseline"] is True  # greedy speculation is lossless
    assert rows["on-demand LRU"]["accept_len"] is None and rows["on-demand LRU"]["prefetch_precision"] is None
    draft = rows["draft+spmoe"]  # the target as its own draft: every draft token is accepted
    assert draft["accept_len"] == draft["draft_len"] + 1
    assert rows["draft+spmoe"]["prefetch"].startswith("spmoe")
    assert rows["hybrimoe"]["policy"] == "mrs"
    table = capsys.readouterr().out
    assert "SIMULATED" in table and "calibrated link" in table and "hidden" in table


def test_a_plain_run_on_the_calibrated_link_simulates_it(folder, tmp_path):
    """`--sim-link calibrated` means the same without --compare: a link calibrated to this host."""
    out = tmp_path / "calibrated.json"
    argv = ["--model", str(folder), "--expert-budget", "4", "--new-tokens", "4", "--repeats", "1"]
    assert bench.main([*argv, "--prompts", "1", "--sim-link", "calibrated", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["calibration"]["link_gbps"] > 0 and result["rows"][0]["simulated_link"] is True


@pytest.mark.parametrize("spec", [None, "self"])
def test_the_rows_decode_as_spec_and_cpu_experts_say(folder, tmp_path, monkeypatch, spec):
    """Plain decoding by default; `--spec` and `--cpu-experts` are what the rows run (the prepared
    GPU check's speculative and CPU-miss rows ask for them)."""
    from engine import generation

    asked, generate_text = [], generation.generate_text

    def recorded(model, ids, config, *rest, **options):
        asked.append((config.spec.mode, config.cpu_experts, config.max_new_tokens))
        return generate_text(model, ids, config, *rest, **options)

    monkeypatch.setattr(generation, "generate_text", recorded)
    out = tmp_path / "decoding.json"
    argv = ["--model", str(folder), "--expert-budget", "4", "--new-tokens", "5", "--repeats", "1"]
    argv += ["--prompts", "1", "--cpu-experts", "always", "--json", str(out)]
    assert bench.main([*argv, *(["--spec", spec] if spec else [])]) == 0
    assert set(asked) == {(spec or "none", "always", 4), (spec or "none", "always", 5)}  # warm-up, pass
    assert json.loads(out.read_text())["decoding"]["spec"] == (spec or "none")


def test_prompt_tokens_lengthens_every_prompt_to_a_long_context(folder, tmp_path):
    out = tmp_path / "long.json"
    argv = ["--model", str(folder), "--expert-budget", "all", "--new-tokens", "4", "--repeats", "1"]
    assert bench.main([*argv, "--prompts", "2", "--prompt-tokens", "300", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompt_tokens"] == [300, 300]
    assert lengthened([1, 2, 3], 8) == [1, 2, 3, 1, 2, 1, 2, 3] and lengthened([1, 2, 3], 2) == [1, 2, 3]


def test_multi_turn_prefills_less_with_reuse_and_gives_the_same_replies(tmp_path, capsys):
    out = tmp_path / "turns.json"
    argv = ["--multi-turn", "--device", "cpu", "--new-tokens", "12", "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0  # the demo model; 1 would mean a reply differed
    turns = json.loads(out.read_text())
    assert [t["turn"] for t in turns] == [1, 2, 3, 4] and all(t["same_reply"] for t in turns)
    assert turns[0]["cached_tokens"] == 0
    for before, turn in itertools.pairwise(turns):  # the last turn's prompt is held, at least
        assert turn["cached_tokens"] >= before["prompt_tokens"]
    assert "not prefilled again" in capsys.readouterr().out


def test_count_ops_reports_operators_and_one_host_sync_per_moe_layer_and_token(folder, tmp_path, capsys):
    """`--count-ops`: a decode token reads the routes once per MoE layer and the sampled token once."""
    out = tmp_path / "ops.json"
    argv = ["--model", str(folder), "--expert-budget", "all", "--new-tokens", "6", "--repeats", "1"]
    assert bench.main([*argv, "--prompts", "1", "--count-ops", "--expert-graphs", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    counts = result["op_counts"]
    moe_layers = 2  # the tiny mixtral's
    assert counts["host_syncs"] == moe_layers + 1
    assert counts["ops"] > 20 * moe_layers and counts["cuda_launches"] is None
    # the CPU uses its experts in place: no slot tables, so no graph is captured, and none fails
    assert result["expert_graphs"] == {"captures": 0, "off_because": None}
    printed = capsys.readouterr().out
    assert "per decode token:" in printed and "expert CUDA graphs: 0 captures" in printed
    assert "tolist" not in torch.Tensor.__dict__  # the counting wrapper is gone afterwards


def test_emulating_cuda_needs_the_interpreter_and_the_cpu(monkeypatch, capsys):
    from engine.bench.main import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--emulate-cuda", "--count-ops"])
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--device", "cuda", "--emulate-cuda"])
    assert "--emulate-cuda runs on --device cpu" in capsys.readouterr().err
