"""A checkpoint whose experts do not fit the free host memory at their precision is kept as int8,
or int4, by itself — said in the log and in the model's info — instead of failing."""

import logging
from types import SimpleNamespace

import pytest

import engine.loader as loader
from engine.config import OffloadConfig
from engine.errors import DeviceOutOfMemoryError
from engine.loader import load_model


def with_free_memory(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(loader.psutil, "virtual_memory", lambda: SimpleNamespace(available=nbytes))


def store_bytes(good_model) -> int:
    model = load_model(good_model, OffloadConfig(device="cpu", dtype="bfloat16"))
    try:
        assert model.info().expert_dtype == "native"
        return model.store.nbytes
    finally:
        model.close()


@pytest.mark.parametrize(("spare", "expected"), [(0.75, "int8"), (0.4, "int4")])
def test_experts_that_do_not_fit_are_kept_in_fewer_bits(
    good_model, monkeypatch, caplog, spare, expected, tmp_path
):
    monkeypatch.setenv("MOE_CHAT_CACHE_DIR", str(tmp_path))  # a private store cache
    native = store_bytes(good_model)
    # the loader keeps max(2 GiB, a fifth) of the free memory for everything else
    with_free_memory(monkeypatch, 2 * 2**30 + int(native * spare))
    caplog.set_level(logging.WARNING, logger="engine.loader")
    model = load_model(good_model, OffloadConfig(device="cpu", dtype="bfloat16"))
    try:
        assert model.info().expert_dtype == expected
        assert model.store.nbytes <= native * spare
        assert f"kept as {expected}" in caplog.text
    finally:
        model.close()


def test_experts_that_do_not_fit_even_as_int4_are_a_clear_error(good_model, monkeypatch):
    with_free_memory(monkeypatch, 2 * 2**30)
    with pytest.raises(DeviceOutOfMemoryError, match="even as int4"):
        load_model(good_model, OffloadConfig(device="cpu", dtype="bfloat16"))
