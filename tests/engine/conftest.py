"""Fixtures shared by the engine tests."""

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.device_cache.transfer import SimulatedLink
from engine.store.host_store import ExpertStore
from engine.tiny.models import make_tiny_model
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


@pytest.fixture(scope="module")
def one_compute_thread():
    """Tiny matrices gain nothing from intra-op threads, whose spinning starves the link and
    prefetch threads on a small machine (a run takes 5 to 20 times longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "expert-prefetch"]


@pytest.fixture
def no_worker_left():
    """Fails the test if a prefetch worker thread outlives it."""
    before = set(prefetch_threads())
    yield
    deadline = time.monotonic() + 5
    while set(prefetch_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(prefetch_threads()) - before, "a prefetch worker outlived its test"
