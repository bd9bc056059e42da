"""A checkpoint whose experts do not fit the free host memory at their precision is kept as int8,
or int4, by itself — said in the log and in the model's info — instead of failing."""

import logging
from types import SimpleNamespace

import pytest

import engine.loader as loader
from engine.config import ExpertBudget, OffloadConfig
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


def test_on_the_cpu_with_no_link_to_simulate_experts_are_used_in_place(good_model):
    """The store is the only copy of the experts: no slot pool, nothing copied, every use a hit."""
    from engine.generation import generate_text
    from engine.prompts import greedy

    model = load_model(good_model, OffloadConfig(device="cpu", expert_budget=ExpertBudget.parse("all")))
    try:
        assert model.cache.in_place and model.cache.pool is None
        stats = generate_text(model, [1, 2, 3, 4], greedy(6)).stats
        assert stats.decode.misses == 0 and stats.decode.hits > 0
        assert stats.h2d_bytes == 0
        layer, expert = next(iter(model.cache.resident()))
        slot = model.cache.acquire((layer, expert))
        try:
            views = model.cache.wait(slot)
            stored = model.store.views(layer, expert)
            assert all(views[name].data_ptr() == stored[name].data_ptr() for name in stored)
        finally:
            model.cache.release(slot)
    finally:
        model.close()


def test_a_simulated_link_keeps_copying_into_the_slot_pool(good_model):
    model = load_model(
        good_model, OffloadConfig(device="cpu", expert_budget=ExpertBudget.parse("all"), sim_link_gbps=100.0)
    )
    try:
        assert not model.cache.in_place and model.cache.pool is not None
    finally:
        model.close()
