"""The `auto` defaults find the stored auto-tune result under the very key the tuner files it."""

from types import SimpleNamespace

import pytest

from engine.config import ExpertBudget, OffloadConfig
from engine.generation_config import GenerationConfig, SpecConfig
from engine.loader import load_model
from engine.resources import demo_model_dir
from engine.speculative.auto import TunedChoice
from engine.tune.run import tune
from engine.tune.store import TuneStore
from engine.tune.types import TuneChoice
from engine.worker.tuned import apply_policy, stored_choice, tuned_config


class KeySpy(TuneStore):
    """Records the keys asked for; stops `tune` right after its lookup (nothing is measured)."""

    def __init__(self, path, answer=None):
        super().__init__(path)
        self.keys: list[str] = []
        self.answer = answer

    def get(self, key):
        self.keys.append(key)
        if self.answer == "stop":
            raise LookupError("stop here")
        return self.answer


@pytest.fixture(scope="module")
def demo():
    model = load_model(
        str(demo_model_dir()), OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=24))
    )
    yield model
    model.close()


def test_the_lookup_uses_the_tuners_key(demo, tmp_path):
    tuner = KeySpy(tmp_path / "tune.json", answer="stop")
    with pytest.raises(LookupError):
        tune(demo, store=tuner)
    lookup = KeySpy(tmp_path / "tune.json")
    assert stored_choice(demo, lookup) is None  # never tuned
    assert lookup.keys == tuner.keys


def test_a_stored_result_gives_what_it_chose(demo, tmp_path):
    stored = SimpleNamespace(choice=TuneChoice(2, 5, 24, 30.0))
    assert stored_choice(demo, KeySpy(tmp_path / "tune.json", stored)) == TunedChoice(2, 5)
    full = SimpleNamespace(choice=TuneChoice(-1, 4, 24, 30.0, "substitute", "", "next-layer", "mrs", "auto"))
    expected = TunedChoice(-1, 4, "substitute", "next-layer", "mrs", "auto")
    assert stored_choice(demo, KeySpy(tmp_path / "tune.json", full)) == expected


def test_a_requests_config_follows_the_stored_choice_and_its_cache_policy(demo, tmp_path):
    """The worker's and the command line's `auto`: drafter and prefetch from the stored result, and
    the expert cache under the policy the tune measured fastest (put in place once)."""
    stored = SimpleNamespace(choice=TuneChoice(-1, 3, 24, 30.0, "self", "", "next-layer", "mrs"))
    store = KeySpy(tmp_path / "tune.json", stored)
    assert demo.cache.policy.name == "lru"
    try:
        config = tuned_config(demo, GenerationConfig(spec=SpecConfig(mode="auto"), prefetch="auto"), store)
        assert (config.spec.mode, config.spec.draft_len, config.prefetch) == ("self", 3, "next-layer")
        policy = demo.cache.policy
        assert policy.name == "mrs"
        tuned_config(demo, GenerationConfig(), store)
        assert demo.cache.policy is policy  # in place already: the cache is not emptied again
    finally:
        apply_policy(demo, "lru")
    assert demo.cache.policy.name == "lru"


@pytest.mark.slow
def test_a_tune_of_one_model_is_not_another_models(demo, tmp_path):
    """The result is filed under the tuned model (and GPU, budget, precision): another model finds
    nothing and runs its own `auto` defaults."""
    from engine.tiny.models import make_tiny_model
    from engine.tune.run import TuneConfig

    store = TuneStore(tmp_path / "tune.json")
    tune(demo, TuneConfig(new_tokens=4, passes=1), store=store)
    assert stored_choice(demo, store) is not None
    other = load_model(
        make_tiny_model(tmp_path / "other"),
        OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=24)),
    )
    try:
        assert stored_choice(other, store) is None
        assert (
            tuned_config(other, GenerationConfig(), store) == GenerationConfig()
        )  # the defaults, as they were
    finally:
        other.close()
