"""Tune results persist per (GPU, model, budget, precision), are reused, and go stale on change."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest

from engine.tune.analytic import predict
from engine.tune.store import TuneStore, default_path, model_fingerprint, tune_key
from engine.tune.types import CurvePoint, TuneChoice, TuneResult
from tests.engine.tune.test_analytic import PROBE, PROFILE

MIB = 1 << 20


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-moe"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 8}')
    (folder / "model-00001.safetensors").write_bytes(b"\0" * 64)
    (folder / "README.md").write_text("not a weight")
    return folder


def _key(
    model_dir: Path, gpu_uuid: str | None = "GPU-1", budget: str = "6GiB", precision: str = "bf16"
) -> str:
    return tune_key(gpu_uuid, str(model_dir), model_fingerprint(model_dir), budget, precision)


def _result(key: str) -> TuneResult:
    profile = dataclasses.replace(PROFILE, acceptance_rate=0.8)
    prediction = predict(profile, PROBE, 124 * MIB, draft_lens=(2, 4))
    measured = (CurvePoint(1, 2, 11.5), CurvePoint(2, 2, 10.25), CurvePoint(3, 4, 12.0))
    choice = TuneChoice(cutoff_layer=2, draft_len=2, cache_experts=24, expected_tokens_per_s=1000 / 10.25)
    return TuneResult(PROBE, profile, prediction, measured, choice, key=key, reused=False)


def test_round_trip_of_a_full_result(tmp_path: Path, model_dir: Path) -> None:
    store = TuneStore(tmp_path / "config" / "tune.json")
    result = _result(_key(model_dir))
    store.put(result)
    loaded = TuneStore(store.path).get(result.key)  # a fresh store: read from disk
    assert loaded == dataclasses.replace(result, reused=True)
    assert isinstance(loaded.profile.verify_ms, tuple)
    assert isinstance(loaded.prediction.curve[0], CurvePoint)
    assert [path.name for path in store.path.parent.iterdir()] == ["tune.json"]  # no temp file left


def test_a_stored_result_is_reused_without_tuning_again(tmp_path: Path, model_dir: Path) -> None:
    store = TuneStore(tmp_path / "tune.json")
    tunings: list[str] = []

    def load(key: str) -> TuneResult:
        stored = store.get(key)
        if stored is not None:
            return stored
        tunings.append(key)
        result = _result(key)
        store.put(result)
        return result

    first, second = load(_key(model_dir)), load(_key(model_dir))
    assert len(tunings) == 1
    assert (first.reused, second.reused) == (False, True)
    assert second.choice == first.choice


def test_a_changed_gpu_model_budget_or_precision_misses(tmp_path: Path, model_dir: Path) -> None:
    store = TuneStore(tmp_path / "tune.json")
    stored_key = _key(model_dir)
    store.put(_result(stored_key))
    assert _key(model_dir) == stored_key  # stable while nothing changes
    changed = [
        _key(model_dir, gpu_uuid="GPU-2"),
        _key(model_dir, gpu_uuid=None),
        _key(model_dir, budget="8GiB"),
        _key(model_dir, precision="int8"),
    ]
    (model_dir / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 16}')
    changed.append(_key(model_dir))
    (model_dir / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 8}')
    assert _key(model_dir) == stored_key  # the same config again
    (model_dir / "model-00001.safetensors").write_bytes(b"\0" * 65)
    changed.append(_key(model_dir))
    assert len(set(changed)) == len(changed)
    assert all(store.get(key) is None for key in changed)


def test_fingerprint_ignores_files_that_are_not_weights(model_dir: Path) -> None:
    before = model_fingerprint(model_dir)
    (model_dir / "README.md").write_text("edited")
    assert model_fingerprint(model_dir) == before


def test_forget_makes_the_next_load_tune_again(tmp_path: Path, model_dir: Path) -> None:
    store = TuneStore(tmp_path / "tune.json")
    kept, dropped = _result(_key(model_dir, budget="4GiB")), _result(_key(model_dir))
    store.put(kept)
    store.put(dropped)
    store.forget(dropped.key)
    store.forget("never stored")
    assert store.get(dropped.key) is None
    assert store.get(kept.key) is not None


def test_a_corrupt_file_is_a_miss(tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tune.json"
    path.write_text('{"version": 1, "results": {')
    store = TuneStore(path)
    with caplog.at_level(logging.WARNING, logger="engine.tune.store"):
        assert store.get(_key(model_dir)) is None
    assert "unreadable" in caplog.text
    store.put(_result(_key(model_dir)))  # a put replaces the corrupt file
    assert store.get(_key(model_dir)) is not None


def test_an_old_format_entry_is_a_miss(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = TuneStore(tmp_path / "tune.json")
    key = _key(model_dir)
    store.put(_result(key))
    data = json.loads(store.path.read_text())
    del data["results"][key]["profile"]["verify_ms"]  # an older Profile without this field
    store.path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="engine.tune.store"):
        assert store.get(key) is None
    assert "verify_ms" in caplog.text
    data["results"][key] = {**_stored(key), "measured": [{"cutoff_layer": "2", "draft_len": 2, "tpot_ms": 1}]}
    store.path.write_text(json.dumps(data))
    assert store.get(key) is None  # a string where an int belongs
    store.path.write_text(json.dumps({"version": 0, "results": {key: _stored(key)}}))
    assert store.get(key) is None


def _stored(key: str) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(_result(key))))


def test_config_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", os.fspath(tmp_path))
    assert default_path() == tmp_path / "tune.json"
    assert TuneStore().path == tmp_path / "tune.json"
