"""The on-disk cache of converted expert stores: hit, miss, stale, corrupt and unwritable entries."""

import logging
import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import engine.formats.native_experts
from engine.config import ExpertBudget, OffloadConfig
from engine.formats.int_quant import QuantSpec
from engine.loader import load_model
from engine.store import disk_cache as store_cache
from engine.store.disk_cache import StoreKey, cache_dir, load_or_build
from engine.store.host_store import quantize_store
from engine.tiny.models import make_tiny_model
from tests.engine.cache_helpers import make_store

INT4 = QuantSpec(bits=4)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MOE_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "stores"


@pytest.fixture
def model_folder(tmp_path) -> Path:
    """What the fingerprint looks at: a config and a weights file (the contents do not matter)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


class Builds:
    """`build` for load_or_build: a quantized hand-made store, counting the calls."""

    def __init__(self, seed: int = 0):
        self.store = quantize_store(make_store(seed), INT4)
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.store

    def load(self, key: StoreKey):
        store = self.store
        return load_or_build(key, store.layout, store.layer_indices, store.num_experts, False, self)


def same_bytes(a, b) -> bool:
    return a.layer_indices == b.layer_indices and all(
        torch.equal(a.layer_buffer(layer), b.layer_buffer(layer)) for layer in a.layer_indices
    )


def test_a_miss_builds_and_writes_then_a_hit_reads_it_back(model_folder, private_cache):
    builds, key = Builds(), StoreKey(model_folder, torch.float32, INT4)
    first = builds.load(key)
    assert builds.calls == 1 and first is builds.store
    assert key.path().parent == private_cache and key.path().is_file()
    assert [p.name for p in private_cache.iterdir()] == [key.path().name]  # no temporary file left
    second = builds.load(key)
    assert builds.calls == 1, "a hit must not convert again"
    assert second is not builds.store and same_bytes(second, builds.store)
    assert second.layout == builds.store.layout
    with safe_open(str(key.path()), framework="pt") as entry:  # a plain safetensors file
        assert torch.equal(entry.get_tensor("layer.2"), builds.store.layer_buffer(2))


def test_each_dtype_and_quantization_has_its_own_entry(model_folder):
    keys = [
        StoreKey(model_folder, torch.float32, INT4),
        StoreKey(model_folder, torch.bfloat16, INT4),
        StoreKey(model_folder, torch.float32, QuantSpec(bits=8)),
        StoreKey(model_folder, torch.float32, QuantSpec(bits=4, group_size=32)),
    ]
    assert len({key.path() for key in keys}) == len(keys)


def test_a_changed_model_makes_the_entry_stale(model_folder, caplog):
    builds, key = Builds(), StoreKey(model_folder, torch.float32, INT4)
    builds.load(key)
    weights = model_folder / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # re-downloaded
    with caplog.at_level(logging.INFO, logger="engine.store.disk_cache"):
        builds.load(key)
    assert builds.calls == 2
    assert "another version of the model" in caplog.text
    builds.load(key)
    assert builds.calls == 2, "the rebuilt entry is valid again"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "foreign"])
def test_a_corrupt_entry_is_deleted_and_rebuilt(model_folder, caplog, damage):
    builds, key = Builds(), StoreKey(model_folder, torch.float32, INT4)
    builds.load(key)
    path = key.path()
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "garbage":
        path.write_bytes(os.urandom(path.stat().st_size))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a valid safetensors file, but not a store
        save_file({"layer.0": torch.zeros(3)}, path)
    with caplog.at_level(logging.WARNING, logger="engine.store.disk_cache"):
        store = builds.load(key)
    assert builds.calls == 2 and store is builds.store
    assert "again" in caplog.text
    assert same_bytes(builds.load(key), builds.store) and builds.calls == 2


def test_writes_that_a_killed_process_left_are_removed(model_folder, private_cache):
    key = StoreKey(model_folder, torch.float32, INT4)
    private_cache.mkdir(parents=True)
    abandoned, in_progress = (private_cache / f"{key.path().name}.{tag}.tmp" for tag in ("old", "new"))
    for temp in (abandoned, in_progress):
        temp.write_bytes(b"half an entry")
    os.utime(abandoned, (0, 0))
    Builds().load(key)
    assert sorted(p.name for p in private_cache.iterdir()) == sorted([key.path().name, in_progress.name])


def test_a_full_disk_only_skips_the_cache(model_folder, monkeypatch, caplog, private_cache):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(store_cache.shutil, "disk_usage", lambda _: usage(10**6, 10**6 - 1000, 1000))
    builds, key = Builds(), StoreKey(model_folder, torch.float32, INT4)
    with caplog.at_level(logging.WARNING, logger="engine.store.disk_cache"):
        assert builds.load(key) is builds.store
    assert "Not caching" in caplog.text
    assert not key.path().exists()


def test_a_failed_write_leaves_no_file_and_the_load_goes_on(model_folder, monkeypatch, caplog, private_cache):
    def no_space(f, store, metadata):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_cache, "_write_safetensors", no_space)
    builds, key = Builds(), StoreKey(model_folder, torch.float32, INT4)
    with caplog.at_level(logging.WARNING, logger="engine.store.disk_cache"):
        assert builds.load(key) is builds.store
    assert "No space left" in caplog.text
    assert list(private_cache.iterdir()) == []


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_CHAT_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere" / "stores"
    monkeypatch.delenv("MOE_CHAT_CACHE_DIR")
    assert cache_dir().name == "stores" and "moe-chat" in str(cache_dir())


def test_second_quantized_load_converts_nothing(tmp_path, monkeypatch):
    folder = make_tiny_model(tmp_path / "olmoe", model_type="olmoe")
    converted = []
    real_quantize_into = engine.formats.native_experts.quantize_into

    def counting_quantize_into(weight, views, name, spec):
        converted.append(name)
        real_quantize_into(weight, views, name, spec)

    monkeypatch.setattr(engine.formats.native_experts, "quantize_into", counting_quantize_into)
    config = OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=4), expert_dtype="int4")
    stores = []
    for _ in range(2):
        model = load_model(folder, config)
        stores.append(model.store)
        model.close()
        assert len(converted) == 2 * 8 * 2, "2 layers × 8 experts × 2 matrices, converted once"
    assert same_bytes(*stores)
    assert stores[1].layout.quant == INT4


def test_native_stores_are_not_cached(tmp_path, private_cache):
    model = load_model(make_tiny_model(tmp_path / "m"), OffloadConfig(device="cpu"))
    model.close()
    assert not private_cache.exists()
