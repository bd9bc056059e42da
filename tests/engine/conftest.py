"""Fixtures shared by the engine tests."""

import shutil
import threading
from pathlib import Path

import pytest

from engine.expert_store import ExpertStore
from engine.tiny_models import make_tiny_model
from engine.transfer import SimulatedLink
from tests.engine.cache_helpers import make_store

# -- shared by the error tests ----------------------------------------------------------------


@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("good") / "qwen3_moe")


@pytest.fixture
def broken(good_model, tmp_path) -> Path:
    """A private copy of the good folder for one test to break."""
    return Path(shutil.copytree(good_model, tmp_path / "model"))


@pytest.fixture
def no_link_thread_left():
    """Every model a test loads is closed, and every failed load stops its simulated link."""
    before = set(threading.enumerate())
    yield
    left = [t for t in set(threading.enumerate()) - before if t.name == "sim-link"]
    assert not left, "a simulated-link thread outlived its model"


# -- shared by the cache tests -----------------------------------------------------------------


@pytest.fixture
def store() -> ExpertStore:
    return make_store()


@pytest.fixture
def link():
    link = SimulatedLink(gbps=None)
    yield link
    link.close()
