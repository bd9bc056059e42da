"""A whole auto-tune run on the demo model: the CLI's JSON, reuse of a stored result, re-tuning."""

import json

import pytest

import engine.tune.run as tune_run
from engine.cli import main
from engine.config import ExpertBudget, OffloadConfig
from engine.loader import load_model
from engine.resources import demo_draft_dir, demo_model_dir
from engine.tune.run import TuneConfig, tune
from engine.tune.store import TuneStore

pytestmark = pytest.mark.slow

# a simulated 1 GB/s link: copies still cost (the tune has something to weigh), and the ~40 s a tune
# spent sleeping on a 0.1 GB/s one go to other tests
SLOW = OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=24), sim_link_gbps=1.0)
SLOW_SMALL = OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=12), sim_link_gbps=1.0)
QUICK = TuneConfig(draft_model=str(demo_draft_dir()), new_tokens=8)


@pytest.fixture
def store(tmp_path):
    return TuneStore(tmp_path / "tune.json")


def test_the_cli_prints_probe_profile_prediction_measured_and_choice(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path))
    argv = ["tune", "--device", "cpu", "--expert-budget", "24", "--sim-link", "1", "--new-tokens", "8"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"probe", "profile", "prediction", "measured", "choice"} <= set(report)
    assert report["probe"]["simulated_link"] and report["probe"]["h2d_gbps"] == 1.0
    assert len(report["profile"]["verify_ms"]) == 16
    points = report["measured"]
    fields = {"cutoff_layer", "draft_len", "tpot_ms", "drafter", "tpot_low_ms", "tpot_high_ms", "runs"}
    assert points and all(fields == set(p) for p in points)
    assert all(p["tpot_low_ms"] <= p["tpot_ms"] <= p["tpot_high_ms"] and p["runs"] >= 2 for p in points)
    assert {p["drafter"] for p in points if p["draft_len"]} == {"draft", "self"}, "the demo's draft and self"
    best = min(points, key=lambda p: p["tpot_ms"])
    choice = report["choice"]
    chosen = (choice["cutoff_layer"], choice["draft_len"], choice["drafter"])
    assert chosen == (best["cutoff_layer"], best["draft_len"], best["drafter"])
    assert choice["certainty"].startswith(("Sure", "Close call"))
    assert choice["cache_experts"] == 24
    assert choice["expected_tokens_per_s"] == pytest.approx(1000 / best["tpot_ms"])
    assert report["reused"] is False


def test_a_stored_result_is_reused_without_profiling_and_a_new_budget_tunes_again(store, monkeypatch):
    model = load_model(demo_model_dir(), SLOW)
    try:
        first = tune(model, QUICK, store=store)
        assert not first.reused

        def no_profiling(*args, **kwargs):
            raise AssertionError("a stored result should have been reused")

        monkeypatch.setattr(tune_run, "profile_model", no_profiling)
        again = tune(model, QUICK, store=store)
        assert again.reused and again.choice == first.choice and again.key == first.key
        with pytest.raises(AssertionError, match="reused"):
            tune(model, TuneConfig(draft_model=QUICK.draft_model, new_tokens=8, retune=True), store=store)
    finally:
        model.close()
    smaller = load_model(demo_model_dir(), SLOW_SMALL)
    try:
        with pytest.raises(AssertionError, match="reused"):  # another budget: another key, so it profiles
            tune(smaller, QUICK, store=store)
    finally:
        smaller.close()


def test_a_choice_config_is_what_the_app_applies_and_fixed_holds_the_draft_length():
    from engine.prompts import greedy
    from engine.tune.run import choice_config

    base = greedy(16)
    applied = choice_config(base, 2, 4, "/draft")
    assert applied.spec.mode == "draft" and applied.spec.draft_len == 4 and applied.spec.adapt_draft_len
    assert (applied.prefetch, applied.cutoff) == ("spmoe", 2)
    fixed = choice_config(base, 2, 4, "/draft", adapt_draft_len=False)
    assert not fixed.spec.adapt_draft_len and fixed.spec.draft_len == 4 and fixed.cutoff == 2
    no_prefetch = choice_config(base, -1, 4, None)
    assert no_prefetch.spec.mode == "self" and (no_prefetch.prefetch, no_prefetch.cutoff) == ("none", None)
    assert choice_config(base, -1, 0, "/draft") == base == choice_config(base, -1, 0, None, False)
