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
    assert points and all(fields | {"prefetch", "policy", "cpu_experts"} == set(p) for p in points)
    assert all(p["tpot_low_ms"] <= p["tpot_ms"] <= p["tpot_high_ms"] and p["runs"] >= 2 for p in points)
    # the demo's bundled draft, found from the model as `generate` finds it, and the model itself
    drafters = {p["drafter"] for p in points if p["draft_len"]}
    assert drafters == {"draft", "self", "substitute"}
    assert {d["name"] for d in report["profile"]["drafters"]} == drafters
    for drafter in drafters:  # each drafter's predicted curve, and cutoffs around its own best
        assert {p["drafter"] for p in report["prediction"]["curve"]} >= {drafter}
        assert len({p["cutoff_layer"] for p in points if p["drafter"] == drafter}) >= 3
    # the leader under the other prefetch and cache policies
    assert {p["prefetch"] for p in points} >= {"next-layer"} and {p["policy"] for p in points} >= {
        "lfu",
        "mrs",
    }
    best = min(points, key=lambda p: p["tpot_ms"])
    choice = report["choice"]
    keys = ("cutoff_layer", "draft_len", "drafter", "prefetch", "policy", "cpu_experts")
    assert [choice[k] for k in keys] == [best[k] for k in keys]
    assert choice["certainty"].startswith(("Sure", "Close call")) and " won at " in choice["why"]
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
    from engine.tune.search import Setting

    base = greedy(16)
    applied = choice_config(base, Setting(2, 4, "draft"), "/draft")
    assert applied.spec.mode == "draft" and applied.spec.draft_len == 4 and applied.spec.adapt_draft_len
    assert applied.spec.draft_model == "/draft" and (applied.prefetch, applied.cutoff) == ("spmoe", 2)
    fixed = choice_config(base, Setting(2, 4, "draft"), "/draft", adapt_draft_len=False)
    assert not fixed.spec.adapt_draft_len and fixed.spec.draft_len == 4 and fixed.cutoff == 2
    no_prefetch = choice_config(base, Setting(-1, 4), None)  # a choice that named no drafter
    assert no_prefetch.spec.mode == "self" and (no_prefetch.prefetch, no_prefetch.cutoff) == ("none", None)
    mtp = choice_config(base, Setting(3, 2, "mtp"), "/draft")
    assert (mtp.spec.mode, mtp.spec.draft_model) == ("mtp", None)
    hybrid = choice_config(base, Setting(-1, 3, "substitute", "next-layer", "mrs", "auto"), None)
    assert (hybrid.spec.mode, hybrid.prefetch, hybrid.cutoff, hybrid.cpu_experts) == (
        "substitute",
        "next-layer",
        None,
        "auto",
    )
    assert (
        choice_config(base, Setting(-1, 0), "/draft")
        == base
        == choice_config(base, Setting(-1, 0), None, False)
    )


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe"])
def test_a_model_without_a_draft_model_tunes_its_own_drafters(model_type, tmp_path, store):
    """A tiny qwen3_moe and a tiny qwen3_5_moe carrying MTP weights, on a simulated link: the model
    drafting with fewer experts (self), with substitutes and, where it has the layer, with MTP, each
    measured at three or more cutoffs around its own predicted best; the choice is the fastest."""
    from tests.engine.speculative.mtp_checkpoints import save_with_mtp

    folder = save_with_mtp(model_type, tmp_path / model_type)
    model = load_model(
        folder,
        OffloadConfig(
            device="cpu", dtype="float32", expert_budget=ExpertBudget(experts=8), sim_link_gbps=1.0
        ),
    )
    try:
        result = tune(model, TuneConfig(new_tokens=8), store=store)
    finally:
        model.close()
    measured = {p.drafter for p in result.measured if p.draft_len}
    assert measured >= {"self"} | ({"mtp"} if model_type == "qwen3_5_moe" else set())
    assert "draft" not in measured
    for drafter in measured:
        assert len({p.cutoff_layer for p in result.measured if p.drafter == drafter}) >= 3
    plain = next(p for p in result.measured if (p.draft_len, p.prefetch, p.policy) == (0, "", ""))
    fastest = min(p.tpot_ms for p in result.measured)
    assert 1e3 / result.choice.expected_tokens_per_s == pytest.approx(fastest) and fastest <= plain.tpot_ms
