"""The `auto` defaults find the stored auto-tune result under the very key the tuner files it."""

from types import SimpleNamespace

import pytest

from engine.config import ExpertBudget, OffloadConfig
from engine.loader import load_model
from engine.resources import demo_model_dir
from engine.speculative.auto import TunedChoice
from engine.tune.run import tune
from engine.tune.store import TuneStore
from engine.worker.tuned import stored_choice


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


def test_a_stored_result_gives_its_cutoff_and_draft_length(demo, tmp_path):
    stored = SimpleNamespace(choice=SimpleNamespace(cutoff_layer=2, draft_len=5))
    assert stored_choice(demo, KeySpy(tmp_path / "tune.json", stored)) == TunedChoice(2, 5)
