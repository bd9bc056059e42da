"""`auto` speculation and prefetch: the model's drafter and SP-MoE, with clean fallbacks."""

import logging
from types import SimpleNamespace

import pytest

from engine.generation_config import GenerationConfig, SpecConfig
from engine.resources import demo_draft_dir, demo_model_dir
from engine.speculative.auto import TunedChoice, resolve, resolve_config

AUTO = SpecConfig(mode="auto")


def model(path, top_k: int = 2):
    return SimpleNamespace(path=path, top_k=top_k)


def test_the_demo_drafts_with_its_bundled_draft_and_prefetches_with_spmoe():
    chosen = resolve(model(demo_model_dir()), AUTO, "auto", None)
    assert chosen.spec.mode == "draft" and chosen.spec.draft_model == str(demo_draft_dir())
    assert (chosen.prefetch, chosen.cutoff, chosen.reasons) == ("spmoe", None, ())


def test_a_given_draft_model_is_used(tmp_path):
    chosen = resolve(model(tmp_path), SpecConfig(mode="auto", draft_model="/drafts/small"), "auto", None)
    assert (chosen.spec.mode, chosen.spec.draft_model, chosen.prefetch) == ("draft", "/drafts/small", "spmoe")


def test_no_draft_model_falls_back_to_self_and_says_why(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="engine.speculative.auto"):
        chosen = resolve(model(tmp_path / "qwen", top_k=8), AUTO, "auto", None)
    assert (chosen.spec.mode, chosen.prefetch) == ("self", "spmoe")
    assert "no draft model for qwen: drafting with the model itself, 1 of its 8 experts" in caplog.text


def test_experts_used_in_place_are_not_self_drafted_and_it_says_why(tmp_path, caplog):
    """A CPU run with every expert where the store holds it, or a device cache holding every expert:
    nothing crosses a link, so drafting with the model itself only adds steps; its own draft model
    still drafts (the demo's pays)."""
    in_place = SimpleNamespace(path=tmp_path / "qwen", top_k=8, cache=SimpleNamespace(in_place=True))
    with caplog.at_level(logging.INFO, logger="engine.speculative.auto"):
        chosen = resolve(in_place, AUTO, "auto", None)
    assert (chosen.spec.mode, chosen.prefetch) == ("none", "none")
    assert "every expert is used where it lies in memory" in caplog.text
    demo = SimpleNamespace(path=demo_model_dir(), top_k=2, cache=SimpleNamespace(in_place=True))
    assert resolve(demo, AUTO, "auto", None).spec.mode == "draft"
    linked = SimpleNamespace(path=tmp_path / "qwen", top_k=8, cache=SimpleNamespace(in_place=False))
    assert resolve(linked, AUTO, "auto", None).spec.mode == "self"
    every_expert_on_the_device = SimpleNamespace(in_place=False, holds_all=True)
    whole = SimpleNamespace(path=tmp_path / "qwen", top_k=8, cache=every_expert_on_the_device)
    assert resolve(whole, AUTO, "auto", None).spec.mode == "none"


def test_one_expert_per_token_cannot_self_draft_so_nothing_speculates(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="engine.speculative.auto"):
        chosen = resolve(model(tmp_path / "switch", top_k=1), AUTO, "auto", None)
    assert (chosen.spec.mode, chosen.prefetch) == ("none", "none")
    assert "self-drafting needs fewer experts per token" in caplog.text
    assert "nothing drafts: no prefetch" in caplog.text


def test_a_stored_tune_result_sets_draft_length_and_cutoff():
    chosen = resolve(model(demo_model_dir()), AUTO, "auto", None, TunedChoice(cutoff_layer=2, draft_len=6))
    assert (chosen.spec.mode, chosen.spec.draft_len, chosen.prefetch, chosen.cutoff) == (
        "draft",
        6,
        "spmoe",
        2,
    )


@pytest.mark.parametrize(
    ("tuned", "spec", "prefetch"),
    [(TunedChoice(cutoff_layer=-1, draft_len=0), "none", "none"), (TunedChoice(-1, 4), "draft", "none")],
)
def test_a_tune_result_that_measured_less_turns_it_off(tuned, spec, prefetch):
    chosen = resolve(model(demo_model_dir()), AUTO, "auto", None, tuned)
    assert (chosen.spec.mode, chosen.prefetch) == (spec, prefetch)


def test_explicit_settings_pass_through(tmp_path):
    config = GenerationConfig(spec=SpecConfig(mode="self", top_r=1), prefetch="next-layer", cutoff=1)
    tuned = TunedChoice(cutoff_layer=3, draft_len=0)
    assert resolve_config(model(tmp_path), config, tuned) == config


def test_a_chosen_cutoff_beats_the_tuned_one():
    chosen = resolve(model(demo_model_dir()), AUTO, "auto", 0, TunedChoice(cutoff_layer=4, draft_len=3))
    assert (chosen.prefetch, chosen.cutoff) == ("spmoe", 0)


def test_a_tune_result_that_measured_self_fastest_drafts_with_self_though_a_draft_exists():
    tuned = TunedChoice(cutoff_layer=1, draft_len=4, drafter="self")
    chosen = resolve(model(demo_model_dir()), SpecConfig(mode="auto", top_r=1), "auto", None, tuned)
    assert (chosen.spec.mode, chosen.spec.draft_len, chosen.prefetch, chosen.cutoff) == (
        "self",
        4,
        "spmoe",
        1,
    )
    assert "self-drafting fastest" in " ".join(chosen.reasons)
    drafted = resolve(model(demo_model_dir()), AUTO, "auto", None, TunedChoice(1, 4, drafter="draft"))
    assert drafted.spec.mode == "draft"


def test_a_tune_result_names_substitutes_next_layer_prefetch_and_cpu_misses(tmp_path):
    """What the tuner measured fastest is what `auto` runs: SubSpec's substitutes, next-layer
    prefetch in place of SP-MoE's, and misses on the CPU where the request leaves that to auto."""
    tuned = TunedChoice(-1, 3, drafter="substitute", prefetch="next-layer", cpu_experts="auto")
    config = GenerationConfig(spec=AUTO, prefetch="auto", cpu_experts="auto")
    chosen = resolve_config(model(tmp_path, top_k=4), config, tuned)
    assert (chosen.spec.mode, chosen.spec.draft_len, chosen.prefetch, chosen.cutoff) == (
        "substitute",
        3,
        "next-layer",
        None,
    )
    assert chosen.cpu_experts == "auto"
    plain = resolve_config(model(tmp_path), config, TunedChoice(-1, 0, prefetch="next-layer"))
    assert (plain.spec.mode, plain.prefetch) == ("none", "next-layer")
    asked = GenerationConfig(spec=SpecConfig(mode="self", top_r=1), prefetch="spmoe", cpu_experts="never")
    assert resolve_config(model(tmp_path), asked, tuned) == asked  # what a request names stays
